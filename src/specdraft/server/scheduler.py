"""Iteration-level scheduling between the HTTP handlers and the model (vLLM's scheduler, TGI's router).

Handlers ``submit`` a request and await its future; one worker thread owns the model and runs iterations. Each
iteration it

1. drops the requests nobody waits for any more -- the client gave up, or the deadline passed -- from the queue
   and from the running rows, so no work is done for nobody;
2. runs one decode step for every live row (a request is answered once it has its ``num_tokens``);
3. prefills waiting requests within a budget of ``prefill_tokens``: short contexts whole (the short lane), a long
   one (longer than ``long_context_tokens``) a chunk at a time in a lane of its own. While short work waits or
   runs, a long chunk is sized to take at most ``long_share`` of the worker's time, so a long context delays
   the short requests by one chunk per iteration, never by its whole prefill.

A request whose deadline the work ahead of it cannot meet, by the measured cost of iterations and prefill
tokens (and, for one that may stop early, the tokens such requests drafted lately), is refused at once
(``Overloaded``: 503 + Retry-After) instead of timing out later; a long one that can no longer meet it when its
turn comes is dropped before its prefill. ``close`` stops taking requests, lets the running ones finish until its
timeout, fails the rest, and joins the worker.

The model side is two ``Lane`` objects (``server.engine.SlotLane``: a ``SlotDecoder``, or with the llama.cpp engine
a ``LlamaCppSlots``, keyed by request). Each request carries its own ``DraftSampling`` (greedy, or sampled with its
own seeded generator, with or without probabilities) into its row, so requests with different settings share a
batch.

With a prefix cache (``model.prefix_cache``, shared by both lanes) a lane copies in the cached blocks of a context's
prefix and computes the rest in blocks. The scheduler then counts only the tokens still to compute: in its
admission estimates (what the lane would reuse when the request arrives), in the prefill budget, in the
measured cost per token, and in a long context's progress (its first piece starts after the reused prefix, and
its pieces are whole blocks).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import count
from typing import Callable, Protocol, Sequence

from specdraft.model.generation import PLAIN, DraftSampling

log = logging.getLogger(__name__)

# outcomes of a request, as /metrics counts them
ANSWERED, TIMED_OUT, CANCELLED, FAILED = "answered", "timed_out", "cancelled", "failed"
REFUSED_OVERLOAD, REFUSED_QUEUE_FULL, REFUSED_SHUTDOWN = "refused_overload", "refused_queue_full", "refused_shutdown"
EWMA = 0.2  # weight of the newest measurement in the running cost estimates
# how many of the latest requests to reach the model ``computed_keys`` remembers: enough for a test to look, and
# bounded, since a long-running server sees requests without end
COMPUTED_KEYS_KEPT = 1024


class QueueFullError(RuntimeError):
    """The request queue is at its limit; retry later."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and takes no new requests (or ran out of time for this one)."""


class DraftFailedError(RuntimeError):
    """The model failed on the iteration that held this request."""


class Overloaded(RuntimeError):
    """The work ahead of this request cannot finish before its deadline; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Draft:
    """A request's draft so far: its tokens and, when it asked for them, their probabilities and alternatives."""

    tokens: list[int]
    probs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None
    # ended by its request's stop rule (``DraftSampling.stop_confidence``) short of the lane's length: the row has
    # already left its lane
    stopped: bool = False

    def head(self, n: int) -> "Draft":
        """The first ``n`` positions (a request may want fewer tokens than its lane's rows decode). A stop at the
        n-th token is no stop: the request got all it asked for, as the in-process rule never judges the last."""
        return Draft(self.tokens[:n], *(None if v is None else v[:n] for v in (self.probs, self.top_ids,
                                                                               self.top_probs)),
                     stopped=self.stopped and len(self.tokens) < n)


