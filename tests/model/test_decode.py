import random
from collections import deque

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.model.decode import draft_batch, draft_rows, greedy_decode, iter_greedy, prefill_group
from specdraft.model.forward import left_pad
from specdraft.model.generation import DraftSampling, top_alternatives
from specdraft.model.sampling import SamplingParams, warp_probs
from specdraft.model.simple_decode import naive_draft, naive_greedy
from specdraft.model.slot_engine import SlotDecoder, supports_slot_cache


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


@pytest.mark.parametrize("kv_cache", ["static", "dynamic"])
def test_cached_equals_naive(tiny_model_dir, kv_cache):
    model = _load(tiny_model_dir)
    for prompt in _prompts(model.config.vocab_size, [1, 5, 17]):
        fast = greedy_decode(model, [prompt], 12, stop_at_eos=False, kv_cache=kv_cache)[0]
        ref = naive_greedy(model, prompt, 12, stop_at_eos=False)
        assert fast.tokens == ref.tokens


def test_left_padded_batch_equals_single_rows(tiny_model_dir, monkeypatch):
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [3, 20, 1, 9, 14], seed=1)
    single = [draft_batch(model, [p], 10)[0] for p in prompts]
    assert draft_batch(model, prompts, 10) == single
    assert all(len(row) == 10 for row in single)
    # The default padding cap prefills such different lengths one by one; lift it so that all five rows
    # share one left-padded prefill (checked), then decode side by side.
    groups = []
    admit = SlotDecoder.admit
    monkeypatch.setattr(SlotDecoder, "admit", lambda self, idx, ps: (groups.append(len(idx)), admit(self, idx, ps))[1])
    padded = dict(iter_greedy(model, prompts, 10, stop_at_eos=False, max_padding=1.0, kv_cache="static"))
    assert groups == [5]
    assert [padded[i].tokens for i in range(5)] == single
    dynamic = greedy_decode(model, prompts, 10, stop_at_eos=False, kv_cache="dynamic")  # always one padded batch
    assert [g.tokens for g in dynamic] == single


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


def test_continuous_batching_equals_single_rows(tiny_model_dir):
    """A batch smaller than the prompt list: finished rows leave, waiting prompts take their slots (rows of
    different ages and prompt lengths side by side), and every row still gets its own tokens."""
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [3, 20, 1, 9, 14, 6, 30, 2], seed=3)
    free = [naive_greedy(model, p, 9, stop_at_eos=False).tokens for p in prompts]
    eos = {free[1][3], free[4][0], free[6][5]}  # rows stop early at different steps; one at its first token
    ref = [naive_greedy(model, p, 9, eos_ids=eos) for p in prompts]
    for batch_size, prefill_tokens, max_padding in [(3, 8192, 0.1), (2, 8192, 1.0), (8, 40, 0.5), (8, 8192, 1.0)]:
        got = dict(iter_greedy(model, prompts, 9, batch_size=batch_size, eos_ids=eos, prefill_tokens=prefill_tokens,
                               max_padding=max_padding, order=sorted(range(8), key=lambda i: -len(prompts[i]))))
        assert sorted(got) == list(range(8))
        assert [got[i] for i in range(8)] == ref
    assert any(g.finish_reason == "eos" for g in ref) and any(g.finish_reason == "length" for g in ref)
    assert dict(iter_greedy(model, prompts, 9, batch_size=3, eos_ids=eos, kv_cache="dynamic")) == dict(enumerate(ref))


def test_prefill_groups_bound_padding_and_tokens():
    lengths = [100, 95, 60, 58, 57, 10, 10, 10]
    waiting = deque(range(8))
    groups = []
    while waiting:
        groups.append(prefill_group(waiting, lengths, free=3, max_tokens=200, max_padding=0.1))
    assert groups == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert prefill_group(deque([0, 1]), [500, 1], free=4, max_tokens=100, max_padding=1.0) == [0]  # alone if too big


