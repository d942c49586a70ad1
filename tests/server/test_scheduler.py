"""The scheduler's rules: each request its own answer, decode steps between budgeted prefills, a long context in
chunks that delay a short request by at most one chunk, no work for a request nobody waits for, early refusal
of what cannot meet its deadline, and a close that answers or refuses everything. Fake lanes count model calls;
the tiny models check that the real lanes give every request the tokens it gets alone."""

import random
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from fakes import FakeLane, expected
from specdraft.model.decode import draft_batch, draft_rows
from specdraft.model.generation import DraftSampling
from specdraft.model.sampling import SamplingParams
from specdraft.server.engine import torch_lane
from specdraft.server.scheduler import (
    CANCELLED,
    COMPUTED_KEYS_KEPT,
    TIMED_OUT,
    DraftFailedError,
    Overloaded,
    QueueFullError,
    Scheduler,
    ShuttingDownError,
)


class Recorder:
    """scheduler.Observer that keeps what it is told."""

    def __init__(self):
        self.drops, self.iterations = [], 0

    def iteration(self, seconds, rows, prefill_tokens, ok):
        self.iterations += 1

    def admitted(self, waits):
        pass

    def dropped(self, outcome, running):
        self.drops.append((outcome, running))

    def depth(self, waiting, running):
        pass


def _scheduler(short_slots=4, long=True, num_draft=4, long_context=8, **kw):
    short = FakeLane(short_slots, long_context + num_draft, num_draft, delay=kw.pop("delay", 0.0),
                     gate=kw.pop("gate", None), fail_when=kw.pop("fail_when", None))
    lane = FakeLane(1, 100 + num_draft, num_draft) if long else None
    observer = Recorder()
    s = Scheduler(short, lane, num_draft=num_draft, long_context_tokens=long_context, observer=observer, **kw)
    return s.start(), short, lane, observer


def test_each_request_gets_its_own_answer_short_and_long():
    s, short, long, _ = _scheduler()
    try:
        contexts = [[i, i + 1] for i in range(10)] + [list(range(30))]
        requests = [s.submit(c, 1 + i % 4, 30) for i, c in enumerate(contexts)]
        want = [expected(c, 1 + i % 4) for i, c in enumerate(contexts)]
        assert [r.future.result(10).tokens for r in requests] == want
    finally:
        s.close(10)
    assert any(what == "chunk" for what, _ in long.calls) and not any(what == "chunk" for what, _ in short.calls)
    assert max(len(lengths) for what, lengths in short.calls if what == "step") > 1  # rows decoded together


def test_a_long_prefill_delays_a_short_request_by_at_most_one_chunk():
    """While a long context is prefilled chunk by chunk, a short request submitted meanwhile is admitted at the next
    iteration and answered num_tokens - 1 steps later: between its admission and its answer the long lane runs
    at most one chunk per iteration, never the rest of its prefill."""
    log, submitted = [], threading.Event()
    short_request = []

    def hold_third_chunk(what, contexts):  # the short request arrives while the long prefill is under way
        if what == "chunk" and sum(c[0] == "chunk" for c in log) == 3:
            short_request.append(s.submit([5, 6, 7], 4, 60))
            submitted.set()

    short = FakeLane(4, 8 + 4, 4, calls=log)
    long = FakeLane(1, 400 + 4, 4, calls=log, hook=hold_third_chunk)
    s = Scheduler(short, long, num_draft=4, long_context_tokens=8, prefill_tokens=16, chunk_tokens=4).start()
    try:
        long_request = s.submit(list(range(400)), 4, 60)
        assert submitted.wait(10)
        assert short_request[0].future.result(10).tokens == expected([5, 6, 7], 4)
        assert long_request.future.result(30).tokens == expected(list(range(400)), 4)
    finally:
        s.close(10)
    first = log.index(("admit", [3]))
    answered = first + [i for i, c in enumerate(log[first:]) if c == ("step", [3])][2]  # its 4th token
    between = log[first:answered + 1]
    chunks = [c for c in between if c[0] == "chunk"]
    assert len(chunks) <= 4 and all(c[1][0] <= 16 for c in chunks), between  # one per iteration at most
    assert sum(c[1][0] for c in log if c[0] == "chunk") == 400  # and the long context got all its chunks


