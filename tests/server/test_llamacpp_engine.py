"""`specdraft serve --engine llama.cpp`: the packed tiny draft's GGUF export served by llama.cpp. Speculation loops get
every draft bit for bit as the request alone in a fresh server gets it -- batched or alone, greedy or sampled, after
the sequence that held it was taken by another context, through the long lane's pieces -- and only what is new is
computed (drafted tokens the next context confirms included); over HTTP the metrics count it; a GGUF that is not the
draft's is refused naming why."""

import json
import random
import time

import httpx
import pytest

from servers import ThreadServer, metric_samples
from specdraft.model.generation import DraftSampling
from specdraft.model.llamacpp import PASS_CANDIDATES, PROBE_TOKENS, exact_pass_tokens, llama_cpp_module, load_gguf_model
from specdraft.model.llamacpp_slots import LlamaCppSlots, SessionCache, common_prefix
from specdraft.model.sampling import SamplingParams
from specdraft.model.specs import DEFAULT_TARGET
from specdraft.model.trace_llamacpp import target_gguf
from specdraft.server.app import create_app
from specdraft.server.config import ServeConfig
from specdraft.server.engine import Engine, LlamaCppEngine, SlotLane, gguf_of, load_llamacpp_engine
from specdraft.server.engine_choice import LoopReplay, load_serving_engine, replay_loop
from specdraft.server.scheduler import Scheduler
from specdraft.stages.export import ExportConfig, run_export

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'specdraft[llama]')")

NUM_DRAFT = 8
LONG_CONTEXT = 40  # beyond it the long lane, prefilled in pieces


@pytest.fixture(scope="module")
def draft(packed_dir, tmp_path_factory):
    """The packed tiny draft and its GGUF export (with the export record beside it)."""
    gguf = tmp_path_factory.mktemp("llama_engine") / "draft.gguf"
    run_export(ExportConfig(model_dir=str(packed_dir), format="gguf", out=str(gguf)))
    return packed_dir, gguf


@pytest.fixture(scope="module")
def engine(draft):
    engine = load_llamacpp_engine(*draft, threads=1)
    yield engine
    engine.close()


def lane(engine, slots: int, capacity: int, cache: SessionCache | None,
         pass_tokens: int | None = None) -> LlamaCppSlots:
    decoder = LlamaCppSlots(engine.model, slots, capacity, NUM_DRAFT, set(), engine.vocab_size, threads=1,
                            cache=cache, pass_tokens=pass_tokens or engine.pass_tokens)
    engine.lanes.append(decoder)  # freed with the engine
    return decoder


def alone(engine, context, sampling=DraftSampling(), pass_tokens=None):
    """What a request gets in a fresh lane, nothing held: (tokens, probs)."""
    decoder = lane(engine, 1, len(context) + NUM_DRAFT, SessionCache(0), pass_tokens)
    finished = decoder.admit([0], [context], [sampling])
    while not finished:
        finished = decoder.step()
    decoder.close()
    gen = finished[0][1]
    return gen.tokens, gen.probs


def loops(submit, vocab: int, count: int, steps: int, seed: int):
    """``count`` speculation loops in lock step: each call sends the whole context, then keeps a random prefix of
    the draft and one "target" token. [(context, sampling, (tokens, probs)), ...]"""
    rng = random.Random(seed)
    contexts = [[rng.randrange(3, vocab) for _ in range(rng.choice([5, 13, 30]))] for _ in range(count)]
    settings = [DraftSampling(SamplingParams(temperature=0.8), seed=i, return_probs=True) if i % 2 else
                DraftSampling() for i in range(count)]
    seen = []
    for _ in range(steps):
        drafts = submit(contexts, settings)
        for i, (tokens, probs) in enumerate(drafts):
            seen.append((list(contexts[i]), settings[i], (tokens, probs)))
            contexts[i] = contexts[i] + tokens[:rng.randint(0, NUM_DRAFT)] + [rng.randrange(3, vocab)]
    return seen


def test_common_prefix_counts_shared_leading_tokens_up_to_a_limit():
    a = list(range(200))
    assert common_prefix(a, a, 500) == 200 and common_prefix(a, a, 130) == 130
    assert common_prefix(a, a[:70] + [-1] + a[71:], 500) == 70
    assert common_prefix(a, [], 10) == 0 and common_prefix([5], [6], 10) == 0


