"""The pack stage end to end on tiny models: the packed dir, the estimate, GPTQ calibration, lossless grids."""

import json
import logging
import os
import shutil

import pytest
import torch
from transformers import GenerationConfig, Qwen3Config

from packing import REFERENCE_QWEN3_1_7B_BYTES, float_model, logits
from specdraft.cli import main
from specdraft.core.io import sha256_file
from specdraft.model.export import ASSISTED_GENERATION
from specdraft.model.loader import load_packed_model
from specdraft.model.specs import weights_sha256
from specdraft.model.tiny import build_tiny_model
from specdraft.quant import gptq, q4g, qd4
from specdraft.stages.pack import PackConfig, run_pack

# -------------------------------------------------------------------------------------------- pack

def test_pack_writes_the_model_dir(packed_qwen3, tiny_qwen3_dir):
    out = packed_qwen3.out
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "draft.qd4", "architecture.json", "pack_recipe.json"):
        assert (out / name).is_file(), name
    arch = json.loads((out / "architecture.json").read_text())
    weight = out / arch["weight_file"]
    assert arch["bytes"] == weight.stat().st_size == packed_qwen3.bytes
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # a shared artifact, not mkdtemp's private 0700
    for name in ("draft.qd4", "architecture.json", "config.json"):  # not mkstemp's private 0600
        assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert arch["sha256"] == packed_qwen3.sha256 == sha256_file(weight)
    assert (arch["layers"], arch["hidden"], arch["heads"], arch["kv_heads"], arch["intermediate"]) == (2, 64, 4, 2, 128)
    assert arch["tied_embeddings"] is True and arch["model_type"] == "qwen3"
    header = qd4.read_qd4_header(weight)
    names = [e.name for e in header.entries]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: stored once
    assert arch["tensors"] == len(names)
    assert arch["parameters"] == sum(torch.Size(e.shape).numel() for e in header.entries)
    recipe = json.loads((out / "pack_recipe.json").read_text())
    assert recipe["source"]["weights_sha256"] == weights_sha256(tiny_qwen3_dir)
    assert recipe["format"]["group_size"] == header.group_size == 64
    assert recipe["encodings"]["model.embed_tokens.weight"] == "q4g"
    assert recipe["encodings"]["model.norm.weight"] == "f16"
    assert {e.name: e.encoding for e in header.entries} == recipe["encodings"]
    assert recipe["output"]["sha256"] == arch["sha256"]
    assert recipe["source"]["path"] == str(tiny_qwen3_dir)
    assert {"versions", "created_at", "git_sha", "config"} <= set(recipe)


def test_generation_config_carries_the_drafts_assisted_generation_settings(packed_qwen3, tiny_qwen3_dir):
    """The checkpoint's generation config (eos / pad ids kept) plus what transformers' assisted generation reads
    from the assistant's own config; the recipe records what was added."""
    out = packed_qwen3.out
    ours = json.loads((out / "generation_config.json").read_text())
    theirs = json.loads((tiny_qwen3_dir / "generation_config.json").read_text())
    assert ours == {**theirs, **ASSISTED_GENERATION}
    recipe = json.loads((out / "pack_recipe.json").read_text())
    assert recipe["assisted_generation"] == ASSISTED_GENERATION
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold,
            gen.eos_token_id, gen.pad_token_id) == (4, "constant", 0.0, theirs["eos_token_id"],
                                                    theirs["pad_token_id"])


def test_estimate_matches_what_pack_writes(tiny_model_dir, tmp_path):
    for kwargs in ({}, {"group_size": 32, "embedding_encoding": "f16"}, {"fit": "lsq", "raw_encoding": "f32"}):
        result = run_pack(PackConfig(checkpoint=str(tiny_model_dir), out=str(tmp_path / "p"), overwrite=True,
                                     **kwargs))
        estimate = run_pack(PackConfig(estimate=str(tiny_model_dir / "config.json"), **kwargs))
        assert estimate.bytes == result.bytes == (tmp_path / "p" / "draft.qd4").stat().st_size, kwargs


def test_estimate_qwen3_1_7b_near_reference(tmp_path, capsys):
    config = Qwen3Config(num_hidden_layers=28, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                         dtype="bfloat16")
    config.save_pretrained(tmp_path)
    assert main(["pack", "--estimate", str(tmp_path / "config.json")]) == 0
    printed = int(capsys.readouterr().out.strip())
    assert abs(printed / REFERENCE_QWEN3_1_7B_BYTES - 1) < 0.03
    # And not by luck: the same model at G=32 or with an f16 embedding is clearly bigger.
    assert qd4.estimate_packed_bytes(config, 32) > 1.05 * REFERENCE_QWEN3_1_7B_BYTES
    assert qd4.estimate_packed_bytes(config, embedding_encoding="f16") > 1.3 * REFERENCE_QWEN3_1_7B_BYTES