def test_a_cancelled_request_is_never_computed():
    gate = threading.Event()
    s, short, _, observer = _scheduler(short_slots=1, gate=gate)
    try:
        first = s.submit([1, 2], 4, 60)
        while not short.calls:  # the worker holds the first request in the (gated) admit
            time.sleep(0.001)
        queued = s.submit([3, 4], 4, 60)
        queued.cancel(CANCELLED)
        gate.set()
        assert first.future.result(10).tokens == expected([1, 2], 4)
    finally:
        gate.set()
        s.close(10)
    assert queued.key not in s.computed_keys and (CANCELLED, False) in observer.drops
    assert all(lengths != [2] or what != "admit" for what, lengths in short.calls[1:])


def test_a_request_cancelled_while_running_stops_at_the_next_iteration():
    s, short, _, observer = _scheduler(num_draft=16, delay=0.01)
    try:
        r = s.submit([1, 2, 3], 16, 60)
        while not any(what == "step" for what, _ in short.calls):
            time.sleep(0.001)
        r.cancel(CANCELLED)
        steps_then = sum(what == "step" for what, _ in short.calls)
        deadline = time.time() + 5
        while (CANCELLED, True) not in observer.drops:
            assert time.time() < deadline
            time.sleep(0.005)
    finally:
        s.close(10)
    assert sum(what == "step" for what, _ in short.calls) <= steps_then + 1 and not short.rows


def test_a_request_past_its_deadline_is_dropped_without_compute():
    gate = threading.Event()
    s, short, _, observer = _scheduler(short_slots=1, gate=gate)
    try:
        first = s.submit([1], 1, 60)
        while not short.calls:
            time.sleep(0.001)
        late = s.submit([2, 2], 1, 0.05)
        time.sleep(0.1)
        gate.set()
        assert first.future.result(10).tokens == [1]
        with pytest.raises(TimeoutError):
            late.future.result(10)
    finally:
        gate.set()
        s.close(10)
    assert late.key not in s.computed_keys and late.outcome == TIMED_OUT and (TIMED_OUT, False) in observer.drops


def test_a_long_context_that_can_no_longer_make_its_deadline_is_dropped_before_its_prefill():
    observer = Recorder()
    long = FakeLane(1, 64, 4, delay=0.3)
    s = Scheduler(FakeLane(2, 16, 4), long, num_draft=4, long_context_tokens=8, prefill_tokens=8,
                  observer=observer).start()
    try:
        first = s.submit(list(range(16)), 4, 60)  # 2 chunks + 3 steps of 0.3 s: answered at 1.5 s
        late = s.submit(list(range(1, 17)), 4, 2.4)  # as long again, but due 0.9 s after that
        dropped_at = []
        late.future.add_done_callback(lambda _: dropped_at.append(time.monotonic()))
        assert first.future.result(10).tokens == expected(range(16), 4)
        with pytest.raises(TimeoutError):
            late.future.result(10)
    finally:
        s.close(10)
    assert late.key not in s.computed_keys and late.outcome == TIMED_OUT and (TIMED_OUT, False) in observer.drops
    assert dropped_at[0] < late.deadline  # dropped for what it still needed, not for a deadline already past


def test_work_that_cannot_meet_its_deadline_is_refused_at_once():
    s, short, _, _ = _scheduler(num_draft=16, delay=0.05)
    try:
        assert len(s.submit([1, 2], 16, 60).future.result(10).tokens) == 16  # measures the costs
        t = time.perf_counter()
        with pytest.raises(Overloaded) as refused:
            s.submit([3, 4], 16, 0.2)  # 16 iterations of >= 0.05 s cannot fit in 0.2 s
        assert time.perf_counter() - t < 0.1 and refused.value.retry_after > 0
        assert len(s.submit([5, 6], 16, 60).future.result(10).tokens) == 16  # a reachable deadline is taken
    finally:
        s.close(10)


