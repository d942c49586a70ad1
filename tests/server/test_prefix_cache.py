"""The server reuses what it computed: speculation loops through the real lanes, with a prefix cache shared by the
short lane and the long one, get every draft bit for bit as a request alone without a cache gets it -- batched or
alone, greedy or sampled, across the move from the short lane to the long one, after evictions, after a request
dropped mid-prefill, and over HTTP; the scheduler costs only the tokens to compute; /metrics and /health show it."""

import random
from concurrent.futures import CancelledError, ThreadPoolExecutor

import httpx
import pytest

from fakes import FakeLane, expected
from servers import ThreadServer, metric_samples
from specdraft.model.generation import DraftSampling
from specdraft.model.prefix_cache import PrefixCache
from specdraft.model.sampling import SamplingParams
from specdraft.server.app import create_app
from specdraft.server.config import ServeConfig
from specdraft.server.engine import load_engine, torch_lane
from specdraft.server.scheduler import CANCELLED, Overloaded, Scheduler

BLOCK = 8
LONG_CONTEXT = 24  # beyond it the long lane, prefilled in pieces


@pytest.fixture(scope="module")
def model(packed_dir):
    """The packed tiny draft as the server computes it in float32 (rows padded to whole GEMM tiles: a row gets
    the same bits alone or batched, the promise these tests rely on)."""
    return load_engine(packed_dir, None, "float32").model


def alone(model, context, num_tokens, sampling=DraftSampling()):
    """The draft a request gets alone, its context prefilled in blocks with nothing cached."""
    lane = torch_lane(model, 1, len(context) + num_tokens, num_tokens, prefix_cache=PrefixCache(BLOCK, 0))
    draft = lane.admit([0], [context], [sampling])[0]
    while len(draft.tokens) < num_tokens:
        draft = lane.step()[0]
    return draft


def cached_scheduler(model, cache: PrefixCache, num_draft: int) -> Scheduler:
    short = torch_lane(model, 4, LONG_CONTEXT + num_draft, num_draft, prefix_cache=cache)
    long = torch_lane(model, 1, 160 + num_draft, num_draft, prefix_cache=cache)
    return Scheduler(short, long, num_draft=num_draft, long_context_tokens=LONG_CONTEXT, prefill_tokens=32,
                     chunk_tokens=BLOCK).start()


def speculation_loops(submit, vocab: int, loops: int, steps: int, num_draft: int, seed: int):
    """``loops`` sequences in lock step, each step sending its whole context (prompt and everything accepted) and
    keeping a random-length prefix of the draft plus a target token: [(context, sampling, draft), ...]."""
    rng = random.Random(seed)
    contexts = [[rng.randrange(3, vocab) for _ in range(rng.choice([3, 9, 17]))] for _ in range(loops)]
    settings = [DraftSampling(SamplingParams(temperature=0.8), seed=i, return_probs=True) if i % 2 else DraftSampling()
                for i in range(loops)]
    seen = []
    for _ in range(steps):
        drafts = submit(contexts, settings)
        for i, draft in enumerate(drafts):
            seen.append((list(contexts[i]), settings[i], draft))
            contexts[i] = contexts[i] + draft.tokens[:rng.randint(0, num_draft)] + [rng.randrange(3, vocab)]
    return seen


def _through(scheduler: Scheduler, num_draft: int):
    def submit(contexts, settings):
        requests = [scheduler.submit(c, num_draft, 60, s) for c, s in zip(contexts, settings)]
        return [r.future.result(60) for r in requests]
    return submit


@pytest.mark.parametrize("budget_blocks", [10_000, 12])
def test_speculation_loops_get_the_drafts_they_get_alone_with_reuse(model, budget_blocks):
    """Four loops decoding together, their contexts growing from the short lane into the long one: every draft
    (tokens and probabilities) is the one its context gets alone; most context tokens are reused, not computed.
    With a budget of a few blocks, blocks are evicted all along and the drafts stay the same."""
    num_draft = 6
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # layers, k/v, kv heads, block, head dim, float32
    cache = PrefixCache(BLOCK, budget_blocks * block_bytes)
    s = cached_scheduler(model, cache, num_draft)
    try:
        seen = speculation_loops(_through(s, num_draft), model.config.vocab_size, 4, 9, num_draft, seed=1)
    finally:
        s.close(10)
    assert max(len(c) for c, _, _ in seen) > LONG_CONTEXT  # the long lane took some, in pieces
    for context, sampling, draft in seen:
        want = alone(model, context, num_draft, sampling)
        assert (draft.tokens, draft.probs) == (want.tokens, want.probs)
    stats = cache.stats()
    computed = sum(len(c) for c, _, _ in seen) - stats.reused_tokens
    if budget_blocks > 100:
        assert stats.evicted_blocks == 0 and stats.reused_tokens > computed
    else:
        assert stats.evicted_blocks > 0 and stats.used_bytes <= cache.budget_bytes