def test_slot_engine_with_eager_attention(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompts = _prompts(model.config.vocab_size, [4, 13, 1], seed=4)
    got = greedy_decode(model, prompts, 8, stop_at_eos=False, batch_size=2, kv_cache="static")
    assert [g.tokens for g in got] == [naive_greedy(model, p, 8, stop_at_eos=False).tokens for p in prompts]


def test_slot_engine_support_and_arguments(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    assert supports_slot_cache(model)
    model.config.sliding_window = 16  # a windowed model needs the dynamic engine's own masks
    assert not supports_slot_cache(model)
    model.config.sliding_window = None
    with pytest.raises(ValueError, match="permutation"):
        list(iter_greedy(model, [[5], [6]], 2, order=[0, 0]))
    with pytest.raises(ValueError, match="at least one token"):
        greedy_decode(model, [[5], []], 2)
    decoder = SlotDecoder(model, slots=1, capacity=8, max_new_tokens=4, eos=set())
    with pytest.raises(ValueError, match="capacity"):
        decoder.admit([0], [[5] * 6])
    decoder.admit([0], [[5] * 3])
    with pytest.raises(ValueError, match="free slots"):
        decoder.admit([1], [[5]])


@pytest.mark.gpu
def test_tiny_qwen3_on_cuda_cached_and_batched_equal_naive(tiny_qwen3_dir):
    model = _load(tiny_qwen3_dir).to("cuda")
    prompts = _prompts(model.config.vocab_size, [3, 20, 1, 9], seed=5)
    naive = [naive_greedy(model, p, 10, stop_at_eos=False).tokens for p in prompts]
    for kv_cache in ("static", "dynamic"):
        single = [greedy_decode(model, [p], 10, stop_at_eos=False, kv_cache=kv_cache)[0].tokens for p in prompts]
        assert single == naive
        batched = dict(iter_greedy(model, prompts, 10, stop_at_eos=False, kv_cache=kv_cache, max_padding=1.0))
        assert [batched[i].tokens for i in range(len(prompts))] == naive


@pytest.mark.slow
def test_smollm2_batched_equals_single_and_naive():
    from specdraft.model.specs import DEFAULT_TARGET, load_model, load_tokenizer

    model, tok = load_model(DEFAULT_TARGET), load_tokenizer(DEFAULT_TARGET)
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "def fibonacci(n):",
             "Summarise this in one sentence: " + " ".join(["The committee met on Tuesday to review the budget, "
                                                            "the hiring plan and the schedule for the new office."]
                                                           * 6)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       tokenize=False) for t in texts]
    prompts = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    assert len(prompts[3]) > 3 * max(map(len, prompts[:3]))  # one clearly longer prompt
    naive = [naive_greedy(model, p, 12) for p in prompts]
    for kv_cache in ("static", "dynamic"):
        assert greedy_decode(model, prompts, 12, kv_cache=kv_cache) == naive  # one batch
        assert greedy_decode(model, prompts, 12, batch_size=2, kv_cache=kv_cache) == naive  # slot refill / groups
        assert [greedy_decode(model, [p], 12, kv_cache=kv_cache)[0] for p in prompts] == naive  # alone
    padded = dict(iter_greedy(model, prompts, 12, max_padding=1.0))  # all four in one left-padded prefill
    assert [padded[i] for i in range(len(prompts))] == naive


def test_kv_cache_is_freed_when_the_step_ends_not_at_the_next_gc(tiny_qwen3_dir):
    """The server's RSS grew by GBs over minutes: each step's SlotCache sat in a reference cycle with its
    layers, so its KV tensors waited for Python's cyclic GC. Plain reference counting must free them."""
    import gc

    from specdraft.model.slot_engine import SlotCache
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is SlotCache}  # other tests' servers may hold theirs
    gc.disable()
    try:
        draft_batch(model, [[5, 9, 33, 70], [12, 8, 40]], 6)
        alive = [o for o in gc.get_objects() if type(o) is SlotCache and id(o) not in before]
    finally:
        gc.enable()
    assert alive == []