class Lane(Protocol):
    """Rows decoding together in one KV cache; keys are the scheduler's request keys."""

    slots: int
    capacity: int  # longest context + draft tokens it can hold
    # 0: contexts prefilled whole, nothing reused; else prefills run in blocks of this many tokens (a long context's
    # pieces must be whole blocks) and the cached blocks of a context's prefix are copied in
    block_tokens: int

    @property
    def free(self) -> int: ...

    def cached(self, context: Sequence[int]) -> int:
        """Tokens of ``context`` a prefill would copy in now instead of computing (0 without a prefix cache).
        Thread-safe: the HTTP side asks it for the admission estimate."""

    def admit(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
              sampling: Sequence[DraftSampling]) -> dict[int, Draft]:
        """Prefill these contexts (of one length) into free slots, each row picking its tokens as its ``sampling``
        says; the draft of every admitted row so far."""

    def prefill_chunk(self, key: int, context: Sequence[int], start: int, size: int,
                      sampling: DraftSampling) -> dict[int, Draft]:
        """Prefill one piece of a long context (the first starts at ``cached(context)``: that prefix is copied in);
        on its last piece, the row's first token (else nothing)."""

    def step(self) -> dict[int, Draft]:
        """One token for every live row; each stepped row's draft so far."""

    def release(self, keys: Sequence[int]) -> None:
        """Drop these rows, live or mid-prefill."""

    def close(self) -> None:
        """Free what the rows hold outside Python, for a lane no one runs again (the engine choice's replay)."""


class Observer(Protocol):
    def iteration(self, seconds: float, rows: int, prefill_tokens: int, ok: bool) -> None: ...
    def admitted(self, queue_waits: list[float]) -> None: ...
    def dropped(self, outcome: str, running: bool) -> None: ...
    def depth(self, waiting: int, running: int) -> None: ...


@dataclass(eq=False)
class Request:
    """One ``POST /draft``: its context, how many tokens it wants, by when, and what it has so far."""

    key: int
    context: list[int]
    num_tokens: int
    deadline: float  # time.monotonic()
    long: bool
    sampling: DraftSampling = PLAIN
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)
    prefilled: int = 0  # context tokens prefilled (or copied in) so far (a long context goes in pieces)
    cached: int = 0  # context tokens its lane would copy in when it arrived: what admission estimates leave out
    running: bool = False  # in a lane (prefilling or decoding)
    outcome: str | None = None  # set once it leaves: answered, timed_out, cancelled, failed, ...

    def cancel(self, outcome: str = CANCELLED) -> None:
        """The handler gave up on it (client gone, or its own timeout): the worker drops it at its next look."""
        if self.outcome is None:
            self.outcome = outcome
        self.future.cancel()

    @property
    def abandoned(self) -> bool:
        return self.future.done()


@dataclass
class Costs:
    """Running estimates (EWMA) of what the worker's work costs, for admission and the long chunk's size."""

    iteration: float | None = None  # seconds of one iteration
    # seconds of one iteration's decode steps (the iteration less its prefills): what each further token of a request
    # costs. Kept apart from the prefills so that an idle server does not cost a request's 16 steps at the price of
    # the prefill-heavy iterations a burst left behind (it refused everything, with nothing running to correct it).
    step: float | None = None
    short_work: float | None = None  # seconds of one iteration's short-lane work (decode step + admissions)
    per_token: float | None = None  # seconds per prefilled context token, short contexts (batched, whole)
    # a long context's chunk attends over all of its prefix, so its tokens cost more than a short prefill's
    long_per_token: float | None = None
    long_step: float = 0.0  # seconds of the long lane's decode step, in the iterations that ran one
    # tokens drafted by the requests whose stop rule may end them early (``DraftSampling.stop_confidence``): what
    # admission expects such a request to cost in decode steps, not its num_tokens (a request that stops after its
    # first token would otherwise be costed at num_tokens iterations of the prefill that dominates its life)
    stop_tokens: float | None = None

    @staticmethod
    def blend(old: float | None, new: float) -> float:
        return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass(frozen=True)
class Load:
    """What the worker has queued and running, by lane: requests and context tokens still to prefill."""

    short_waiting: int = 0
    short_tokens: int = 0
    short_running: int = 0
    long_waiting: int = 0
    long_tokens: int = 0
    long_running: int = 0

    @property
    def waiting(self) -> int:
        return self.short_waiting + self.long_waiting

    @staticmethod
    def of(waiting: dict[str, deque], running, chunked: Request | None) -> "Load":
        running = list(running)
        return Load(short_waiting=len(waiting["short"]), short_tokens=sum(map(to_compute, waiting["short"])),
                    short_running=sum(not r.long for r in running), long_waiting=len(waiting["long"]),
                    long_tokens=sum(map(to_compute, waiting["long"]))
                    + (len(chunked.context) - chunked.prefilled if chunked else 0),
                    long_running=sum(r.long for r in running))