def test_a_long_request_dropped_mid_prefill_leaves_blocks_that_give_the_same_draft(model):
    cache = PrefixCache(BLOCK, 1 << 24)
    num_draft = 4
    s = cached_scheduler(model, cache, num_draft)
    rng = random.Random(2)
    context = [rng.randrange(3, model.config.vocab_size) for _ in range(150)]
    pieces, first_piece = s.long.prefill_chunk, []

    def cancel_after_the_first_piece(key, *args):  # its client goes away once a piece is in the cache
        out = pieces(key, *args)
        if not first_piece:
            first_piece.append(key)
            dropped.cancel(CANCELLED)
        return out

    s.long.prefill_chunk = cancel_after_the_first_piece
    try:
        dropped = s.submit(context, num_draft, 60)
        with pytest.raises(CancelledError):
            dropped.future.result(60)
        again = s.submit(context, num_draft, 60)
        draft = again.future.result(60)
    finally:
        s.close(10)
    assert first_piece == [dropped.key] and dropped.outcome == CANCELLED and 0 < again.cached < len(context) - BLOCK
    assert draft.tokens == alone(model, context, num_draft).tokens


def test_admission_costs_only_the_tokens_to_compute():
    """A long context whose prefix the lane holds is estimated (and prefilled) from the end of that prefix: in time
    for a deadline its whole prefill would miss."""
    prefix = list(range(8))
    long = FakeLane(1, 64, 4, delay=0.2, reuse=lambda c: 8 if c[:8] == prefix else 0)
    s = Scheduler(FakeLane(2, 16, 4), long, num_draft=4, long_context_tokens=8, prefill_tokens=8).start()
    try:
        assert s.submit(list(range(1, 17)), 4, 60).future.result(10).tokens == expected(range(1, 17), 4)  # costs
        with pytest.raises(Overloaded):
            s.submit(list(range(2, 18)), 1, 0.45)  # two pieces and a step
        reused = s.submit(prefix + list(range(100, 108)), 1, 0.45)  # one piece
        assert reused.cached == 8 and reused.future.result(10).tokens == expected(prefix + list(range(100, 108)), 1)
    finally:
        s.close(10)
    assert ("chunk", [8]) == long.calls[-1] and sum(c == ("chunk", [8]) for c in long.calls) == 3


# ------------------------------------------------------------------------------------------------- over HTTP

class Tokens:
    """An answer over HTTP as the loop reads it."""

    def __init__(self, tokens):
        self.tokens = tokens


def test_over_http_a_loop_gets_the_same_drafts_hit_or_miss_and_metrics_count_the_reuse(packed_dir):
    engine = load_engine(packed_dir, None, "int4")
    cfg = ServeConfig(model_dir=str(packed_dir), max_wait_ms=20, max_batch_size=8, prefix_cache_mb=64,
                      prefix_block_tokens=BLOCK, long_context_tokens=LONG_CONTEXT, threads=1)
    num_draft = 16

    def submit(contexts, settings):
        def one(context):
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                r = client.post("/draft", json={"token_ids": context, "num_tokens": num_draft})
            assert r.status_code == 200, r.text
            return r.json()["draft_ids"]
        with ThreadPoolExecutor(len(contexts)) as pool:
            return [Tokens(t) for t in pool.map(one, contexts)]

    with ThreadServer(create_app(cfg, engine), cfg) as srv:
        health = httpx.get(srv.url + "/health").json()["prefix_cache"]
        assert health == {"block_tokens": BLOCK, "budget_bytes": 64 << 20, "used_bytes": 0, "blocks": 0}
        seen = speculation_loops(submit, engine.vocab_size, 3, 5, num_draft, seed=3)
        samples = metric_samples(srv.url)
        health = httpx.get(srv.url + "/health").json()["prefix_cache"]
    model = engine.model
    for context, _, draft in seen:
        assert draft.tokens == alone(model, context, num_draft).tokens
    reused = samples[("specdraft_context_tokens_reused_total", ())]
    computed = samples[("specdraft_context_tokens_total", ())]
    assert reused > 0 and reused + computed == sum(len(c) for c, _, _ in seen)
    assert samples[("specdraft_prefix_cache_hits_total", ())] > 0
    assert samples[("specdraft_prefix_cache_evictions_total", ())] == 0
    assert samples[("specdraft_prefix_cache_bytes", ())] == health["used_bytes"] > 0 and health["blocks"] > 0


def test_no_prefix_cache_when_its_budget_is_0(packed_dir):
    engine = load_engine(packed_dir, None, "int4")
    cfg = ServeConfig(model_dir=str(packed_dir), prefix_cache_mb=0, threads=1)
    with ThreadServer(create_app(cfg, engine), cfg) as srv:
        context = list(range(3, 60))
        first = httpx.post(srv.url + "/draft", json={"token_ids": context}).json()
        assert httpx.post(srv.url + "/draft", json={"token_ids": context}).json() == first
        assert httpx.get(srv.url + "/health").json()["prefix_cache"] is None
        samples = metric_samples(srv.url)
    assert samples[("specdraft_context_tokens_reused_total", ())] == 0
    assert samples[("specdraft_prefix_cache_budget_bytes", ())] == 0
    assert first["draft_ids"] == engine.draft([context], 16)[0]  # prefilled whole, as without a cache