def test_cli_end_to_end(tiny_llama_dir, tmp_path, caplog, capsys, monkeypatch):
    out = tmp_path / "packed"
    assert main(["pack", "--checkpoint", str(tiny_llama_dir), "--out", str(out), "--keep-embedding", "f16"]) == 0
    header = qd4.read_qd4_header(out / "draft.qd4")
    assert header.entry("model.embed_tokens.weight").encoding == "f16"
    assert header.entry("model.layers.0.mlp.up_proj.weight").encoding == "q4g"
    # a stage's error on bad input: one line naming the path and the reason, exit code 2, no traceback
    capsys.readouterr()
    assert main(["pack", "--checkpoint", str(tiny_llama_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"specdraft pack: error: {out}" in err and "not empty" in err
    assert "Traceback" not in err
    monkeypatch.setenv("SPECDRAFT_TRACEBACK", "1")  # the traceback on request
    with pytest.raises(FileExistsError, match="not empty"):
        main(["pack", "--checkpoint", str(tiny_llama_dir), "--out", str(out)])
    with caplog.at_level(logging.INFO, logger="specdraft"):
        model, info = load_packed_model(out)
    assert "loaded qd4 missing=0 unexpected=0" in caplog.text
    assert (info.missing, info.unexpected) == (0, 0)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give --checkpoint"),
    ({"checkpoint": "x"}, "give --checkpoint"),
    ({"out": "y"}, "give --checkpoint"),
    ({"estimate": "c.json", "checkpoint": "x"}, "--estimate takes a config alone"),
    ({"estimate": "c.json", "out": "y"}, "--estimate takes a config alone"),
    ({"estimate": "c.json", "group_size": 63}, "even"),
    ({"estimate": "c.json", "group_size": 0}, "greater than or equal"),
    ({"checkpoint": "x", "out": "y", "fit": "gptq"}, "needs --calibration"),
    ({"checkpoint": "x", "out": "y", "calibration": "t.jsonl"}, "only used by --fit gptq"),
])
def test_config_combinations_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackConfig(**kwargs)


def test_cli_refuses_bad_combination(tiny_qwen3_dir):
    with pytest.raises(SystemExit):
        main(["pack", "--checkpoint", str(tiny_qwen3_dir), "--estimate", str(tiny_qwen3_dir / "config.json")])


def test_checkpoint_missing_weights_refused(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = shutil.copytree(tiny_qwen3_dir, tmp_path / "ckpt")
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj"):
        run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_out_must_be_a_directory_or_absent(tiny_qwen3_dir, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for out, overwrite, says in [("file", True, "is not a directory"), ("full", False, "pass --overwrite")]:
        with pytest.raises(FileExistsError, match=says):  # before any packing work
            run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir), out=str(tmp_path / out), overwrite=overwrite))
    assert (tmp_path / "file").read_text() == "x" and (tmp_path / "full" / "x").read_text() == "x"