def test_loops_through_the_scheduler_get_what_they_get_alone_and_compute_only_what_is_new(engine):
    cache = SessionCache(0)  # no sessions beyond the rows: 3 loops in 4 short rows, the long lane's one
    short = SlotLane(lane(engine, 4, LONG_CONTEXT + NUM_DRAFT, cache), 4, LONG_CONTEXT + NUM_DRAFT, 1)
    long = SlotLane(lane(engine, 1, 200 + NUM_DRAFT, cache), 1, 200 + NUM_DRAFT, 1)
    scheduler = Scheduler(short, long, num_draft=NUM_DRAFT, long_context_tokens=LONG_CONTEXT, prefill_tokens=64,
                          chunk_tokens=16).start()

    def submit(contexts, settings):
        requests = [scheduler.submit(c, NUM_DRAFT, 60, s) for c, s in zip(contexts, settings)]
        return [(d.tokens, d.probs) for d in (r.future.result(60) for r in requests)]

    try:
        seen = loops(submit, engine.vocab_size, 3, 6, seed=5)
    finally:
        scheduler.close(10)
    assert any(len(c) > LONG_CONTEXT for c, _, _ in seen) and any(len(c) <= LONG_CONTEXT for c, _, _ in seen)
    for context, sampling, got in seen:
        assert got == alone(engine, context, sampling), len(context)
    # a loop's call computes its whole context when it is the loop's first or has just moved to the long lane;
    # else only the target's token, and the last drafted token when it kept the whole draft (never fed)
    bound, previous = 0, {}
    for n, (context, _, _) in enumerate(seen):
        loop = n % 3
        moved = loop not in previous or (previous[loop] > LONG_CONTEXT) != (len(context) > LONG_CONTEXT)
        bound += len(context) if moved else 2
        previous[loop] = len(context)
    stats = cache.stats()
    computed = sum(len(c) for c, _, _ in seen) - stats.reused_tokens
    assert stats.hits > 0 and 0 < computed <= bound


def test_a_sequence_taken_by_another_context_gives_the_same_drafts(engine):
    cache = SessionCache(0)
    decoder = lane(engine, 1, 100, cache)  # one sequence: every new context evicts the last one
    rng = random.Random(1)
    contexts = [[rng.randrange(3, engine.vocab_size) for _ in range(20)] for _ in range(2)]
    results = []
    for context in [contexts[0], contexts[0] + [7, 8], contexts[1], contexts[0] + [7, 8]]:
        finished = decoder.admit([0], [context])
        while not finished:
            finished = decoder.step()
        results.append((finished[0][1].tokens, context))
    stats = cache.stats()
    assert stats.lookups == 4 and stats.hits == 1 and stats.evicted_blocks > 0
    for tokens, context in results:
        assert tokens == alone(engine, context)[0]


def test_a_context_sent_again_or_cut_short_computes_its_last_token_again(engine):
    # a retry sends the same context; a client may send less than it did before: the held sequence gives all but
    # the last token, whose logits the draft starts from
    cache = SessionCache(0)
    decoder = lane(engine, 1, 100, cache)
    context = list(range(7, 40))
    for sent in (context, context, context[:20], context[:21]):
        finished = decoder.admit([0], [sent])
        while not finished:
            finished = decoder.step()
        assert finished[0][1].tokens == alone(engine, sent)[0], len(sent)
    assert cache.stats().reused_tokens == 32 + 19 + 20


def test_batched_rows_and_a_released_row_leave_the_others_as_alone(engine):
    decoder = lane(engine, 3, 64, SessionCache(1 << 20))
    rng = random.Random(2)
    contexts = [[rng.randrange(3, engine.vocab_size) for _ in range(n)] for n in (4, 17, 31)]
    finished = dict(decoder.admit([0, 1, 2], contexts))
    decoder.step()
    decoder.release([1])
    while len(finished) < 2:
        finished.update(decoder.step())
    assert set(finished) == {0, 2} and decoder.free == 3
    for i in (0, 2):
        assert finished[i].tokens == alone(engine, contexts[i])[0]


def test_without_a_cache_nothing_is_kept_and_the_drafts_are_the_same_bits(engine):
    decoder = lane(engine, 2, 80, None)
    context = list(range(5, 45))
    for _ in range(2):
        finished = decoder.admit([0], [context])
        while not finished:
            finished = decoder.step()
        assert finished[0][1].tokens == alone(engine, context)[0]
        assert decoder.reusable(context) == 0 and decoder.held_tokens() == (0, 0)