def test_an_idle_server_costs_a_request_by_its_own_work_after_a_burst_of_prefills():
    """A burst whose every iteration prefilled a context, then timed out while running, leaves the measured
    iteration slow; the idle server must still take a request that alone fits its deadline (its prefill at the
    measured cost per token, its steps at the decode steps' cost), not cost its 16 steps as 16 prefill iterations
    and refuse it, and every request after it, with nothing running to correct the estimate."""
    def slow_prefill(what, contexts):
        if what == "admit":
            time.sleep(0.02 * len(contexts[0]))  # 0.2 s for 10 tokens; a decode step costs nothing

    short = FakeLane(8, 10 + 16, 16, hook=slow_prefill)
    s = Scheduler(short, None, num_draft=16, long_context_tokens=10, prefill_tokens=10).start()
    try:
        burst = [s.submit([i] * 10, 16, 0.7) for i in range(6)]  # one admitted an iteration: each 0.2 s
        for r in burst:
            with pytest.raises(TimeoutError):
                r.future.result(10)
        assert s.costs.iteration > 0.15 > 17 * s.costs.step  # the iterations were prefills, the steps cheap
        taken = s.submit([9] * 10, 16, 1.5)  # alone: 0.2 s of prefill and 16 cheap steps
        assert taken.future.result(10).tokens == expected([9] * 10, 16)
    finally:
        s.close(10)


def test_admission_expects_a_request_that_may_stop_to_draft_what_such_requests_drafted_lately():
    """A request carrying stop_confidence is costed at the tokens stopping requests drafted, not its num_tokens: on an
    idle server whose drafts stop after their first token it is taken, where 16 steps would miss its deadline, and
    it leaves its lane without a release; a full request stays costed at its num_tokens."""
    short = FakeLane(4, 8 + 16, 16, delay=0.05, stop_after=1)
    s = Scheduler(short, None, num_draft=16, long_context_tokens=8).start()
    stop = DraftSampling(stop_confidence=0.5)
    try:
        first = s.submit([1, 2], 16, 60, stop).future.result(10)  # measures the costs
        assert first.tokens == expected([1, 2], 1) and first.stopped and short.free == 4
        assert s.costs.stop_tokens == 1
        assert s.submit([3, 4], 16, 0.4, stop).future.result(10).tokens == expected([3, 4], 1)
        with pytest.raises(Overloaded):
            s.submit([5, 6], 16, 0.4)  # 16 iterations of >= 0.05 s cannot fit in 0.4 s
    finally:
        s.close(10)


def test_stopping_rows_beside_a_cancelled_one_and_full_ones_each_get_their_answer():
    """In one lane: a request that stops after 3 tokens, one that stops only at its own length (never early), a full
    one, and a stopping one cancelled while it runs: the first is answered early and leaves without a release, the
    cancelled one is dropped, the others get all their tokens, and the lane ends empty."""
    short = FakeLane(4, 8 + 16, 16, delay=0.01, stop_after=3)
    releases = []
    release = short.release
    short.release = lambda keys: (releases.append(list(keys)), release(keys))
    observer = Recorder()
    s = Scheduler(short, None, num_draft=16, long_context_tokens=8, observer=observer).start()
    stop = DraftSampling(stop_confidence=0.5)
    try:
        stopping = s.submit([1, 2], 16, 60, stop)
        at_length = s.submit([3, 4], 3, 60, stop)  # its stop comes with its last token: a full answer
        full = s.submit([5, 6], 16, 60)
        cancelled = s.submit([7, 8], 16, 60, DraftSampling(stop_confidence=0.5, return_probs=True))
        cancelled.cancel(CANCELLED)
        got = stopping.future.result(10)
        assert got.tokens == expected([1, 2], 3) and got.stopped
        got = at_length.future.result(10)
        assert got.tokens == expected([3, 4], 3) and not got.stopped
        assert full.future.result(10).tokens == expected([5, 6], 16)
    finally:
        s.close(10)
    assert (CANCELLED, False) in observer.drops or (CANCELLED, True) in observer.drops
    assert not short.rows and not any(stopping.key in keys or at_length.key in keys for keys in releases)


