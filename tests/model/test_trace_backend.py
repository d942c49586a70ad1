import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.core.io import read_jsonl
from specdraft.model.generation import Generation
from specdraft.model.simple_decode import naive_greedy
from specdraft.model.trace_backend import HFBackend, TraceBackend, append_generations


class _Echo(TraceBackend):
    """The smallest backend: every prompt's continuation is its own first token, once."""

    name = "echo"

    def __init__(self):
        self.closed = 0

    def generate(self, prompts, max_new_tokens, top_logprobs=0):
        for i, p in enumerate(prompts):
            yield i, Generation([p[0]], "length")

    def close(self):
        self.closed += 1


def test_a_backend_declares_generate_and_defaults_the_rest():
    with pytest.raises(TypeError):
        TraceBackend()  # abstract: generate is what every backend must answer

    class NoGenerate(TraceBackend):
        name = "none"

    with pytest.raises(TypeError):
        NoGenerate()
    backend = _Echo()
    assert backend.info() == {"backend": "echo"} and not backend.supports_top_logprobs
    assert list(backend.generate([[5, 6], [7]], 3)) == [(0, Generation([5], "length")), (1, Generation([7], "length"))]
    with backend as entered:
        assert entered is backend
    assert backend.closed == 1


def test_append_generations_writes_a_row_per_prompt_and_counts_them(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text('{"id": "earlier"}\n')
    record = append_generations(_Echo(), out, [[5, 6], [7]], 3, lambda i, gen: {"id": str(i), "ids": gen.tokens},
                                "echo")
    assert [row for _, row in read_jsonl(out)] == [{"id": "earlier"}, {"id": "0", "ids": [5]}, {"id": "1", "ids": [7]}]
    assert record["prompts"] == 2 and record["prompt_tokens"] == 3 and record["completion_tokens"] == 2
    assert record["backend"] == "echo"


def test_append_generations_refuses_a_backend_that_drops_a_prompt(tmp_path):
    class Drops(_Echo):
        def generate(self, prompts, max_new_tokens, top_logprobs=0):
            yield 0, Generation([prompts[0][0]], "length")

    with pytest.raises(RuntimeError, match="backend returned 1 of 2 prompts"):
        append_generations(Drops(), tmp_path / "rows.jsonl", [[5], [7]], 3, lambda i, gen: {"id": str(i)}, "drops")


def test_hf_backend_yields_every_prompt_once_as_alone_with_its_top_k(tiny_qwen3_dir):
    backend = HFBackend(str(tiny_qwen3_dir), "cpu", batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (3, 9, 5, 12, 4)]
    got = dict(backend.generate(prompts, 6, top_logprobs=3))
    assert sorted(got) == list(range(len(prompts)))
    assert backend.supports_top_logprobs
    for i, p in enumerate(prompts):
        alone = naive_greedy(model, p, 6)
        assert (got[i].tokens, got[i].finish_reason) == (alone.tokens, alone.finish_reason)
        assert [ids[0] for ids in got[i].top_ids] == got[i].tokens  # the greedy token first
        assert all(len(ids) == 3 == len(lps) for ids, lps in zip(got[i].top_ids, got[i].top_logprobs))
    info = backend.info()
    assert (info["backend"], info["device"], info["dtype"], info["batch_size"]) == ("hf", "cpu", "torch.float32", 2)
    assert backend.eos_ids() and isinstance(backend.eos_ids(), set)
