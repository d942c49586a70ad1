"""HTTPDrafter under a server that cannot keep up: it honours 503 + Retry-After, retries within its patience, halves
its concurrency on refusals and grows it back, and a server that never recovers is one clear error. End to end:
`specdraft eval` against a real `specdraft serve` that refuses most requests completes with the acceptance of the
same pack in process."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from fakes import JSONHandler, repeating_context, serve_http
from specdraft.core.records import ValidationPoint
from specdraft.drafting.base import DrafterError
from specdraft.drafting.lookup import lookup_draft
from specdraft.drafting.remote import AdaptiveLimit, HTTPDrafter
from specdraft.model.simple_decode import naive_greedy
from specdraft.server.process import ServerProcess
from specdraft.stages.evaluate import EvalConfig, run_eval


class _BusyHandler(JSONHandler, BaseHTTPRequestHandler):
    """Refuses (503 overloaded, Retry-After 0.05) whenever more than ``capacity`` requests are in flight, or every
    request while ``always_refuse``; else answers prompt lookup's draft."""

    capacity = 2
    always_refuse = False
    in_flight = 0
    refused = 0
    lock = threading.Lock()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            busy = cls.always_refuse or cls.in_flight > cls.capacity
            cls.refused += busy
        try:
            time.sleep(0.02)
            if busy:
                self.send_json(503, {"error": "overloaded", "message": "the work ahead misses the deadline"},
                               {"Retry-After": "0.05"})
            else:
                self.send_json(200, {"draft_ids": lookup_draft(body["token_ids"], body["num_tokens"]),
                                     "model": "busy"})
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture
def busy_server():
    _BusyHandler.in_flight = _BusyHandler.refused = 0
    _BusyHandler.always_refuse = False
    yield from serve_http(_BusyHandler)


def _contexts(n=24):
    rng = random.Random(3)
    return [repeating_context(rng, 8, 40, 3) for _ in range(n)]


def test_refused_requests_are_retried_and_every_draft_is_lookups(busy_server):
    contexts = _contexts()
    with HTTPDrafter(busy_server, concurrency=8) as http:
        drafts = http.draft(contexts, 8)
        pressure = http.backpressure
    assert drafts == [lookup_draft(c, 8) for c in contexts]
    assert _BusyHandler.refused > 0 and pressure["retries"] == _BusyHandler.refused
    assert pressure["concurrency_lowest"] < 8 and pressure["waited_s"] > 0


def test_a_server_that_never_recovers_is_one_clear_error(busy_server):
    _BusyHandler.always_refuse = True
    with HTTPDrafter(busy_server, concurrency=2, patience_s=0.3) as http:
        with pytest.raises(DrafterError) as failure:
            http.draft([[5, 6, 7]], 4)
    message = str(failure.value)
    assert busy_server in message and "still refused after" in message and "waits 0." in message
    assert "lower the client's concurrency" in message and "--request-timeout-s" in message


def test_the_limit_halves_on_refusals_once_per_cooldown_and_grows_back():
    now = [0.0]
    limit = AdaptiveLimit(8, cooldown_s=1.0, clock=lambda: now[0])
    for _ in range(3):  # one burst of refusals: one cut
        limit.acquire()
        limit.release(refused=True)
    assert limit.limit == 4
    now[0] = 2.0
    limit.acquire()
    limit.release(refused=True)
    assert (limit.limit, limit.lowest) == (2, 2)
    for _ in range(2 + 3):  # 2 answers at limit 2 -> 3, then 3 answers -> 4
        limit.acquire()
        limit.release(refused=False)
    assert limit.limit == 4


def test_eval_over_an_overloaded_real_server_completes_with_the_in_process_acceptance(packed_dir, tiny_qwen3_dir,
                                                                                       tmp_path):
    """A real `specdraft serve` with room for one queued request (503 queue_full beyond it) and 8 clients."""
    from specdraft.model.loader import load_draft

    model, _ = load_draft(packed_dir, "float32")
    rng = random.Random(11)
    points = []
    for i in range(24):
        ctx = [rng.randrange(3, 300) for _ in range(4 + i % 7)]
        target = naive_greedy(model, ctx, 16, stop_at_eos=False).tokens
        if i % 3 == 0:
            target = target[:5] + [(target[5] + 1) % 300] + target[6:]  # a disagreement at position 6
        points.append(ValidationPoint(f"p{i}", "x", 0, ctx, target))
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"id": p.id, "category": p.category, "offset": p.offset,
                                              "context_ids": p.context_ids, "target_ids": p.target_ids}) + "\n"
                                  for p in points))
    common = dict(validation=validation, temperatures=[], plots=False, compute="float32")
    assert run_eval(EvalConfig(model_dir=packed_dir, out=tmp_path / "local", **common)) == 0
    with ServerProcess(packed_dir, tmp_path / "serve.log", ["--compute", "float32", "--max-queue", "1",
                                                            "--max-batch-size", "1", "--threads", "1"]) as server:
        ok, detail = server.wait_ready(120)
        assert ok, detail
        assert run_eval(EvalConfig(server=server.url, concurrency=8, out=tmp_path / "served", **common)) == 0
    local, served = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("local", "served"))
    assert [p["accepted"] for p in served["per_point"]] == [p["accepted"] for p in local["per_point"]]
    assert served["mean_accepted_pooled"] == local["mean_accepted_pooled"]
    assert served["backpressure"]["retries"] > 0  # the server did refuse, and nothing failed
    assert "the client sent again after its Retry-After" in (tmp_path / "served" / "report.md").read_text()
