"""The prefix cache: full blocks keyed by their prefix's hash chain, a hit only on the same tokens at the same
positions, least recently used out under a byte budget (leaves first, never a stranded block); and the slot
engine in block mode, whose prefill gives the same bits with or without a hit, in every compute format."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.model.generation import DraftSampling
from specdraft.model.prefix_cache import PrefixCache
from specdraft.model.sampling import SamplingParams
from specdraft.model.slot_engine import SlotDecoder
from specdraft.server.engine import load_engine

BLOCK = 8


def _kv(fill: float, block: int = BLOCK) -> torch.Tensor:
    return torch.full((2, 2, 1, block, 4), float(fill))  # [layers, k/v, kv heads, block, head dim]: 512 bytes


def _put_all(cache: PrefixCache, tokens) -> list[bool]:
    keys = cache.chain(tokens)
    return [cache.put(tokens, keys, i, _kv(i)) for i in range(len(keys))]


# ---------------------------------------------------------------------------------------------- the cache

def test_a_context_reuses_its_cached_full_blocks_short_of_its_last_token():
    cache = PrefixCache(BLOCK, 1 << 20)
    tokens = list(range(100, 130))  # 3 full blocks and 6 tokens
    assert cache.reusable(tokens) == 0
    assert _put_all(cache, tokens) == [True] * 3
    assert cache.reusable(tokens) == 24
    assert cache.reusable(tokens[:24]) == 16  # the last token is always computed: the prefill needs its logits
    assert cache.reusable(tokens[:25]) == 24
    assert cache.reusable(tokens + [1, 2, 3]) == 24
    assert cache.reusable(tokens[:12] + [7] + tokens[13:]) == 8  # a changed token ends the match at its block
    assert cache.reusable([5] + tokens[1:]) == 0  # the same block later in a context is another block
    blocks = cache.take(tokens, cache.chain(tokens), limit_tokens=16)
    assert [float(b[0, 0, 0, 0, 0]) for b in blocks] == [0.0, 1.0]
    s = cache.stats()
    assert (s.lookups, s.hits, s.reused_tokens, s.blocks, s.used_bytes) == (1, 1, 16, 3, 3 * 512)


def test_a_hash_collision_is_a_miss_never_a_wrong_reuse():
    cache = PrefixCache(BLOCK, 1 << 20)
    tokens = list(range(40))
    _put_all(cache, tokens)
    other = list(range(1, 41))
    assert cache.reusable(other, keys=cache.chain(tokens)) == 0  # the keys of `tokens`, with other tokens
    assert cache.take(other, cache.chain(tokens)) == []


def test_eviction_is_least_recently_used_leaves_first_within_the_budget():
    cache = PrefixCache(BLOCK, 5 * 512)  # five blocks
    a, b = list(range(100, 124)), list(range(200, 224))  # three blocks each
    _put_all(cache, a)
    _put_all(cache, b)  # the sixth block evicts a's deepest block, not its root
    s = cache.stats()
    assert (s.blocks, s.used_bytes, s.evicted_blocks) == (5, 5 * 512, 1)
    assert cache.reusable(a + [0]) == 16 and cache.reusable(b + [0]) == 24
    cache.take(a + [0], cache.chain(a + [0]))  # a is used again: b's chain is now the older
    keys = cache.chain(a)
    assert cache.put(a, keys, 2, _kv(2))
    assert cache.reusable(a + [0]) == 24 and cache.reusable(b + [0]) == 16
    assert cache.stats().evicted_blocks == 2


def test_a_block_is_not_stored_without_its_parent_nor_beyond_the_budget():
    cache = PrefixCache(BLOCK, 1 << 20)
    tokens = list(range(24))
    keys = cache.chain(tokens)
    assert not cache.put(tokens, keys, 1, _kv(1))  # nothing could reach it
    assert not PrefixCache(BLOCK, 500).put(tokens, keys, 0, _kv(0))  # larger than the whole budget
    assert not PrefixCache(BLOCK, 0).put(tokens, keys, 0, _kv(0))
    assert cache.stats().blocks == 0


# ---------------------------------------------------------------------------------------- block-mode prefill

def _draft(model, cache: PrefixCache, context, n=6, sampling=None, slots=2):
    decoder = SlotDecoder(model, slots, 160, n, eos=set(), row_attention=True, prefix_cache=cache)
    finished = decoder.admit([0], [context], None if sampling is None else [sampling])
    while not finished:
        finished = decoder.step()
    return finished[0][1]


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int4"])
def served_model(request, packed_dir):
    return load_engine(packed_dir, None, request.param).model


SAMPLED = DraftSampling(SamplingParams(temperature=0.9, top_k=40), seed=5, return_probs=True, top_alternatives=3)


def test_a_hit_gives_the_bits_of_a_miss_in_every_compute_format(served_model):
    """Whatever prefix is cached -- none, part, or a longer context's -- a context's draft and its probabilities
    (a function of the logits) are the same bits; a block's KV is the same bits computed or copied."""
    rng = random.Random(3)
    context = [rng.randrange(3, 300) for _ in range(61)]
    miss = _draft(served_model, PrefixCache(BLOCK, 0), context, sampling=SAMPLED)
    for cached_first in (context[:9], context[:40], context[:61], context + [5, 6, 7]):
        cache = PrefixCache(BLOCK, 1 << 24)
        _draft(served_model, cache, cached_first)
        assert cache.reusable(context) > 0
        hit = _draft(served_model, cache, context, sampling=SAMPLED)
        assert (hit.tokens, hit.probs, hit.alternative_ids, hit.alternative_probs) == \
            (miss.tokens, miss.probs, miss.alternative_ids, miss.alternative_probs)
    cache = PrefixCache(BLOCK, 1 << 24)
    computed = SlotDecoder(served_model, 1, 160, 2, eos=set(), row_attention=True, prefix_cache=cache)
    computed.admit([0], [context])
    copied = SlotDecoder(served_model, 1, 160, 2, eos=set(), row_attention=True, prefix_cache=cache)
    copied.admit([0], [context])
    assert torch.equal(computed.cache.read_columns(0, 0, 56), copied.cache.read_columns(0, 0, 56))


