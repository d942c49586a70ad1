"""The strict QD04 loader (model.loader.load_packed_model): exact round trips, strictness, and corruption refused
before any model is built."""

import json
import logging
import struct

import pytest
import torch
from transformers import AutoModelForCausalLM

from packing import float_model, logits, token_ids
from specdraft.model.loader import load_packed_model
from specdraft.model.tiny import build_tiny_model
from specdraft.quant import qd4
from specdraft.quant.qd4 import QD4Error
from specdraft.stages.pack import PackConfig, run_pack

# -------------------------------------------------------------------------------------------- load

def test_loader_is_exact_and_strict(tiny_model_dir, tmp_path, caplog):
    """The packed model is the float architecture holding exactly the dequantised weights, re-tied."""
    out = run_pack(PackConfig(checkpoint=str(tiny_model_dir), out=str(tmp_path / "p"))).out
    with caplog.at_level(logging.INFO, logger="specdraft"):
        model, info = load_packed_model(out)
    assert "loaded qd4 missing=0 unexpected=0" in caplog.text
    assert info.missing == 0 and info.unexpected == 0 and info.load_seconds > 0
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert not model.training and model.dtype == torch.float32
    reference = float_model(tiny_model_dir)
    missing, unexpected = reference.load_state_dict(qd4.load_qd4(out / "draft.qd4"), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    ids = token_ids()
    assert torch.allclose(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)


def test_untied_model_round_trip(tmp_path):
    src = build_tiny_model(tmp_path / "untied", "llama", tie_embeddings=False)
    out = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "p"))).out
    names = [e.name for e in qd4.read_qd4_header(out / "draft.qd4").entries]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    model, info = load_packed_model(out)
    assert info.missing == 0 and model.lm_head.weight is not model.get_input_embeddings().weight
    assert torch.equal(model.lm_head.weight, qd4.load_qd4(out / "draft.qd4")["lm_head.weight"])


def test_near_lossless_group_size_agrees_with_float(tiny_model_dir, tmp_path):
    """G=2 stores every value as its group's min or max: only fp16 rounding (~2^-11 relative) is lost,
    so the logits must be close and the greedy tokens agree almost everywhere."""
    out = run_pack(PackConfig(checkpoint=str(tiny_model_dir), out=str(tmp_path / "p"), group_size=2)).out
    packed, _ = load_packed_model(out)
    ids = token_ids()
    ref, got = logits(float_model(tiny_model_dir), ids), logits(packed, ids)
    assert (got - ref).norm() / ref.norm() < 1e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_default_packing_error_is_quantisation_noise(tiny_model_dir, tmp_path):
    """At G=64 the tiny random model (init 0.2, chaotic) drifts a lot; bound the drift by that of the float
    model with the *same* weight errors shuffled at random within each tensor. A wrong nibble order, group
    axis or scale would make the packed model far worse than this noise baseline."""
    out = run_pack(PackConfig(checkpoint=str(tiny_model_dir), out=str(tmp_path / "p"))).out
    packed, _ = load_packed_model(out)
    reference = float_model(tiny_model_dir)
    ids = token_ids()
    ref, got = logits(reference, ids), logits(packed, ids)
    generator = torch.Generator().manual_seed(0)
    noisy = {}
    for name, w in qd4.load_qd4(out / "draft.qd4").items():
        err = (w - reference.state_dict()[name]).flatten()
        noisy[name] = reference.state_dict()[name] + err[torch.randperm(err.numel(), generator=generator)].view_as(w)
    baseline_model = float_model(tiny_model_dir)
    baseline_model.load_state_dict(noisy, strict=False)
    baseline = logits(baseline_model, ids)
    packed_err = float((got - ref).norm() / ref.norm())
    noise_err = float((baseline - ref).norm() / ref.norm())
    assert 0 < packed_err <= 1.25 * noise_err


