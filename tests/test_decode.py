import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.decode import draft_batch, greedy_decode, left_pad, naive_greedy


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_left_pad_right_aligns():
    ids, mask = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError):
        left_pad([[1], []], pad_id=0)


def test_cached_equals_naive(tiny_model_dir):
    model = _load(tiny_model_dir)
    for prompt in _prompts(model.config.vocab_size, [1, 5, 17]):
        fast = greedy_decode(model, [prompt], 12, stop_at_eos=False)[0]
        ref = naive_greedy(model, prompt, 12, stop_at_eos=False)
        assert fast.tokens == ref.tokens


def test_left_padded_batch_equals_single_rows(tiny_model_dir):
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [3, 20, 1, 9, 14], seed=1)
    batched = draft_batch(model, prompts, 10)
    single = [draft_batch(model, [p], 10)[0] for p in prompts]
    assert batched == single
    assert all(len(row) == 10 for row in batched)


def test_eos_stops_rows_independently(tiny_model_dir):
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [4, 11, 7], seed=2)
    free = [naive_greedy(model, p, 10, stop_at_eos=False).tokens for p in prompts]
    # Pretend the 3rd greedy token of row 0 is the EOS: row 0 stops there, the others run on unchanged.
    eos_tok = free[0][2]
    eos = {eos_tok}
    got = greedy_decode(model, prompts, 10, eos_ids=eos)
    for row, gen in enumerate(got):
        ref = naive_greedy(model, prompts[row], 10, eos_ids=eos)
        assert gen.tokens == ref.tokens and gen.finish_reason == ref.finish_reason
    assert got[0].finish_reason == "eos"
    assert got[0].tokens == free[0][: free[0].index(eos_tok) + 1]


@pytest.mark.slow
def test_smollm2_batched_equals_single_and_naive():
    from specdraft.models import DEFAULT_TARGET, load_model, load_tokenizer

    model, tok = load_model(DEFAULT_TARGET), load_tokenizer(DEFAULT_TARGET)
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "def fibonacci(n):"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False) for t in texts]
    prompts = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    batched = greedy_decode(model, prompts, 12)
    for prompt, gen in zip(prompts, batched):
        assert gen.tokens == naive_greedy(model, prompt, 12).tokens