def test_contexts_prefilled_in_the_probed_passes_get_what_one_token_passes_give(engine):
    # the engine prefills in passes of as many tokens as its probe at load found exact; contexts longer than the
    # probe's, their passes starting anywhere (a held prefix of any length), get the bits of one-token passes
    assert engine.pass_tokens in (1, *PASS_CANDIDATES)
    assert engine.compute_choice["prefill_pass_tokens"] == engine.pass_tokens
    rng = random.Random(3)
    context = [rng.randrange(3, engine.vocab_size) for _ in range(PROBE_TOKENS + 150)]
    one_token = alone(engine, context, DraftSampling(return_probs=True), pass_tokens=1)
    assert alone(engine, context, DraftSampling(return_probs=True)) == one_token
    decoder = lane(engine, 1, len(context) + NUM_DRAFT, SessionCache(0))
    for held in (37, 300):  # a session holding that prefix, the rest computed in passes from there
        for sent in (context[:held], context):
            finished = decoder.admit([0], [sent], [DraftSampling(return_probs=True)])
            while not finished:
                finished = decoder.step()
        assert (finished[0][1].tokens, finished[0][1].probs) == one_token


def test_the_probe_refuses_a_pass_that_rounds_otherwise():
    # one pass over the whole probe is computed by other kernels than one-token passes (docs/history.md, "Speed in
    # llama.cpp"): the probe must not take it, and falls back to one-token passes
    model = load_gguf_model(target_gguf(DEFAULT_TARGET))  # the embedded target's Q4_1 file
    try:
        assert exact_pass_tokens(model, threads=1, candidates=(PROBE_TOKENS,)) == 1
    finally:
        llama_cpp_module().llama_model_free(model)


def test_a_draft_that_stops_is_the_full_drafts_prefix(engine):
    context = list(range(5, 30))
    full, _ = alone(engine, context, DraftSampling(return_probs=True))
    stopped, probs = alone(engine, context, DraftSampling(return_probs=True, stop_confidence=1.0))
    assert stopped == full[:len(stopped)] and len(stopped) == 1  # no token is certain in a random model


def test_a_guided_row_follows_its_guide_as_the_in_process_llamacpp_drafter_does(draft, engine):
    """A guided row (``DraftSampling.guides``) gets what ``LlamaCppDrafter`` drafts with the same guides in process;
    the plain draft as its guide is followed to the end, a guide of random tokens at ratio 1 gives the plain draft."""
    from specdraft.drafting.llamacpp import LlamaCppDrafter

    rng = random.Random(4)
    in_process = LlamaCppDrafter(draft[1], threads=1)
    try:
        for n in (6, 21, 45):
            context = [rng.randrange(3, engine.vocab_size) for _ in range(n)]
            plain = alone(engine, context)[0]
            noise = [rng.randrange(3, engine.vocab_size) for _ in range(NUM_DRAFT)]
            for guides, ratio in (([plain], 1.0), ([noise], 1.0), ([plain[:3] + noise[:5]], 0.05),
                                  ([noise, plain[:6]], 0.05)):
                got = alone(engine, context, DraftSampling(guides=tuple(map(tuple, guides)), guide_min_ratio=ratio))[0]
                in_process.reset()
                assert got == in_process.draft_guided([context], NUM_DRAFT, [guides], [ratio])[0]
                if ratio == 1.0:
                    assert got == plain
    finally:
        in_process.close()


def test_over_http_the_llamacpp_engine_serves_reuses_and_reports(draft, engine):
    packed, gguf = draft
    cfg = ServeConfig(model_dir=str(packed), engine="llama.cpp", gguf=str(gguf), max_wait_ms=20, max_batch_size=4,
                      prefix_cache_mb=8, long_context_tokens=LONG_CONTEXT, threads=1)

    def submit(contexts, settings):
        out = []
        for context in contexts:
            r = httpx.post(srv.url + "/draft", json={"token_ids": context, "num_tokens": NUM_DRAFT}, timeout=60)
            assert r.status_code == 200, r.text
            out.append((r.json()["draft_ids"], None))
        return out

    served = load_llamacpp_engine(packed, gguf, threads=1)  # the server frees it when it stops
    with ThreadServer(create_app(cfg, served), cfg) as srv:
        health = httpx.get(srv.url + "/health").json()
        seen = loops(submit, engine.vocab_size, 2, 4, seed=9)
        samples = metric_samples(srv.url)
        after = httpx.get(srv.url + "/health").json()["prefix_cache"]
    assert health["compute_choice"]["engine"] == "llama.cpp" and health["compute"].startswith("llama.cpp")
    assert health["prefix_cache"]["block_tokens"] == 1 and health["prefix_cache"]["budget_bytes"] > 0
    for context, _, (tokens, _) in seen:
        assert tokens == alone(engine, context)[0]
    reused = samples[("specdraft_context_tokens_reused_total", ())]
    computed = samples[("specdraft_context_tokens_total", ())]
    assert reused > 0 and reused + computed == sum(len(c) for c, _, _ in seen)
    assert 0 < after["used_bytes"] <= after["budget_bytes"]
    assert served.model is None and not served.lanes
    with pytest.raises(RuntimeError, match="closed"):
        served.lane(1, 64, NUM_DRAFT)


