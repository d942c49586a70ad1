"""llama.cpp as an engine (llama-cpp-python): tiny random models exported to GGUF, checked against transformers
and against llama.cpp's own one-token decoding."""

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.drafting.base import NoDraft
from specdraft.drafting.llamacpp import LlamaCppDrafter, LlamaCppNgramDrafter
from specdraft.drafting.lookup import LookupDrafter
from specdraft.drafting.speculative import speculative_generate
from specdraft.model.llamacpp import (
    LlamaCppModel,
    LlamaCppTarget,
    batched_against_sequential,
    requantize,
    vocab_compatible,
)
from specdraft.model.targets import TorchTarget
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'specdraft[llama]')")

PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, tiny_model_dir_module):
    """(float dir, F32 GGUF of it, Q4_1 GGUF of its pack)."""
    src = tiny_model_dir_module
    root = tmp_path_factory.mktemp("gguf")
    run_export(ExportConfig(model_dir=str(src), format="gguf", out=str(root / "f32.gguf"), dtype="f32"))
    packed = run_pack(PackConfig(checkpoint=str(src), out=str(root / "model"))).out
    run_export(ExportConfig(model_dir=str(packed), format="gguf", out=str(root / "q4.gguf")))
    return src, root / "f32.gguf", root / "q4.gguf"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_model_dir_module(request, tiny_qwen3_dir, tiny_llama_dir):
    return {"qwen3": tiny_qwen3_dir, "llama": tiny_llama_dir}[request.param]


def test_f32_gguf_logits_match_transformers(ggufs):
    src, f32, _ = ggufs
    model = LlamaCppModel(f32, n_ctx=128, threads=1)
    try:
        ours = model.decode(PROMPT, 0, n_logits=len(PROMPT))
    finally:
        model.close()
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]
    assert ours.shape == tuple(ref.shape)
    assert abs(ours - ref.numpy()).max() < 0.05 * float(ref.abs().max())
    assert (ours.argmax(-1) == ref.argmax(-1).numpy()).all()


def test_llama_cpp_greedy_is_transformers_greedy_on_a_float_file(ggufs):
    src, f32, _ = ggufs
    target = LlamaCppTarget(f32, n_ctx=128, threads=1)
    try:
        ours = target.greedy(PROMPT, 24)
    finally:
        target.close()
    ref = TorchTarget(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)).greedy(PROMPT, 24)
    # (longer runs of a random model reach near-ties, where float32 sums in another order may part)
    assert ours.tokens == ref.tokens


def test_truncate_and_verify_give_what_one_token_steps_give(ggufs):
    _, f32, _ = ggufs
    target = LlamaCppTarget(f32, n_ctx=128, threads=1)
    try:
        plain = target.greedy(PROMPT, 12).tokens
        target.prefill(PROMPT)
        target.verify([plain[0], 7, 8, 9], len(PROMPT))  # a wrong draft, then cut back to the prompt + 1
        target.truncate(len(PROMPT) + 1)
        assert target.model.tokens == PROMPT + plain[:1]
        preds = target.verify(plain[1:6], len(PROMPT) + 1)
        assert preds == plain[2:7]
        with pytest.raises(ValueError, match="cache holds only"):
            target.verify([1], len(PROMPT) + 50)
    finally:
        target.close()


@pytest.mark.parametrize("drafter_kind", ["self", "draft", "lookup", "ngram", "none"])
def test_speculation_in_llama_cpp_gives_the_plain_output(ggufs, drafter_kind):
    _, f32, q4 = ggufs
    target = LlamaCppTarget(f32, n_ctx=256, threads=1)
    drafter = {"self": lambda: LlamaCppDrafter(f32, n_ctx=256, threads=1), "lookup": LookupDrafter,
               "draft": lambda: LlamaCppDrafter(q4, n_ctx=256, threads=1), "ngram": LlamaCppNgramDrafter,
               "none": NoDraft}[drafter_kind]()
    try:
        plain = target.greedy(PROMPT, 48)
        for k in (1, 3, 8):
            gen = speculative_generate(target, drafter, PROMPT, 48, k)
            # a tiny random model's logits are far apart: no near-tie for the batched kernels to flip
            assert gen.tokens == plain.tokens, (drafter_kind, k)
            if drafter_kind == "self":
                assert gen.accepted == gen.drafted > 0  # the target's own file drafts what it decodes
    finally:
        drafter.close()
        target.close()


def test_ngram_drafter_is_llama_cpp_pythons_prompt_lookup():
    drafter = LlamaCppNgramDrafter()
    assert drafter.draft_one([1, 2, 3, 9, 9, 1, 2], 3) == [3, 9, 9]  # the first occurrence of the last 2 tokens
    assert drafter.draft_one([1, 2, 3], 3) == []


def test_a_corrupt_or_foreign_file_is_refused_with_its_path(ggufs, tmp_path):
    _, f32, _ = ggufs
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32.read_bytes()[:4096])
    with pytest.raises(ValueError, match="cut.gguf: llama.cpp could not load it"):
        LlamaCppModel(cut, n_ctx=64, threads=1)
    foreign = tmp_path / "weights.safetensors"
    foreign.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="weights.safetensors: not a GGUF file"):
        LlamaCppTarget(foreign)
    with pytest.raises(ValueError, match="no such GGUF file"):
        LlamaCppDrafter(tmp_path / "missing.gguf")


def test_requantize_and_vocabulary_check(ggufs, tmp_path):
    _, f32, q4 = ggufs
    out = requantize(q4, tmp_path / "back.gguf", "F32", threads=1)
    assert out.read_bytes()[:4] == b"GGUF" and out.stat().st_size > q4.stat().st_size
    # every tensor of the F32 file is the Q4_1 file's, dequantised (gguf-py, llama.cpp's reference reader)
    source = {t.name: t for t in gguf.GGUFReader(q4).tensors}
    back = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert back.keys() == source.keys()
    for name, tensor in back.items():
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        expected = gguf.quants.dequantize(source[name].data, source[name].tensor_type)
        assert np.array_equal(np.asarray(tensor.data).reshape(expected.shape), expected), name
    check = vocab_compatible(f32, q4)
    assert check["compatible"] and check["token_texts_differing"] == 0
    with pytest.raises(ValueError, match="file type"):
        requantize(q4, tmp_path / "x.gguf", "Q3_K")


def test_batched_against_sequential_on_a_float_file(ggufs):
    _, f32, _ = ggufs
    target = LlamaCppTarget(f32, n_ctx=128, threads=1)
    try:
        tokens = target.greedy(PROMPT, 16).tokens
        out = batched_against_sequential(target.model, PROMPT, tokens, pass_tokens=5)
        whole = batched_against_sequential(target.model, PROMPT, tokens, pass_tokens=len(tokens))
        with pytest.raises(ValueError, match="need a prompt"):
            batched_against_sequential(target.model, [], tokens, pass_tokens=5)
    finally:
        target.close()
    # F32 weights: the two passes sum in other orders, nothing more
    for res in (out, whole):
        assert res["positions"] == len(tokens) and res["argmax_differs"] == 0
        assert 0 <= res["max_logit_difference"] < 1e-3 * res["logit_scale"]