def test_long_work_that_cannot_meet_its_deadline_is_refused_at_once_without_short_traffic():
    s = Scheduler(FakeLane(2, 16, 4), FakeLane(1, 64, 4, delay=0.1), num_draft=4, long_context_tokens=8,
                  prefill_tokens=8).start()
    try:
        assert s.submit(list(range(16)), 4, 60).future.result(10).tokens == expected(range(16), 4)  # measures the costs
        with pytest.raises(Overloaded):
            s.submit(list(range(1, 17)), 4, 0.3)  # 2 chunks and 3 steps of >= 0.1 s
        assert s.submit(list(range(2, 18)), 4, 60).future.result(10).tokens == expected(range(2, 18), 4)
    finally:
        s.close(10)


def test_a_full_queue_is_refused_and_close_answers_then_refuses():
    gate = threading.Event()
    s, short, _, _ = _scheduler(short_slots=1, max_queue=2, gate=gate)
    first = s.submit([1], 1, 60)
    while not short.calls:
        time.sleep(0.001)
    queued = [s.submit([2], 1, 60), s.submit([3], 1, 60)]
    with pytest.raises(QueueFullError):
        s.submit([4], 1, 60)
    gate.set()
    s.close(10)
    assert [r.future.result(0).tokens for r in [first, *queued]] == [[1], [2], [3]]
    with pytest.raises(ShuttingDownError):
        s.submit([5], 1, 60)
    assert not s.running


def test_the_queue_depth_counts_what_waits_while_the_model_holds_the_worker():
    """Three requests arrive together, two slots: the worker admits two and the model holds it; the third is
    counted as waiting at once (not only when the held iteration ends), for /metrics and for the queue limit."""
    gate = threading.Event()
    short = FakeLane(2, 12, 4, gate=gate)
    s = Scheduler(short, None, num_draft=4, long_context_tokens=8, max_queue=3)
    requests = [s.submit([i], 1, 60) for i in range(3)]  # queued before the worker starts: one batch
    s.start()
    while not short.calls:
        time.sleep(0.001)
    try:
        assert short.calls[0] == ("admit", [1, 1]) and s.queue_depth() == 1
        requests += [s.submit([3], 1, 60), s.submit([4], 1, 60)]
        with pytest.raises(QueueFullError):
            s.submit([5], 1, 60)
    finally:
        gate.set()
        s.close(10)
    assert [r.future.result(0).tokens for r in requests] == [[i] for i in range(5)]


def test_close_refuses_what_it_has_no_time_for():
    gate = threading.Event()
    s, short, _, _ = _scheduler(short_slots=1, gate=gate)
    held = s.submit([1], 4, 60)
    while not short.calls:
        time.sleep(0.001)
    queued = s.submit([2], 4, 60)
    threading.Timer(0.3, gate.set).start()
    s.close(0.1)  # the held iteration ends after the close's deadline: nothing more is started
    for r in (held, queued):
        with pytest.raises(ShuttingDownError):
            r.future.result(0)
    assert not s.running


def test_a_failed_model_call_fails_its_lane_and_the_scheduler_goes_on():
    s, short, _, _ = _scheduler(fail_when=lambda c: c == [13])
    try:
        with pytest.raises(DraftFailedError, match="boom"):
            s.submit([13], 4, 60).future.result(10)
        assert s.submit([2, 3], 4, 60).future.result(10).tokens == expected([2, 3], 4)
    finally:
        s.close(10)