def _traces(path, count=12, length=40, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(count):
            ids = torch.randint(0, 300, (length,), generator=gen).tolist()
            f.write(json.dumps({"id": f"t{i}", "source": "test", "prompt_ids": ids[:16],
                                "completion_ids": ids[16:]}) + "\n")
    return path


def test_gptq_pack_is_calibrated_and_recorded(tiny_qwen3_dir, tmp_path):
    """--fit gptq: every q4g tensor gets calibrated codes, the recipe names the calibration traces, the model
    loads like any packed model, and on the calibration text it stays closer to the float model than the
    plain rounding does (what the calibration optimises, layer by layer)."""
    traces = _traces(tmp_path / "traces.jsonl")
    cfg = dict(checkpoint=str(tiny_qwen3_dir), group_size=16)
    gptq = run_pack(PackConfig(**cfg, out=str(tmp_path / "g"), fit="gptq", calibration=str(traces),
                               calibration_sequences=8)).out
    plain = run_pack(PackConfig(**cfg, out=str(tmp_path / "m"))).out
    recipe = json.loads((gptq / "pack_recipe.json").read_text())
    header = qd4.read_qd4_header(gptq / "draft.qd4")
    q4g = [e.name for e in header.entries if e.encoding == "q4g"]
    assert header.producer["fit"] == "gptq" and recipe["format"]["fit"] == "gptq"
    assert recipe["calibration"]["sha256"] == sha256_file(traces)
    assert recipe["calibration"]["sequences"] == 8 and recipe["calibration"]["tokens"] == 8 * 40
    assert recipe["calibration"]["calibrated_tensors"] == len(q4g) > 0
    assert (gptq / "draft.qd4").stat().st_size == (plain / "draft.qd4").stat().st_size
    again = run_pack(PackConfig(**cfg, out=str(tmp_path / "g2"), fit="gptq", calibration=str(traces),
                                calibration_sequences=8)).out
    assert sha256_file(again / "draft.qd4") == sha256_file(gptq / "draft.qd4")  # deterministic at equal threads
    reference = float_model(tiny_qwen3_dir)
    ids = torch.tensor([json.loads(line)["prompt_ids"] + json.loads(line)["completion_ids"]
                        for line in traces.read_text().splitlines()[:8]])
    ref = logits(reference, ids)
    errors = {}
    for name, out in (("gptq", gptq), ("minmax", plain)):
        model, info = load_packed_model(out)
        assert info.missing == 0 and info.unexpected == 0
        errors[name] = float((logits(model, ids) - ref).norm() / ref.norm())
    assert errors["gptq"] < errors["minmax"], errors


def test_layers_on_a_finer_grid_are_stored_on_it_losslessly(tmp_path, monkeypatch):
    """A layer whose weights sit exactly on a G=32 grid (kept unchanged from a Q4_1 GGUF) is stored at G=32,
    bit-exact, by both fits; the others at --group-size. --no-lossless-grids stores everything at G=64."""
    src = build_tiny_model(tmp_path / "src", "qwen3")
    model = float_model(src)
    with torch.no_grad():
        for m in model.model.layers[0].modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(q4g.dequantize(q4g.quantize(m.weight, 32)))
    model.save_pretrained(src)
    on_grid = {n for n, p in model.named_parameters() if n.startswith("model.layers.0.") and p.dim() == 2}
    traces = _traces(tmp_path / "traces.jsonl")
    plain = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "m")))
    gptq_calls = []
    gptq_quantize = gptq.gptq_quantize
    monkeypatch.setattr(gptq, "gptq_quantize", lambda w, *a, **kw: gptq_calls.append(w.shape) or gptq_quantize(
        w, *a, **kw))
    calibrated = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "g"), fit="gptq", calibration=str(traces),
                               calibration_sequences=8))
    # the 7 matrices on their grid keep their codes; only the other layer's 7 and the tied head go through GPTQ
    assert len(gptq_calls) == 8
    off = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "off"), lossless_grids=False))
    assert len(on_grid) == 7
    for result in (plain, calibrated):
        recipe = json.loads((result.out / "pack_recipe.json").read_text())
        assert recipe["group_sizes"] == {n: 32 for n in sorted(on_grid)}
        header = qd4.read_qd4_header(result.out / "draft.qd4")
        assert {e.name for e in header.entries if e.group_size == 32} == on_grid
        assert {e.group_size for e in header.entries if e.name not in on_grid} == {64, None}
        arch = json.loads((result.out / "architecture.json").read_text())
        assert arch["q4g_tensors_by_group_size"] == {"32": 7, "64": len(header.entries) - 7 - sum(
            e.encoding != "q4g" for e in header.entries)}
        stored = qd4.load_qd4(result.out / "draft.qd4")
        params = dict(model.named_parameters())
        assert all(torch.equal(stored[n], params[n]) for n in on_grid), result.out
        assert not torch.equal(stored["model.layers.1.mlp.up_proj.weight"], params["model.layers.1.mlp.up_proj.weight"])
    header_off = qd4.read_qd4_header(off.out / "draft.qd4")
    assert {e.group_size for e in header_off.entries} == {64, None}
    assert json.loads((off.out / "pack_recipe.json").read_text())["group_sizes"] == {}
    assert plain.bytes > off.bytes  # +0.5 bit per weight of the 7 matrices kept at G = 32
    packed, info = load_packed_model(plain.out)  # the strict loader reads each tensor at its own G
    assert info.missing == 0
    assert torch.equal(packed.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)


def test_gptq_pack_refuses_bad_calibration(tiny_qwen3_dir, tmp_path):
    bad = tmp_path / "other_vocab.jsonl"
    bad.write_text(json.dumps({"id": "t", "source": "x", "prompt_ids": [1, 2], "completion_ids": [99999]}) + "\n")
    for path, message in ((tmp_path / "missing.jsonl", "no such calibration traces file"),
                          (bad, "outside the draft's vocabulary")):
        with pytest.raises((ValueError, OSError), match=message):
            run_pack(PackConfig(checkpoint=str(tiny_qwen3_dir), out=str(tmp_path / "out"), fit="gptq",
                                calibration=str(path)))
        assert not (tmp_path / "out").exists()
