"""Fake model sides for server tests that need no model: a lane whose answer is a function of the context; a fake
draft server over HTTP, and contexts prompt lookup drafts from."""

import threading
import time

from specdraft.model.prefix_cache import PrefixCache
from specdraft.server.scheduler import Draft


def expected(context, n, vocab=1000):
    """The fake draft of a context: [sum(context) + k for k in range(n)] (mod vocab)."""
    return [(sum(context) + k) % vocab for k in range(n)]


class FakeLane:
    """A ``scheduler.Lane`` without a model: one token per step per row, ``expected`` of its context (whatever
    the row's sampling settings, which ``sampling`` records per key). Records every call; ``delay`` slows each
    model call, ``gate`` holds them, ``fail_when(context)`` raises; ``reuse(context)`` is what a prefix cache would
    copy in (default: no cache); a row whose sampling has a ``stop_confidence`` stops after ``stop_after`` tokens (None:
never)."""

    def __init__(self, slots, capacity, num_draft, vocab=1000, delay=0.0, gate=None, fail_when=None, calls=None,
                 hook=None, reuse=None, stop_after=None):
        self.slots, self.capacity, self.num_draft, self.vocab = slots, capacity, num_draft, vocab
        self.stop_after = stop_after
        self.reuse, self.block_tokens = reuse, 0
        self.delay, self.gate, self.fail_when, self.hook = delay, gate, fail_when, hook
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # key -> (context, tokens)
        self.chunked: tuple[int, int] | None = None  # (key, tokens prefilled)
        self.calls: list[tuple] = [] if calls is None else calls  # two lanes may share one log
        self.sampling: dict = {}  # key -> the DraftSampling its row was admitted with

    @property
    def free(self):
        return self.slots - len(self.rows) - (self.chunked is not None)

    def cached(self, context):
        return self.reuse(context) if self.reuse is not None else 0

    def _model(self, what, contexts):
        self.calls.append((what, [len(c) for c in contexts]))
        if self.hook is not None:
            self.hook(what, contexts)
        if self.gate is not None:
            self.gate.wait(90)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_when is not None and any(self.fail_when(c) for c in contexts):
            raise RuntimeError("boom")

    def _emit(self, key):
        context, tokens = self.rows[key]
        tokens.append(expected(context, len(tokens) + 1, self.vocab)[-1])
        stops = getattr(self.sampling.get(key), "stop_confidence", None) is not None
        stopped = stops and self.stop_after is not None and len(tokens) >= self.stop_after
        out = Draft(list(tokens), stopped=stopped and len(tokens) < self.num_draft)
        if len(tokens) >= self.num_draft or stopped:
            del self.rows[key]
        return out

    def admit(self, keys, contexts, sampling):
        assert len(keys) <= self.free and len({len(c) for c in contexts}) == 1 and len(sampling) == len(keys)
        self.sampling.update(zip(keys, sampling))
        self._model("admit", contexts)
        for key, c in zip(keys, contexts):
            self.rows[key] = (list(c), [])
        return {key: self._emit(key) for key in keys}

    def prefill_chunk(self, key, context, start, size, sampling):
        self.sampling[key] = sampling
        assert (self.chunked is None and start == self.cached(context) and self.free) or self.chunked == (key, start)
        self._model("chunk", [context[start:start + size]])
        end = min(start + size, len(context))
        if end < len(context):
            self.chunked = (key, end)
            return {}
        self.chunked = None
        self.rows[key] = (list(context), [])
        return {key: self._emit(key)}

    def step(self):
        self._model("step", [c for c, _ in self.rows.values()])
        return {key: self._emit(key) for key in list(self.rows)}

    def release(self, keys):
        for key in keys:
            self.rows.pop(key, None)
            if self.chunked and self.chunked[0] == key:
                self.chunked = None

    def close(self):
        self.calls.append(("close", []))


class FakeEngine:
    """A ``server.engine.DraftEngine`` for ``create_app``: its lanes are ``FakeLane``s (``lanes`` keeps them)."""

    name, compute, vocab_size, max_positions = "fake", "float32", 1000, 272

    def __init__(self, delay=0.0, fail_when=None, gate: threading.Event | None = None, hook=None):
        self.delay, self.fail_when, self.gate, self.hook, self.lanes = delay, fail_when, gate, hook, []
        # what ``model.loader.resolve_compute`` says of a compute given on the command line
        self.compute_choice = {"compute": self.compute, "prefill": self.compute, "requested": self.compute,
                               "reason": f"--compute {self.compute}"}

    def prefix_cache(self, block_tokens, budget_bytes):
        return PrefixCache(block_tokens, budget_bytes)

    def close(self):
        pass

    def lane(self, slots, capacity, num_draft, prefix_cache=None):
        lane = FakeLane(slots, capacity, num_draft, self.vocab_size, self.delay, self.gate, self.fail_when,
                        hook=self.hook)
        self.lanes.append(lane)
        return lane

    @property
    def calls(self):
        return [c for lane in self.lanes for c in lane.calls]

    @staticmethod
    def expected(context, n):
        return expected(context, n, FakeEngine.vocab_size)


class JSONHandler:
    """Mixin for a ``BaseHTTPRequestHandler`` fake draft server: ``send_json`` answers, and no access log."""

    def send_json(self, code, payload, headers=None):
        import json

        data = json.dumps(payload).encode()
        self.send_response(code)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def serve_http(handler):
    """A ``ThreadingHTTPServer`` of ``handler`` on a free loopback port, in a thread: yields its URL (a fixture's
    body), then shuts it down."""
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def repeating_context(rng, length, high, repeat):
    """``length`` random ids in [5, high), then their first ``repeat`` again: prompt lookup finds a draft for it."""
    base = [rng.randrange(5, high) for _ in range(length)]
    return base + base[:repeat]