def to_compute(r: Request) -> int:
    """Context tokens a waiting request still needs computed, as estimated when it arrived."""
    return len(r.context) - r.cached


class Scheduler:
    """One worker thread running iterations of decode steps and budgeted prefill over two lanes."""

    def __init__(self, short: Lane, long: Lane | None, *, num_draft: int, long_context_tokens: int,
                 prefill_tokens: int = 512, chunk_tokens: int = 64, long_share: float = 0.25, max_queue: int = 256,
                 max_wait_s: float = 0.0, observer: Observer | None = None, after_iteration: Callable[[], None] | None
                 = None, name: str = "specdraft-scheduler"):
        if prefill_tokens < 1 or chunk_tokens < 1 or max_queue < 1 or not 0 < long_share < 1 or max_wait_s < 0:
            raise ValueError("prefill_tokens, chunk_tokens and max_queue must be >= 1, 0 < long_share < 1, "
                             "max_wait_s >= 0")
        self.short, self.long = short, long
        self.num_draft, self.long_context_tokens = num_draft, long_context_tokens
        self.prefill_tokens, self.chunk_tokens, self.long_share = prefill_tokens, chunk_tokens, long_share
        self.max_queue, self.max_wait_s = max_queue, max_wait_s
        self.observer, self.after_iteration, self.name = observer, after_iteration, name
        self.costs = Costs()
        self._keys = count()
        self._lock = threading.Condition()
        self._inbox: deque[Request] = deque()  # submitted, not yet seen by the worker
        self._waiting = {"short": deque(), "long": deque()}  # seen, not yet in a lane
        self._running: dict[int, Request] = {}  # key -> request in a lane
        self._chunked: Request | None = None  # the long request being prefilled in pieces
        self._closing = False
        self._deadline_close: float | None = None
        self._load = Load()  # the worker's queue and lanes as of its last iteration, for submit's estimate
        self._thread: threading.Thread | None = None
        self.iterations = 0
        self._prefill_seconds = 0.0  # the current iteration's prefills so far
        # the latest requests that reached the model (tests: a dropped one never does)
        self.computed_keys: deque[int] = deque(maxlen=COMPUTED_KEYS_KEPT)

    # ------------------------------------------------------------------------------------------ client side

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, context: Sequence[int], num_tokens: int, timeout_s: float,
               sampling: DraftSampling = PLAIN) -> Request:
        """Queue one request due in ``timeout_s``; its future resolves to a ``Draft`` of ``num_tokens`` tokens,
        picked as ``sampling`` says. Never blocks. Raises ShuttingDownError, QueueFullError or Overloaded (the
        estimate of the work ahead misses the deadline)."""
        now = time.monotonic()
        with self._lock:
            if self._closing:
                raise ShuttingDownError("the server is shutting down")
            queued = len(self._inbox) + self._load.waiting
            if queued >= self.max_queue:
                raise QueueFullError(f"request queue is full ({queued} waiting)")
            long = len(context) > self.long_context_tokens
            cached = (self.long if long and self.long is not None else self.short).cached(context)
            estimate = self._estimate(len(context) - cached, self._expected_tokens(num_tokens, sampling), long)
            if estimate is not None and estimate > timeout_s:
                raise Overloaded(f"the work ahead would take about {estimate:.1f}s, past this request's "
                                 f"{timeout_s:g}s deadline", retry_after=estimate - timeout_s)
            request = Request(next(self._keys), list(context), int(num_tokens), now + timeout_s, long, sampling,
                              cached=cached)
            self._inbox.append(request)
            self._lock.notify()
        return request

    def queue_depth(self) -> int:
        with self._lock:
            return len(self._inbox) + self._load.waiting

    def close(self, timeout: float | None = None) -> None:
        """Take no new requests; answer the queued and running ones within ``timeout`` seconds, fail what is left
        with ShuttingDownError, and wait for the worker to end."""
        with self._lock:
            self._closing = True
            self._deadline_close = None if timeout is None else time.monotonic() + timeout
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        self._fail_all(ShuttingDownError("the server shut down before this request was answered"), REFUSED_SHUTDOWN)

    # ----------------------------------------------------------------------------------------- estimates

    def _expected_tokens(self, num_tokens: int, sampling: DraftSampling) -> int:
        """The decode steps a request is expected to take: num_tokens, or for one that may stop early the tokens such
        requests drafted lately (num_tokens until one has been answered)."""
        if sampling.stop_confidence is None or self.costs.stop_tokens is None:
            return num_tokens
        return max(1, min(num_tokens, math.ceil(self.costs.stop_tokens)))

    def _estimate(self, context_tokens: int, num_tokens: int, long: bool) -> float | None:
        """Seconds until a new request with ``context_tokens`` to compute would be answered, from the running costs
        and the work queued ahead of it (called with the lock held); None until the costs have been measured."""
        c, load = self.costs, self._load
        if c.iteration is None:
            return None
        inbox = [r for r in self._inbox if r.long == long]
        if long:
            ahead = load.long_tokens + sum(map(to_compute, inbox)) + context_tokens
            busy = load.short_waiting + load.short_running + sum(not r.long for r in self._inbox) > 0
            return self._long_seconds(ahead, num_tokens, busy)
        else:
            ahead = load.short_tokens + sum(map(to_compute, inbox)) + context_tokens
            rows = load.short_waiting + load.short_running + len(inbox) + 1
            wait_for_slots = max(0, rows - self.short.slots) / self.short.slots * self.num_draft
            iterations = max(ahead / self.prefill_tokens, wait_for_slots) + num_tokens
            if c.per_token is not None and c.step is not None:
                return ahead * c.per_token + iterations * c.step
        return iterations * c.iteration

    def _chunk_size(self, busy: bool) -> int:
        """Tokens of a long prefill this iteration: all of the budget when no short work waits or runs, else the
        share of the worker's time ``long_share`` allows beside the short lane's work (less what the long lane's
        own decode step takes)."""
        if not busy:
            return self.prefill_tokens
        c = self.costs
        per_token = c.long_per_token or c.per_token
        if c.short_work is None or per_token is None:
            return self.chunk_tokens
        room = self.long_share / (1 - self.long_share) * c.short_work - c.long_step
        return max(self.chunk_tokens // 4, min(self.prefill_tokens, int(room / per_token)), 1)

    def _long_seconds(self, tokens: int, num_tokens: int, busy: bool) -> float | None:
        """Seconds to prefill ``tokens`` of long context (one request's, or all queued ahead and its own) and decode
        the last request's ``num_tokens``. Beside short work, a chunk per iteration of the measured length; alone,
        prefill at the measured cost per token. The last chunk gives the first token, a decode step each further
        one (earlier requests decode in the iterations that prefill later ones)."""
        c = self.costs
        if c.iteration is None:
            return None
        if busy:
            return (math.ceil(tokens / self._chunk_size(busy)) + num_tokens - 1) * c.iteration
        per_token = c.long_per_token or c.per_token
        if per_token is None:
            return None
        step = c.long_step or c.iteration
        return tokens * per_token + (math.ceil(tokens / self.prefill_tokens) + num_tokens - 1) * step

    # ------------------------------------------------------------------------------------------ worker side

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._inbox and not self._has_work() and not self._closing:
                    self._lock.wait(0.5)
                if self._closing and not self._inbox and not self._has_work():
                    return
                if self._closing and self._deadline_close is not None and time.monotonic() > self._deadline_close:
                    return
                if self.max_wait_s and not self._has_work() and len(self._inbox) < self.short.slots:
                    self._lock.wait(self.max_wait_s)  # an idle server waits a moment for a batch to form
                arrived = list(self._inbox)
                self._inbox.clear()
            for r in arrived:
                self._waiting["long" if r.long else "short"].append(r)
            self._publish_load()
            try:
                self._iteration()
            except BaseException:  # never let the worker die: the iteration failed its own requests
                log.exception("scheduler iteration failed")
            if self.after_iteration is not None:
                self.after_iteration()

    def _has_work(self) -> bool:
        return bool(self._running or self._chunked or self._waiting["short"] or self._waiting["long"])

    def _iteration(self) -> None:
        started = time.perf_counter()
        self._prefill_seconds = 0.0  # what this iteration's prefills took (``_measure_prefill``)
        self._drop_abandoned()
        rows = len(self._running)
        prefill = 0
        ok = True
        short_started = time.perf_counter()
        try:
            self._step(self.short)
            prefill += self._admit_short()
        except Exception as e:
            ok = False
            self._fail_lane(self.short, e)
        short_seconds = time.perf_counter() - short_started
        if self.long is not None:
            try:
                long_started = time.perf_counter()
                if self._step(self.long):
                    self.costs.long_step = Costs.blend(self.costs.long_step, time.perf_counter() - long_started)
                prefill += self._prefill_long(busy=bool(self._waiting["short"]) or any(
                    not r.long for r in self._running.values()))
            except Exception as e:
                ok = False
                self._fail_lane(self.long, e)
        seconds = time.perf_counter() - started
        if rows or prefill:
            self.costs.iteration = Costs.blend(self.costs.iteration, seconds)
            self.costs.short_work = Costs.blend(self.costs.short_work, short_seconds)
        if rows:
            self.costs.step = Costs.blend(self.costs.step, max(0.0, seconds - self._prefill_seconds))
        self.iterations += 1
        self._publish_load()
        if self.observer is not None:
            self.observer.iteration(seconds, rows, prefill, ok)
            self.observer.depth(sum(map(len, self._waiting.values())), len(self._running))

    def _publish_load(self) -> None:
        """What admission estimates and /metrics read: refreshed whenever requests move between the inbox, the
        waiting queues and the lanes, before a model call that may hold the worker for long."""
        load = Load.of(self._waiting, self._running.values(), self._chunked)
        with self._lock:
            self._load = load

    def _drop_abandoned(self) -> None:
        """Requests whose client gave up or whose deadline passed leave the queue and the lanes unanswered."""
        now = time.monotonic()
        for queue in self._waiting.values():
            for r in [r for r in queue if r.abandoned or now > r.deadline]:
                queue.remove(r)
                self._drop(r, now, running=False)
        for lane in (self.short, self.long):
            gone = [r for r in self._running.values() if r.abandoned or now > r.deadline]
            if lane is not None:
                mine = [r for r in gone if (lane is self.long) == r.long]
                if mine:
                    lane.release([r.key for r in mine])
                    for r in mine:
                        del self._running[r.key]
                        if self._chunked is r:
                            self._chunked = None
                        self._drop(r, now, running=True)

    def _drop(self, r: Request, now: float, running: bool) -> None:
        outcome = r.outcome or (TIMED_OUT if now > r.deadline else CANCELLED)
        r.outcome = outcome
        if not r.future.done():
            r.future.set_exception(TimeoutError("no draft within the deadline"))
        if self.observer is not None:
            self.observer.dropped(outcome, running)

    def _step(self, lane: Lane | None) -> bool:
        if lane is None or not any((r.long == (lane is self.long)) and r.prefilled == len(r.context)
                                   for r in self._running.values()):
            return False
        self._answer(lane, lane.step())
        return True

    def _answer(self, lane: Lane, drafts: dict[int, Draft]) -> None:
        """Resolve the requests that have their tokens, and take them out of the lane."""
        done = [key for key, draft in drafts.items() if key in self._running
                and (draft.stopped or len(draft.tokens) >= self._running[key].num_tokens)]
        # the lane keeps a row until num_draft tokens or its stop rule; one that wanted fewer leaves now
        live = [key for key in done if not drafts[key].stopped and len(drafts[key].tokens) < self.num_draft]
        if live:
            lane.release(live)
        for key in done:
            r = self._running.pop(key)
            r.outcome = ANSWERED
            answer = drafts[key].head(r.num_tokens)
            if r.sampling.stop_confidence is not None:
                self.costs.stop_tokens = Costs.blend(self.costs.stop_tokens, len(answer.tokens))
            if not r.future.done():
                r.future.set_result(answer)

    def _admit_short(self) -> int:
        """Prefill waiting short contexts, whole, within the iteration's budget of tokens to compute: those of one
        length together (a row then gets exactly what it gets alone); with a prefix cache one at a time, each
        costed at what its lane copies in now. Returns the context tokens computed."""
        waiting, budget, spent = self._waiting["short"], self.prefill_tokens, 0
        while waiting and self.short.free:
            head = waiting[0]
            width = len(head.context)
            reused = self.short.cached(head.context)
            if spent and spent + width - reused > budget:
                break
            group = [waiting.popleft()]
            while (not self.short.block_tokens and waiting and len(group) < self.short.free
                   and len(waiting[0].context) == width and spent + width * (len(group) + 1) <= budget):
                group.append(waiting.popleft())
            now = time.monotonic()
            if self.observer is not None:
                self.observer.admitted([now - r.enqueued for r in group])
            for r in group:
                r.running, r.prefilled = True, width
                self._running[r.key] = r
                self.computed_keys.append(r.key)
            self._publish_load()
            computed = (width - reused) * len(group)
            started = time.perf_counter()
            tokens = self.short.admit([r.key for r in group], [r.context for r in group], [r.sampling for r in group])
            self._measure_prefill(computed, time.perf_counter() - started, long=False)
            spent += computed
            self._answer(self.short, tokens)
        return spent

    def _prefill_long(self, busy: bool) -> int:
        """One chunk of the long context being prefilled (starting the next one when the lane has room); with a
        prefix cache its first chunk starts after what the lane copies in, and every chunk is whole blocks."""
        if self._chunked is None:
            waiting = self._waiting["long"]
            while waiting and self.long.free:
                # one that can no longer finish by its deadline is dropped before any of it is computed
                head = waiting[0]
                seconds = self._long_seconds(len(head.context) - self.long.cached(head.context),
                                             self._expected_tokens(head.num_tokens, head.sampling), busy)
                now = time.monotonic()
                if seconds is None or now + seconds <= head.deadline:
                    break
                late = waiting.popleft()
                late.outcome = TIMED_OUT
                self._drop(late, now, running=False)
            if not waiting or not self.long.free:
                return 0
            r = waiting.popleft()
            r.running, r.prefilled = True, self.long.cached(r.context)
            self._running[r.key] = r
            self._chunked = r
            self.computed_keys.append(r.key)
            if self.observer is not None:
                self.observer.admitted([time.monotonic() - r.enqueued])
            self._publish_load()
        r = self._chunked
        size = whole_blocks(self._chunk_size(busy), self.long.block_tokens)
        size = min(size, len(r.context) - r.prefilled)
        started = time.perf_counter()
        tokens = self.long.prefill_chunk(r.key, r.context, r.prefilled, size, r.sampling)
        self._measure_prefill(size, time.perf_counter() - started, long=True)
        r.prefilled += size
        if r.prefilled == len(r.context):
            self._chunked = None
            self._answer(self.long, tokens)
        return size

    def _measure_prefill(self, tokens: int, seconds: float, long: bool) -> None:
        self._prefill_seconds += seconds
        if not tokens:
            return
        if long:
            self.costs.long_per_token = Costs.blend(self.costs.long_per_token, seconds / tokens)
        else:
            self.costs.per_token = Costs.blend(self.costs.per_token, seconds / tokens)

    def _fail_lane(self, lane: Lane, error: Exception) -> None:
        """A model call raised: fail every request in that lane (its cache may be half-written) and empty it."""
        log.error("model step failed (%s: %s); failing the lane's %d requests", type(error).__name__, error,
                  sum((r.long == (lane is self.long)) for r in self._running.values()))
        mine = [r for r in self._running.values() if r.long == (lane is self.long)]
        lane.release([r.key for r in mine])
        for r in mine:
            del self._running[r.key]
            if self._chunked is r:
                self._chunked = None
            r.outcome = FAILED
            if not r.future.done():
                r.future.set_exception(DraftFailedError(f"{type(error).__name__}: {error}"))

    def _fail_all(self, error: Exception, outcome: str) -> None:
        with self._lock:
            pending = [*self._inbox, *self._waiting["short"], *self._waiting["long"], *self._running.values()]
            self._inbox.clear()
            for q in self._waiting.values():
                q.clear()
            self._running.clear()
            self._chunked = None
        for r in pending:
            if not r.future.done():
                r.outcome = r.outcome or outcome
                r.future.set_exception(error)


def whole_blocks(tokens: int, block: int) -> int:
    """``tokens`` rounded up to whole blocks of ``block`` tokens (as it is when ``block`` is 0: no blocks)."""
    return -(-tokens // block) * block if block else tokens


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
