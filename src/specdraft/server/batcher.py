"""Dynamic batching between the HTTP handlers and the model (LitServe's loop, TGI's seam).

Handlers ``submit`` one request and await its future; a single worker thread owns the model. It takes
up to ``max_batch_size`` requests, or what has arrived ``max_wait_s`` after the first one, and runs the
pure model step ``step(contexts, n) -> rows`` on them. Each request gets its own row; a failed step
fails every request of that step and the worker goes on. The queue is bounded: a full queue is refused
at once (the caller answers 503 + Retry-After) instead of growing without limit.

A batch runs ``n = max(num_tokens)`` and each request keeps its first ``num_tokens``: with greedy decoding
and no EOS stop, the first k of n tokens are exactly the k-token draft.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

log = logging.getLogger(__name__)


Step = Callable[[list[list[int]], int], Sequence[Sequence[int]]]


class QueueFullError(RuntimeError):
    """The request queue is at its limit; retry later."""


class BatcherClosedError(RuntimeError):
    """The batcher is shutting down and takes no new requests."""


class BatchFailedError(RuntimeError):
    """The model step failed for the batch that held this request."""


class BatchObserver(Protocol):
    def batch_started(self, size: int, queue_waits: list[float], queue_depth: int) -> None: ...
    def batch_finished(self, size: int, seconds: float, tokens: int, context_tokens: int, ok: bool) -> None: ...


@dataclass
class _Pending:
    token_ids: list[int]
    num_tokens: int
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    """One worker thread running ``step`` over batches of queued requests."""

    def __init__(self, step: Step, *, max_batch_size: int = 32, max_wait_s: float = 0.002,
                 max_queue: int = 256, max_batch_tokens: int = 1 << 15, observer: BatchObserver | None = None,
                 name: str = "specdraft-batcher"):
        if max_batch_size < 1 or max_queue < 1 or max_batch_tokens < 1 or max_wait_s < 0:
            raise ValueError("max_batch_size, max_queue and max_batch_tokens must be >= 1, max_wait_s >= 0")
        self.step, self.observer, self.name = step, observer, name
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_s
        self.max_batch_tokens = max_batch_tokens
        self._queue: queue.Queue[_Pending] = queue.Queue(maxsize=max_queue)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0  # steps run, for tests and logs
        self.max_batch_seen = 0

    # ------------------------------------------------------------------------------------ client side
    def start(self) -> "Batcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def submit(self, token_ids: list[int], num_tokens: int) -> Future:
        """Queue one request; its future resolves to ``num_tokens`` token ids. Never blocks."""
        if self._closing.is_set():
            raise BatcherClosedError("the server is shutting down")
        pending = _Pending(list(token_ids), int(num_tokens))
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            raise QueueFullError(f"request queue is full ({self._queue.maxsize} waiting)") from None
        return pending.future

    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` the worker answers everything queued first, else those
        requests fail with BatcherClosedError. Waits up to ``timeout`` s for the worker to end."""
        self._closing.set()
        if not drain:
            self._fail_queued(BatcherClosedError("the server shut down before this request ran"))
        if self._thread is not None:
            self._thread.join(timeout)
        # A request that slipped in after the worker's last look at the queue must not hang.
        self._fail_queued(BatcherClosedError("the server shut down before this request ran"))

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return
            if pending.future.set_running_or_notify_cancel():
                pending.future.set_exception(error)

    # ------------------------------------------------------------------------------------ worker side
    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            try:
                self._process(batch)
            except BaseException as e:  # never let the worker die: fail what is left of this batch
                log.exception("batch handling failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(BatchFailedError(f"{type(e).__name__}: {e}"))

    def _collect(self) -> list[_Pending] | None:
        """Block for the first request, then gather more until the batch is full or max_wait has passed.
        None once closing and the queue is empty."""
        while True:
            try:
                first = self._queue.get(timeout=0.05)
                break
            except queue.Empty:
                if self._closing.is_set():
                    return None
        batch = [first]
        deadline = time.perf_counter() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.perf_counter()
            try:
                batch.append(self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _process(self, batch: list[_Pending]) -> None:
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]  # drop cancelled requests
        for chunk in self._chunks(live):
            self._run_chunk(chunk)

    def _chunks(self, batch: list[_Pending]) -> list[list[_Pending]]:
        """Length-sorted chunks whose padded size (rows x (longest context + n)) fits max_batch_tokens."""
        chunks: list[list[_Pending]] = []
        current: list[_Pending] = []
        for p in sorted(batch, key=lambda p: len(p.token_ids)):
            width = len(p.token_ids) + max([p.num_tokens] + [q.num_tokens for q in current])
            if current and (len(current) + 1) * width > self.max_batch_tokens:
                chunks.append(current)
                current = []
            current.append(p)
        if current:
            chunks.append(current)
        return chunks

    def _run_chunk(self, chunk: list[_Pending]) -> None:
        started = time.perf_counter()
        n = max(p.num_tokens for p in chunk)
        if self.observer:
            self.observer.batch_started(len(chunk), [started - p.enqueued for p in chunk], self._queue.qsize())
        ok = False
        try:
            rows = [list(map(int, r)) for r in self.step([p.token_ids for p in chunk], n)]
            if len(rows) != len(chunk):
                raise AssertionError(f"model step returned {len(rows)} rows for {len(chunk)} requests")
            short = [len(r) for r in rows if len(r) < n]
            if short:
                raise AssertionError(f"model step returned rows of {short} tokens, expected {n}")
            ok = True
        except Exception as e:
            log.exception("model step failed for a batch of %d", len(chunk))
            for p in chunk:
                p.future.set_exception(BatchFailedError(f"{type(e).__name__}: {e}"))
        else:
            for p, row in zip(chunk, rows):
                p.future.set_result(row[: p.num_tokens])
        finally:
            seconds = time.perf_counter() - started
            self.batches += 1
            self.max_batch_seen = max(self.max_batch_seen, len(chunk))
            if self.observer:
                self.observer.batch_finished(len(chunk), seconds,
                                             sum(p.num_tokens for p in chunk) if ok else 0,
                                             sum(len(p.token_ids) for p in chunk), ok)
