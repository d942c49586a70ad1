"""The Qwen3-specific code paths on the real Qwen3 tokenizer and template (../shared/models/qwen3-tokenizer):
the non-thinking prompt, the 151,936-row embedding through pack, load, GGUF export and llama.cpp's vocabulary
check. Skipped, with the reason, where ../shared is absent; the rest of the suite does not need it."""

import pytest
import torch

from specdraft.model.chat import encode_prompts
from specdraft.model.compat import check_pipeline_models
from specdraft.model.loader import load_draft
from specdraft.model.reference import QWEN3_EOS, QWEN3_VOCAB_ROWS, Qwen3Shape, build_reference_draft
from specdraft.model.specs import load_config, tokenizer_from_dir
from specdraft.quant import qd4
from specdraft.rehearsal import QWEN3_TOKENIZER_DIR
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack

TOKENIZER = QWEN3_TOKENIZER_DIR / "tokenizer"
LLAMA_VOCAB = QWEN3_TOKENIZER_DIR / "ggml-vocab-qwen2.gguf"
pytestmark = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file(),
                                reason=f"the real Qwen3 tokenizer is not at {TOKENIZER} (../shared is absent)")
# <|im_start|>assistant\n<think>\n\n</think>\n\n
NON_THINKING_TAIL = [151644, 77091, 198, 151667, 271, 151668, 271]
SMALL = Qwen3Shape(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    """(untied target dir, tied draft dir): random Qwen3-shaped models around the real tokenizer."""
    root = tmp_path_factory.mktemp("qwen3_ref")
    target = build_reference_draft(root / "target", TOKENIZER, SMALL, seed=0)
    draft = build_reference_draft(root / "draft", TOKENIZER, Qwen3Shape(**{**SMALL.__dict__, "tie_embeddings": True}),
                                  seed=1)
    return target, draft


def test_prompts_are_the_non_thinking_chat_turn():
    tok = tokenizer_from_dir(TOKENIZER)
    assert tok.encode("Hello world") == [9707, 1879]
    ids = encode_prompts(tok, ["hi"])[0]
    assert ids == [151644, 872, 198, 6023, 151645, 198] + NON_THINKING_TAIL
    assert tok.eos_token_id == QWEN3_EOS and tok.bos_token is None


def test_the_pair_passes_the_pipelines_checks_with_the_real_vocabulary(qwen3_pair):
    target, draft = qwen3_pair
    found = check_pipeline_models(str(target), str(draft))
    assert (found.vocab_rows, found.tokenizer_entries) == (QWEN3_VOCAB_ROWS, 151_669)
    assert found.lean_forward and found.gguf_export
    assert not load_config(target).tie_word_embeddings and load_config(draft).tie_word_embeddings


@pytest.mark.parametrize("which", ["target", "draft"])
def test_the_151936_row_pack_matches_its_estimate_and_loads_as_the_float_model(qwen3_pair, which, tmp_path):
    src = qwen3_pair[0] if which == "target" else qwen3_pair[1]
    packed = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "packed"))).out
    header = qd4.read_qd4_header(packed / "draft.qd4")
    assert header.entry("model.embed_tokens.weight").shape == (QWEN3_VOCAB_ROWS, SMALL.hidden)
    names = {e.name for e in header.entries}
    assert ("lm_head.weight" in names) == (which == "target")  # a tied head is stored once
    size = (packed / "draft.qd4").stat().st_size
    assert size == qd4.estimate_packed_bytes(load_config(packed), header.group_size)
    model, _ = load_draft(packed, "float32")
    ids = torch.tensor([[151644, 872, 198, 6023, 151645, QWEN3_VOCAB_ROWS - 1]])
    assert model(input_ids=ids).logits.shape == (1, 6, QWEN3_VOCAB_ROWS)


def test_the_qwen3_gguf_export_is_read_by_llama_cpp_with_the_targets_vocabulary(qwen3_pair, tmp_path):
    pytest.importorskip("llama_cpp", reason="needs llama-cpp-python (`make install-llama`)")
    from specdraft.model import llamacpp
    target, draft = qwen3_pair
    files = {}
    for name, src in (("target", target), ("draft", draft)):
        packed = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / name))).out
        files[name] = run_export(ExportConfig(model_dir=str(packed), format="gguf",
                                              out=str(tmp_path / f"{name}.gguf"))).out
    compat = llamacpp.vocab_compatible(files["target"], files["draft"])
    assert compat["compatible"] and compat["n_tokens"] == [QWEN3_VOCAB_ROWS] * 2
    assert compat["eos"] == [QWEN3_EOS] * 2
    texts = llamacpp.vocab_texts(files["draft"])
    assert texts[151667:151669] == [b"<think>", b"</think>"]
    if LLAMA_VOCAB.is_file():  # llama.cpp's own conversion of Qwen's vocabulary names ids past 151,645 placeholders
        reference = llamacpp.vocab_texts(LLAMA_VOCAB)
        assert texts[:QWEN3_EOS + 1] == reference[:QWEN3_EOS + 1]
    model = llamacpp.LlamaCppModel(files["draft"], n_ctx=64, threads=1)
    try:
        logits = model.decode([151644, 872, 198, 6023], 0)
        assert logits.shape[-1] == QWEN3_VOCAB_ROWS
    finally:
        model.close()