def test_bfloat16_load(packed_qwen3):
    model, info = load_packed_model(packed_qwen3.out, dtype=torch.bfloat16)
    assert info.dtype == "bfloat16" and all(p.dtype == torch.bfloat16 for p in model.parameters())
    fp32, _ = load_packed_model(packed_qwen3.out)
    ids = token_ids()
    a, b = logits(fp32, ids), logits(model, ids)
    assert (a - b).norm() / a.norm() < 0.1


def test_unexpected_tensor_is_reported_and_missing_is_an_error(packed_copy):
    weight = packed_copy / "draft.qd4"
    header, stored = qd4.read_qd4(weight)
    tensors = qd4.dequantize_state(stored)
    encodings = {e.name: e.encoding for e in header.entries}
    arch = json.loads((packed_copy / "architecture.json").read_text())

    def rewrite(t, enc):
        qd4.write_qd4(weight, t, enc, header.group_size)
        arch["bytes"] = weight.stat().st_size
        (packed_copy / "architecture.json").write_text(json.dumps(arch))

    rewrite({**tensors, "extra.weight": torch.ones(3)}, {**encodings, "extra.weight": "f32"})
    model, info = load_packed_model(packed_copy)
    assert info.unexpected == 1 and info.unexpected_keys == ["extra.weight"] and info.missing == 0

    gone = ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    rewrite({k: v for k, v in tensors.items() if k not in gone}, encodings)
    with pytest.raises(QD4Error, match="missing weights") as e:
        load_packed_model(packed_copy)
    assert all(name in str(e.value) for name in gone)


# ------------------------------------------------------------------------------ corruption: refused early

@pytest.fixture
def no_model_build(monkeypatch):
    """Any refusal must come before a model is built (a shape-only model on the meta device is no model)."""
    build = AutoModelForCausalLM.from_config

    def refuse(*args, **kwargs):
        if torch.empty(0).device.type != "meta":
            raise AssertionError("a model was built for a corrupt packed dir")
        return build(*args, **kwargs)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", refuse)


def _corrupt(path, fn):
    data = bytearray(path.read_bytes())
    fn(data)
    path.write_bytes(bytes(data))


def _expect_refusal(model_dir, message):
    with pytest.raises(QD4Error, match=message) as e:
        load_packed_model(model_dir)
    assert str(model_dir) in str(e.value)


def test_refuses_bad_magic(packed_copy, no_model_build):
    _corrupt(packed_copy / "draft.qd4", lambda d: d.__setitem__(slice(0, 4), b"QD03"))
    _expect_refusal(packed_copy, "bad magic")


def test_refuses_unknown_version(packed_copy, no_model_build):
    _corrupt(packed_copy / "draft.qd4", lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 9)))
    _expect_refusal(packed_copy, "unknown QD04 format version 9")


def test_refuses_truncated(packed_copy, no_model_build):
    _corrupt(packed_copy / "draft.qd4", lambda d: d.__delitem__(slice(-1000, None)))
    _expect_refusal(packed_copy, "truncated")


def test_refuses_payload_checksum_mismatch(packed_copy, no_model_build):
    def flip(d):
        d[len(d) // 2] ^= 0x10
    _corrupt(packed_copy / "draft.qd4", flip)
    _expect_refusal(packed_copy, "payload checksum mismatch")


def test_refuses_header_shape_not_config(packed_copy, no_model_build):
    config = json.loads((packed_copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (packed_copy / "config.json").write_text(json.dumps(config))
    _expect_refusal(packed_copy, r"header shape does not match config.json: model.layers.0.mlp.gate_proj.weight: "
                                 r"file \[128, 64\] vs config \[96, 64\]")


def test_refuses_byte_count_not_architecture(packed_copy, no_model_build):
    arch = json.loads((packed_copy / "architecture.json").read_text())
    arch["bytes"] += 64
    (packed_copy / "architecture.json").write_text(json.dumps(arch))
    _expect_refusal(packed_copy, "byte count .* does not match architecture.json")


def test_refuses_missing_architecture(packed_copy, no_model_build):
    (packed_copy / "architecture.json").unlink()
    _expect_refusal(packed_copy, "not a packed model dir")