def _drain(decoder, finished):
    """Step the decoder until every live row has finished; {index: tokens}."""
    out = {i: g.tokens for i, g in finished}
    while decoder.n:
        out.update({i: g.tokens for i, g in decoder.step()})
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_whole(tiny_model_dir, chunk):
    """Chunked prefill (a long prompt in pieces between decode steps) gives the same greedy tokens as one prefill,
    whatever the piece size, and other rows' steps in between do not change either."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rng = random.Random(chunk)
    prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(45)]
    other = [rng.randrange(3, model.config.vocab_size) for _ in range(7)]
    whole = SlotDecoder(model, slots=2, capacity=64, max_new_tokens=8, eos=set(), row_attention=True)
    want = _drain(whole, whole.admit([0], [prompt]))
    pieces = SlotDecoder(model, slots=2, capacity=64, max_new_tokens=8, eos=set(), row_attention=True)
    finished = pieces.admit([1], [other])  # a live row that steps while the long prompt is prefilled
    got: dict = {}
    for start in range(0, len(prompt), chunk):
        assert pieces.free == 2 - pieces.n - (start > 0)  # the prompt waits in the top slot, not a live row
        finished += pieces.prefill_chunk(0, prompt, start, chunk)
        if pieces.n:
            got.update({i: g.tokens for i, g in pieces.step()})
    got.update(_drain(pieces, finished))
    assert got[0] == want[0]
    assert got[1] == _drain(*(lambda d: (d, d.admit([1], [other])))(
        SlotDecoder(model, slots=1, capacity=64, max_new_tokens=8, eos=set(), row_attention=True)))[1]


def test_released_rows_stop_and_free_their_slot(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    decoder = SlotDecoder(model, slots=3, capacity=32, max_new_tokens=6, eos=set(), row_attention=True)
    decoder.admit([0, 1], [[5, 6, 7], [8, 9, 10]])
    decoder.prefill_chunk(2, list(range(3, 20)), 0, 4)
    assert decoder.free == 0
    decoder.release([0, 2])  # a live row and the one being prefilled in pieces
    assert decoder.free == 2 and decoder.index == [1] and decoder.chunked is None
    alone = SlotDecoder(model, slots=1, capacity=32, max_new_tokens=6, eos=set(), row_attention=True)
    assert _drain(decoder, [])[1][-4:] == _drain(alone, alone.admit([1], [[8, 9, 10]]))[1][-4:]
    with pytest.raises(ValueError, match="not the one being prefilled"):
        decoder.prefill_chunk(2, list(range(3, 20)), 4, 4)


def test_top_logprobs_are_the_full_forwards_top_k_at_every_generated_position(tiny_model_dir):
    """What traces store for distillation: per generated position the k most likely ids (the generated token
    first) and their log-softmax values, as a full forward of the prefix gives them, batched or alone."""
    model = _load(tiny_model_dir)
    prompts = _prompts(model.config.vocab_size, [4, 11, 2], seed=5)
    k = 5
    batched = dict(iter_greedy(model, prompts, 6, stop_at_eos=False, top_logprobs=k, kv_cache="static"))
    for i, prompt in enumerate(prompts):
        gen = batched[i]
        alone = dict(iter_greedy(model, [prompt], 6, stop_at_eos=False, top_logprobs=k, kv_cache="static"))[0]
        assert gen.top_ids == alone.top_ids
        assert len(gen.top_ids) == len(gen.tokens) == len(gen.top_logprobs) == 6
        for j, token in enumerate(gen.tokens):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + gen.tokens[:j]])).logits[0, -1]
            values, ids = torch.log_softmax(logits.float(), -1).topk(k)
            assert gen.top_ids[j][0] == token
            assert gen.top_ids[j] == ids.tolist()
            assert gen.top_logprobs[j] == pytest.approx(values.tolist(), abs=1e-4)
    plain = dict(iter_greedy(model, prompts, 6, stop_at_eos=False, kv_cache="static"))
    assert all(plain[i].top_ids is None and plain[i].tokens == batched[i].tokens for i in range(3))
    with pytest.raises(ValueError, match="slot engine"):
        list(iter_greedy(model, prompts, 6, top_logprobs=k, kv_cache="dynamic"))


# ------------------------------------------------------------------------------------- sampled drafts

SETTINGS = [
    DraftSampling(SamplingParams(temperature=0.7), seed=1, return_probs=True, top_alternatives=4),
    DraftSampling(return_probs=True),  # greedy with its probabilities: 1.0 each
    DraftSampling(),  # plain greedy, in the same batch
    DraftSampling(SamplingParams(temperature=1.0, top_k=20, top_p=0.8), seed=5, return_probs=True),
    DraftSampling(SamplingParams(temperature=1.3, top_p=0.5), seed=7, return_probs=True, top_alternatives=6),
    DraftSampling(return_probs=True, top_alternatives=3),
]


def _expected_alternatives(probs, logits, k):
    """The k most likely tokens by a full sort: probability descending, equal probabilities by logit."""
    order = sorted(range(len(probs)), key=lambda t: (-float(probs[t]), -float(logits[t])))[:k]
    return order, [float(probs[t]) for t in order]


def test_sampled_rows_equal_a_naive_sampler_with_the_full_forwards_probabilities(tiny_model_dir):
    """Each row of a mixed batch (seeded sampled rows beside greedy ones): the tokens the no-cache reference
    draws with the same seed, and draft_probs / top alternatives equal to warp_probs of a full forward of the
    prefix at each drafted position."""
    model = _load(tiny_model_dir)
    contexts = _prompts(model.config.vocab_size, [3, 9, 9, 20, 1, 6], seed=11)
    rows = draft_rows(model, contexts, 8, SETTINGS)
    for context, settings, row in zip(contexts, SETTINGS, rows):
        ref = naive_draft(model, context, 8, settings)
        assert row.tokens == ref.tokens
        if not settings.return_probs:
            assert row.probs is None and row.alternative_ids is None
            continue
        with torch.no_grad():  # every drafted position's logits, from one full forward of context + draft
            logits = model(input_ids=torch.tensor([context + row.tokens[:-1]])).logits[0, len(context) - 1:]
        warped = warp_probs(logits, settings.params)  # [8, V]
        want = [float(warped[j, t]) for j, t in enumerate(row.tokens)]
        assert row.probs == pytest.approx(want, abs=1e-5)
        assert row.probs == pytest.approx(ref.probs, abs=1e-5)
        if settings.params.greedy:
            assert row.probs == [1.0] * 8
        k = settings.top_alternatives
        if not k:
            assert row.alternative_ids is None
            continue
        for j in range(8):
            ids, values = _expected_alternatives(warped[j], logits[j], k)
            assert row.alternative_ids[j] == ids
            assert row.alternative_probs[j] == pytest.approx(values, abs=1e-5)
            assert row.alternative_probs[j] == sorted(row.alternative_probs[j], reverse=True)
    # greedy rows, with or without probabilities, draft what draft_batch drafts
    greedy = [i for i, s in enumerate(SETTINGS) if s.params.greedy]
    assert [rows[i].tokens for i in greedy] == draft_batch(model, [contexts[i] for i in greedy], 8)


@pytest.fixture(scope="module")
def int4_draft(tmp_path_factory):
    """The packed tiny draft on the int4 kernel, as the server runs it (rows computed independently)."""
    from specdraft.model.loader import load_draft
    from specdraft.model.tiny import build_tiny_model
    from specdraft.stages.pack import PackConfig, run_pack

    src = build_tiny_model(tmp_path_factory.mktemp("tiny-sampled") / "model", "qwen3")
    out = tmp_path_factory.mktemp("packed-sampled") / "model"
    run_pack(PackConfig(checkpoint=str(src), out=str(out)))
    return load_draft(out, "int4")[0]


def test_seeded_sampled_rows_batched_equal_alone_bit_for_bit(int4_draft):
    """A seeded row gets the same tokens, probabilities and alternatives whatever shares its batch: its own
    generator, and logits its own on the int4 path."""
    model = int4_draft
    contexts = _prompts(model.config.vocab_size, [3, 9, 9, 20, 1, 6], seed=12)
    batched = draft_rows(model, contexts, 10, SETTINGS)
    alone = [draft_rows(model, [c], 10, [s])[0] for c, s in zip(contexts, SETTINGS)]
    assert batched == alone
    # a different neighbour, and the rows in another order
    order = [5, 3, 1, 4, 0, 2]
    shuffled = draft_rows(model, [contexts[i] for i in order], 10, [SETTINGS[i] for i in order])
    assert [shuffled[order.index(i)] for i in range(6)] == alone


def test_a_seed_reproduces_its_draft_and_no_seed_draws_afresh(tiny_qwen3_dir):
    model = _load(tiny_qwen3_dir)
    (context,) = _prompts(model.config.vocab_size, [5], seed=13)
    hot = SamplingParams(temperature=1.5)

    def tokens(settings):
        return draft_rows(model, [context], 16, [settings])[0].tokens

    assert tokens(DraftSampling(hot, seed=3)) == tokens(DraftSampling(hot, seed=3))
    assert tokens(DraftSampling(hot, seed=3)) != tokens(DraftSampling(hot, seed=4))
    assert tokens(DraftSampling(hot)) != tokens(DraftSampling(hot))  # 16 draws over 320 tokens: never all equal
    with pytest.raises(ValueError, match="return_probs"):
        DraftSampling(top_alternatives=2)


def test_top_alternatives_order_equal_probabilities_by_logit():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    logits = torch.tensor([3.0, 9.0, 4.0, 1.0, 2.0, -1.0])
    assert top_alternatives(probs, logits, 4) == ([1, 4, 3, 2], [0.5, 0.25, 0.25, 0.0])
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0])  # greedy: the tokens the draft ranks next, at probability 0
    assert top_alternatives(one_hot, torch.tensor([2.0, 0.5, 3.0, 2.5]), 3) == ([2, 3, 0], [1.0, 0.0, 0.0])