def test_computed_keys_stay_bounded_over_a_long_run():
    """A long-running server sees requests without end: the record of which reached the model keeps the latest."""
    s, short, _, _ = _scheduler(short_slots=64, long=False, num_draft=1, max_queue=4 * COMPUTED_KEYS_KEPT,
                                prefill_tokens=4096)
    try:
        requests = [s.submit([i % 7], 1, 60) for i in range(COMPUTED_KEYS_KEPT + 300)]
        assert all(r.future.result(30).tokens == expected([i % 7], 1) for i, r in enumerate(requests))
    finally:
        s.close(10)
    assert len(s.computed_keys) == COMPUTED_KEYS_KEPT
    assert requests[-1].key in s.computed_keys and requests[0].key not in s.computed_keys


def test_each_request_carries_its_sampling_settings_into_its_row():
    s, short, long, _ = _scheduler()
    sampled = DraftSampling(SamplingParams(temperature=0.5), seed=9, return_probs=True)
    try:
        greedy = s.submit([1, 2], 4, 30)
        hot = s.submit([3, 4], 4, 30, sampled)
        long_hot = s.submit(list(range(30)), 4, 30, sampled)
        for r in (greedy, hot, long_hot):
            r.future.result(30)
    finally:
        s.close(10)
    assert short.sampling[greedy.key] == DraftSampling() and short.sampling[hot.key] == sampled
    assert long.sampling[long_hot.key] == sampled


# ----------------------------------------------------------------------------------- the real lanes

@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def real_lanes_scheduler(model, num_draft: int, long_context: int = 24) -> Scheduler:
    """A started scheduler over real slot lanes: 4 short rows, and one long row prefilled in chunks of 8."""
    short = torch_lane(model, 4, long_context + num_draft, num_draft)
    long = torch_lane(model, 1, 120 + num_draft, num_draft)
    return Scheduler(short, long, num_draft=num_draft, long_context_tokens=long_context, prefill_tokens=32,
                     chunk_tokens=8).start()


def test_real_lanes_give_every_request_the_draft_it_gets_alone(model):
    """Short contexts decoded together and long ones prefilled in chunks between their steps: each request's
    tokens equal ``draft_batch`` on its context alone."""
    num_draft = 6
    s = real_lanes_scheduler(model, num_draft)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 24, 5, 80, 120, 9, 60)]
    try:
        requests = [s.submit(c, 1 + i % num_draft, 60) for i, c in enumerate(contexts)]
        got = [r.future.result(60).tokens for r in requests]
    finally:
        s.close(10)
    want = [draft_batch(model, [c], 1 + i % num_draft)[0] for i, c in enumerate(contexts)]
    assert got == want


def test_real_lanes_give_sampled_requests_their_drafts_alone_beside_greedy_ones(model):
    """Requests with different settings share the lanes' batches: each gets the draft (tokens, probabilities)
    ``draft_rows`` gives its context alone with the same settings and seed."""
    num_draft = 6
    s = real_lanes_scheduler(model, num_draft)
    rng = random.Random(1)
    vocab = model.config.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 17, 5, 80, 9, 60)]
    settings = [DraftSampling(SamplingParams(temperature=0.8), seed=i, return_probs=True, top_alternatives=i % 3)
                if i % 2 else (DraftSampling(return_probs=True) if i % 3 else DraftSampling()) for i in range(7)]
    try:
        requests = [s.submit(c, 1 + i % num_draft, 60, settings[i]) for i, c in enumerate(contexts)]
        got = [r.future.result(60) for r in requests]
    finally:
        s.close(10)
    for i, (c, d) in enumerate(zip(contexts, got)):
        want = draft_rows(model, [c], 1 + i % num_draft, [settings[i]])[0]
        assert d.tokens == want.tokens
        assert (d.probs is None) == (want.probs is None) and d.probs == pytest.approx(want.probs, abs=1e-5)
        assert d.top_ids == want.alternative_ids