def test_a_long_prompt_in_pieces_reuses_what_an_admitted_one_stored_with_the_same_bits(hf_model):
    """Both lanes share one cache: a prompt prefilled in pieces (starting after its cached prefix, whole blocks
    per piece, other rows stepping in between) gets what it gets admitted alone without a cache."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, 300) for _ in range(70)]
    want = _draft(hf_model, PrefixCache(BLOCK, 0), prompt, n=8)
    cache = PrefixCache(BLOCK, 1 << 24)
    _draft(hf_model, cache, prompt[:30], n=8)  # three blocks stored by a short row
    pieces = SlotDecoder(hf_model, 2, 160, 8, eos=set(), row_attention=True, prefix_cache=cache)
    finished = pieces.admit([1], [prompt[:5]])
    start = pieces.reusable(prompt)
    assert start == 24
    with pytest.raises(ValueError, match="block boundaries"):
        pieces.prefill_chunk(0, prompt, start, 5)
    while start < len(prompt):
        finished += pieces.prefill_chunk(0, prompt, start, 16)
        start += 16
        if pieces.n:
            finished += pieces.step()
    while len(finished) < 2:
        finished += pieces.step()
    assert dict(finished)[0].tokens == want.tokens
    assert cache.stats().reused_tokens == 24


def test_after_an_eviction_a_context_is_computed_again_with_the_same_bits(hf_model):
    rng = random.Random(5)
    contexts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(4)]
    want = [_draft(hf_model, PrefixCache(BLOCK, 0), c).tokens for c in contexts]
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers, k/v, kv heads, block, head dim, float32
    cache = PrefixCache(BLOCK, 6 * block_bytes)  # fewer blocks than the four contexts store
    for _ in range(2):
        assert [_draft(hf_model, cache, c).tokens for c in contexts] == want
    assert cache.stats().evicted_blocks > 0 and cache.stats().used_bytes <= 6 * block_bytes
