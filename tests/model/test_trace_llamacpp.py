"""llama.cpp as a trace backend: the embedded target's GGUF file decoded many prompts at once through
llama-cpp-python's batch API, against itself one prompt at a time, against the torch target, and through
`specdraft traces --backend llama.cpp` killed and resumed."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from processes import kill_once_written
from specdraft.cli import main
from specdraft.core.io import RecordFileError
from specdraft.model import trace_llamacpp
from specdraft.model.chat import encode_prompts
from specdraft.model.generation import top_logprobs_of
from specdraft.model.llamacpp import LlamaCppModel
from specdraft.model.specs import DEFAULT_TARGET, ModelSpecError, load_tokenizer
from specdraft.model.trace_backend import HFBackend
from specdraft.model.trace_llamacpp import LlamaCppBackend, target_gguf
from specdraft.stages.traces import TracesConfig, run_traces

llama_cpp = pytest.importorskip("llama_cpp",
                                reason="llama-cpp-python is not installed (pip install 'specdraft[llama]')")

QUESTIONS = ["Hi", "What is 2+2?", "Write a poem about the sea.", "Explain speculative decoding in detail, with "
             "examples, and say when it pays and when it does not.", "List three colours.",
             "Translate good morning into French.", "for i in range(10):"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def gguf():
    return target_gguf(DEFAULT_TARGET)


@pytest.fixture(scope="module")
def prompts(gguf):
    """The questions as one chat turn each, tokenized by llama.cpp itself (no torch model needed)."""
    vocab = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    try:
        return [vocab.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode(),
                               add_bos=False, special=True) for q in QUESTIONS]
    finally:
        vocab.close()


@pytest.fixture(scope="module")
def alone(gguf, prompts):
    """Every prompt decoded one at a time (one sequence), with its top-4."""
    with LlamaCppBackend(gguf, sequences=1, threads=1) as backend:
        return dict(backend.generate(prompts, MAX_NEW, top_logprobs=4)), backend.eos_ids()


def plain_greedy(model: LlamaCppModel, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], list]:
    """llama.cpp's plain decoding of one prompt (``LlamaCppModel``, speculate's baseline): tokens, logits."""
    logits, tokens, rows = model.decode(prompt, 0)[-1], [], []
    while True:
        tokens.append(int(logits.argmax()))
        rows.append(logits)
        if tokens[-1] in eos or len(tokens) == max_new:
            return tokens, rows
        logits = model.decode(tokens[-1:], len(prompt) + len(tokens) - 1)[-1]


def test_batched_is_one_prompt_at_a_time_bit_for_bit(gguf, prompts, alone):
    # 3 sequences for 7 prompts (each finished one refilled), 8 tokens per call (prompts prefilled in pieces),
    # against llama.cpp's plain decoding of each prompt alone with passes of 8 tokens
    with LlamaCppBackend(gguf, sequences=3, threads=1, batch_tokens=8) as backend:
        got = list(backend.generate(prompts, MAX_NEW, top_logprobs=4))
        info = backend.info()
    assert sorted(i for i, _ in got) == list(range(len(prompts)))  # each once
    assert len({len(p) for p in prompts}) > 3 and max(map(len, prompts)) > 2 * 8
    model = LlamaCppModel(gguf, n_ctx=256, threads=1, n_batch=8)
    try:
        expected = {i: plain_greedy(model, p, MAX_NEW, alone[1]) for i, p in enumerate(prompts)}
    finally:
        model.close()
    for i, gen in got:
        tokens, logits = expected[i]
        assert gen.tokens == tokens, i
        assert gen.finish_reason == ("eos" if tokens[-1] in alone[1] else "length")
        assert (gen.top_ids, gen.top_logprobs) == top_logprobs_of(torch.from_numpy(np.stack(logits)), 4)
    assert info["sequences"] == 3 and info["threads"] == 1 and info["engine"] == "llama.cpp"
    assert info["batch_tokens"] == 8
    assert info["n_ctx_per_sequence"] >= max(map(len, prompts)) + MAX_NEW and info["n_ctx"] >= 3 * MAX_NEW
    assert info["llama_cpp_python"] == llama_cpp.__version__ and "GGUF" in info["computes"]


def test_finish_at_eos_or_length(alone):
    generations, eos = alone
    assert eos == {2, 0}  # SmolLM2's <|im_end|> (eos) and <|endoftext|> (eot)
    reasons = Counter(g.finish_reason for g in generations.values())
    assert reasons["eos"] and reasons["length"], reasons  # "Hi" ends early, the explanation does not
    for g in generations.values():
        assert not set(g.tokens[:-1]) & eos  # nothing after an EOS
        if g.finish_reason == "eos":
            assert g.tokens[-1] in eos and len(g.tokens) <= MAX_NEW
        else:
            assert g.tokens[-1] not in eos and len(g.tokens) == MAX_NEW


def test_top_logprobs_are_the_greedy_token_first_and_sorted(gguf, prompts, alone):
    for g in alone[0].values():
        assert len(g.top_ids) == len(g.top_logprobs) == len(g.tokens)
        for token, ids, values in zip(g.tokens, g.top_ids, g.top_logprobs):
            assert ids[0] == token and len(set(ids)) == 4
            assert values == sorted(values, reverse=True) and values[0] <= 0.0
            assert np.exp(values).sum() <= 1.0 + 1e-5  # a share of one softmax
    with LlamaCppBackend(gguf, sequences=4, threads=1) as backend:  # without them, the same tokens
        plain = dict(backend.generate(prompts[:3], MAX_NEW))
    assert all(g.top_ids is None and g.tokens == alone[0][i].tokens for i, g in plain.items())


def test_bad_prompts_and_a_dead_engine_are_refused(gguf, monkeypatch):
    with LlamaCppBackend(gguf, sequences=2, threads=1) as backend:
        with pytest.raises(ValueError, match="every prompt needs tokens"):
            list(backend.generate([[1, 2], []], 4))
        with pytest.raises(ValueError, match="found 999999"):
            list(backend.generate([[1, 999999]], 4))
        with pytest.raises(ValueError, match="max_new_tokens"):
            list(backend.generate([[1, 2]], 0))
    monkeypatch.setattr(trace_llamacpp, "engine_problem", lambda: "llama.cpp does not run on this CPU: SIGILL")
    with pytest.raises(RuntimeError, match="SIGILL"):
        LlamaCppBackend(gguf)


def test_a_target_without_a_gguf_file_is_a_clear_error(tiny_qwen3_dir, tmp_path):
    with pytest.raises(ModelSpecError, match="has no GGUF file for --backend llama.cpp"):
        target_gguf(tiny_qwen3_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "source": "s", "prompt": "Hello"}\n')
    with pytest.raises(ModelSpecError, match="has no GGUF file"):
        run_traces(TracesConfig(target=str(tiny_qwen3_dir), prompts=prompts, out=tmp_path / "t.jsonl",
                                backend="llama.cpp", max_new_tokens=2))
    assert TracesConfig(prompts=prompts, out=tmp_path / "t.jsonl", backend="llama.cpp", top_logprobs=3)
    with pytest.raises(ValueError, match="top_logprobs"):
        TracesConfig(prompts=prompts, out=tmp_path / "t.jsonl", backend="vllm", top_logprobs=3)


@pytest.mark.slow
def test_llama_cpp_agrees_loosely_with_the_torch_target():
    """The same GGUF weights, two computations: llama.cpp (8-bit activations, its kernels) and transformers' float32
    dequantisation. Near-ties part them, so only the opening tokens of most prompts are asked to agree."""
    ids = encode_prompts(load_tokenizer(DEFAULT_TARGET), QUESTIONS)
    with LlamaCppBackend(target_gguf(DEFAULT_TARGET), sequences=4, threads=1) as backend:
        ours = dict(backend.generate(ids, MAX_NEW))
    with HFBackend(DEFAULT_TARGET, "cpu", 8) as backend:
        torch_target = dict(backend.generate(ids, MAX_NEW))
    first_difference = [next((k for k, (a, b) in enumerate(zip(ours[i].tokens, torch_target[i].tokens)) if a != b),
                             min(len(ours[i].tokens), len(torch_target[i].tokens))) for i in range(len(ids))]
    assert sum(d >= 4 for d in first_difference) >= len(ids) // 2 + 1, first_difference


SLOW_LLAMA = ("import sys, time\n"
              "from specdraft.model.trace_llamacpp import LlamaCppBackend as B\n"
              "fill = B._fill_batch\n"
              "B._fill_batch = lambda self, rows: (time.sleep(0.05), fill(self, rows))[1]\n"
              "from specdraft.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow
def test_traces_with_llama_cpp_killed_and_resumed(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "source": "s", "prompt": QUESTIONS[i % len(QUESTIONS)]
                                           + " Please." * (i // len(QUESTIONS))}) + "\n" for i in range(12)))
    out = tmp_path / "traces.jsonl"
    args = ["traces", "--backend", "llama.cpp", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
            "8", "--batch-size", "2", "--threads", "1", "--top-logprobs", "2"]
    before = kill_once_written(SLOW_LLAMA, args, out, lines=3, timeout_s=180)
    assert 3 <= before < 12
    assert main(args) == 0  # the resume: the same command again
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(12))  # none lost, none twice
    summary = json.loads((tmp_path / "traces.summary.json").read_text())
    assert [run["prompts"] for run in summary["runs"]] == [12 - before]
    assert summary["this_run"]["backend"] == "llama.cpp" and summary["this_run"]["threads"] == 1
    assert summary["resume_key"]["engine"] == "llama.cpp" and summary["rows"] == 12

    with LlamaCppBackend(target_gguf(DEFAULT_TARGET), sequences=5, threads=1) as backend:  # one run, uncut
        whole = dict(backend.generate([r["prompt_ids"] for r in rows], 8, top_logprobs=2))
    for k, r in enumerate(rows):
        assert r["completion_ids"] == whole[k].tokens and r["finish_reason"] == whole[k].finish_reason
        assert r["top_ids"] == whole[k].top_ids
    with pytest.raises(RecordFileError, match="engine"):  # the torch target's rows do not join them
        run_traces(TracesConfig(prompts=prompts, out=out, max_new_tokens=8, backend="hf"))