def test_a_gguf_of_other_weights_or_changed_since_export_is_refused(draft, tmp_path):
    packed, gguf = draft
    assert gguf_of(packed, gguf) == gguf
    record = json.loads((gguf.parent / (gguf.name + ".export.json")).read_text())
    other = tmp_path / "other.gguf"
    other.write_bytes(gguf.read_bytes())
    with pytest.raises(ValueError, match="no export record"):
        gguf_of(packed, other)
    record["source"]["weights_sha256"] = "0" * 64
    (tmp_path / "other.gguf.export.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="exported from weights 000000000000"):
        gguf_of(packed, other)
    with pytest.raises(ValueError, match="give --gguf"):
        ServeConfig(model_dir=str(packed), engine="llama.cpp")


@pytest.mark.parametrize("cpu, hinted", [({"capability": "AVX2", "amx": False}, True),
                                         ({"capability": "AVX512", "amx": False}, True),
                                         ({"capability": "AVX512", "amx": True}, False)])
def test_a_torch_server_without_amx_is_told_of_the_llamacpp_engine(monkeypatch, cpu, hinted):
    from specdraft.server import engine as engine_module

    monkeypatch.setattr(engine_module, "cpu_features", lambda: cpu)
    hint = engine_module.engine_hint()
    assert (hint is not None) == hinted
    if hinted:
        assert "--gguf FILE" in hint and "--engine auto" in hint and cpu["capability"] in hint


@pytest.mark.parametrize("cheaper", ["torch", "llama.cpp"])
def test_auto_replays_a_loop_on_both_engines_and_serves_the_cheaper_freeing_the_other(draft, cheaper):
    packed, gguf = draft
    measured = {}

    def measure(engine, replay, num_draft):  # the real replay, the engines' loop costs set
        name = "llama.cpp" if isinstance(engine, LlamaCppEngine) else "torch"
        measured[name] = engine, replay_loop(engine, LoopReplay(prompt_tokens=24, timed_calls=2), num_draft)
        return {**measured[name][1], "loop_s": 1.0 if name == cheaper else 3.0}

    served = load_serving_engine(ServeConfig(model_dir=str(packed), gguf=str(gguf), compute="float32", threads=1,
                                             num_draft=NUM_DRAFT), measure=measure)
    try:
        for _, seconds in measured.values():
            assert 0 < seconds["first_call_s"] and 0 < seconds["later_call_s"]
        choice = served.compute_choice["engine_choice"]
        assert choice["engine"] == cheaper and set(choice["candidates"]) == {"torch", "llama.cpp"}
        assert isinstance(served, LlamaCppEngine if cheaper == "llama.cpp" else Engine)
        llama = measured["llama.cpp"][0]
        assert all(lane.ctx is None for lane in llama.lanes)  # the replay's lane is freed
        assert (llama.model is None) == (cheaper == "torch")  # the engine not chosen is closed
    finally:
        served.close()


def test_an_auto_server_given_the_gguf_serves_the_engine_it_measured(draft):
    packed, gguf = draft
    cfg = ServeConfig(model_dir=str(packed), gguf=str(gguf), threads=1, max_wait_ms=5, num_draft=NUM_DRAFT)
    with ThreadServer(create_app(cfg), cfg) as srv:
        for _ in range(600):  # the engines load and are timed in a thread; /health says 503 until then
            health = httpx.get(srv.url + "/health", timeout=10)
            if health.status_code == 200:
                break
            time.sleep(0.1)
        answer = httpx.post(srv.url + "/draft", json={"token_ids": list(range(5, 40))}, timeout=60)
    body = health.json()
    choice = body["compute_choice"]["engine_choice"]
    assert health.status_code == 200 and choice["engine"] in ("torch", "llama.cpp")
    assert body["compute"].startswith("llama.cpp") == (choice["engine"] == "llama.cpp")
    assert all(figures["loop_s"] > 0 for figures in choice["candidates"].values())
    assert answer.status_code == 200 and len(answer.json()["draft_ids"]) == NUM_DRAFT
