"""The draft server: the HTTP API end to end over real sockets.

A `specdraft serve` subprocess on a packed tiny model (port 0, found from its log, ready when /health
says 200) serves the end-to-end tests; in-process servers with fake engines cover overload, failing
batches, loading and shutdown without a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fakes import FakeEngine
from servers import ThreadServer, metric_samples, post_together
from specdraft.model.generation import DraftSampling
from specdraft.model.sampling import SamplingParams
from specdraft.server.app import SHUTDOWN_MARGIN_S, create_app
from specdraft.server.config import ServeConfig
from specdraft.server.engine import DraftEngine, every, heap_trimmer, load_engine
from specdraft.server.process import ServerProcess

START_TIMEOUT = 120
REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- helpers

def fake_config(**kw) -> ServeConfig:
    return ServeConfig(model_dir="unused", **kw)


def wait_until(condition, timeout: float = 60, what: str = "condition") -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds (generous: CI machines are shared)."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.01)


@dataclass
class HeldWorker:
    """An in-process server over a gated fake engine, one row a batch, whose worker a one-token request (``held``,
    its future) keeps in the model until ``gate`` opens; ``pool`` sends requests that must not block the test."""

    srv: ThreadServer
    engine: FakeEngine
    pool: ThreadPoolExecutor
    held: Future
    gate: threading.Event


@contextlib.contextmanager
def held_worker(clients: int = 1, **config):
    """A ``HeldWorker`` (``max_batch_size=1``, no batching wait, and ``config``); the gate opens on leaving, also
    when the test failed, so that the held request ends."""
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    cfg = fake_config(max_batch_size=1, max_wait_ms=0, **config)
    with ThreadServer(create_app(cfg, engine), cfg) as srv, ThreadPoolExecutor(clients) as pool:
        try:
            held = pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [1], "num_tokens": 1}, timeout=60)
            wait_until(lambda: engine.calls, what="the held request in the model")
            yield HeldWorker(srv, engine, pool, held, gate)
        finally:
            gate.set()


def wait_healthy(url: str, timeout: float = START_TIMEOUT) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


def assert_error(r: httpx.Response, status: int, field: str, reason: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "message", "details"}
    fields = [d["field"] for d in body["details"]]
    assert field in fields, (field, body)
    if reason:
        assert any(reason.lower() in d["reason"].lower() for d in body["details"] if d["field"] == field), body
    return body


# ----------------------------------------------------------------------------- end to end (subprocess)

@pytest.fixture(scope="module")
def live(packed_dir):
    """serve.sh (`specdraft serve`, --weights MODEL_DIR/draft.qd4) on the packed tiny model, port 0;
    yields (url, log lines)."""
    argv = ["bash", str(REPO / "serve.sh"), "--max-wait-ms", "30", "--max-batch-size", "16", "--threads", "1",
            "--max-body-bytes", "65536"]
    env = {**os.environ, "MODEL_DIR": str(packed_dir), "PORT": "0", "PYTHON": sys.executable}
    env.pop("WEIGHTS", None)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def pump():
        for line in proc.stderr:
            lines.append(line.rstrip())
            if "listening on" in line:
                found.set()
        found.set()

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    try:
        assert found.wait(START_TIMEOUT), "no 'listening on' line"
        m = next((re.search(r"listening on (http://127\.0\.0\.1:(\d+))$", x) for x in lines if "listening on" in x))
        assert m and int(m.group(2)) > 0, lines
        url = m.group(1)
        wait_healthy(url)
        yield url, lines
    finally:
        proc.terminate()
        rc = proc.wait(30)
        pumper.join(10)
    assert rc == 0, "\n".join(lines[-20:])
    assert any("scheduler stopped after" in x for x in lines), lines[-10:]


def test_serve_logs_the_loader_line_and_health(live, packed_dir):
    url, lines = live
    assert any("specdraft.model.loader: loaded qd4 missing=0 unexpected=0" in x and str(packed_dir / "draft.qd4") in x
               for x in lines), lines
    health = httpx.get(url + "/health").json()
    choice = health.pop("compute_choice")
    cache = health.pop("prefix_cache")  # on by default, its budget a share of the memory available at start
    assert cache["block_tokens"] == 32 and cache["budget_bytes"] > 0 and cache["used_bytes"] >= 0
    assert health == {"status": "ok", "model": packed_dir.name, "compute": choice["compute"], "detail": None}
    # the default, auto: measured at load on the server's work, and said in the log and in /health
    assert choice["requested"] == "auto" and choice["reason"].startswith("measured over 6 scenarios")
    assert choice["workload"] == {"decode_rows": [1, 4], "context_tokens": [64, 256, 1024], "draft_tokens": 16}
    timed = [row for row in choice["candidates"].values() if "worst_ratio_to_fastest" in row]
    assert timed and all(row["worst_ratio_to_fastest"] >= 1.0 for row in timed)
    assert any(f"compute auto: {choice['compute']}" in x for x in lines), lines


def test_concurrent_requests_get_their_single_request_drafts(live, packed_dir):
    url, _ = live
    vocab, _ = _vocab_and_limit(url)
    rng = random.Random(7)
    requests = [{"token_ids": [rng.randrange(0, vocab) for _ in range(rng.choice([1, 2, 5, 17, 40, 90]))],
                 "num_tokens": rng.randint(1, 16)} for _ in range(24)]
    requests[0].pop("num_tokens")  # default: 16
    with httpx.Client(base_url=url, timeout=60) as client:
        single = [client.post("/draft", json=r).json() for r in requests]
    before = metric_samples(url)
    barrier = threading.Barrier(12)

    def send(r):
        with httpx.Client(base_url=url, timeout=60) as client:
            barrier.wait()
            return client.post("/draft", json=r).json()

    for _ in range(2):
        with ThreadPoolExecutor(12) as pool:
            concurrent_ = list(pool.map(send, requests))
        assert concurrent_ == single
    assert all(len(s["draft_ids"]) == r.get("num_tokens", 16) for s, r in zip(single, requests))
    # The server returns the model's own greedy draft (same weights, same int4 kernel, in process).
    engine = load_engine(packed_dir, None, "int4")
    assert isinstance(engine, DraftEngine)
    assert [s["draft_ids"] for s in single[:4]] == [
        engine.draft([r["token_ids"]], r.get("num_tokens", 16))[0] for r in requests[:4]]
    after = metric_samples(url)
    key = ("specdraft_iteration_rows_bucket", (("le", "1.0"),))
    iterations = after[("specdraft_iteration_rows_count", ())] - before[("specdraft_iteration_rows_count", ())]
    singles = after[key] - before[key]
    assert iterations - singles > 0, "no iteration decoded more than one request"
    answered = ("specdraft_draft_outcomes_total", (("outcome", "answered"),))
    assert after[answered] - before[answered] == 2 * len(requests)  # the two concurrent rounds
    tokens = after[("specdraft_draft_tokens_total", ())] - before[("specdraft_draft_tokens_total", ())]
    assert tokens == 2 * sum(r.get("num_tokens", 16) for r in requests)


def _vocab_and_limit(url):
    schema = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["DraftRequest"]["properties"]
    items = schema["token_ids"]["items"]
    assert isinstance(items["maximum"], int)
    return items["maximum"] + 1, schema["token_ids"]["maxItems"]


BAD_JSON_BODIES = {
    "bool": ({"token_ids": [1, True, 3]}, "token_ids[1]", "got boolean"),
    "float": ({"token_ids": [1, 2.0]}, "token_ids[1]", "got float"),
    "string": ({"token_ids": ["5"]}, "token_ids[0]", "got string"),
    "null": ({"token_ids": [None]}, "token_ids[0]", "got null"),
    "nested_list": ({"token_ids": [[1, 2]]}, "token_ids[0]", "got array"),
    "negative_id": ({"token_ids": [3, -1]}, "token_ids[1]", "greater than or equal to 0"),
    "id_beyond_vocab": ({"token_ids": ["VOCAB"]}, "token_ids[0]", "less than or equal to"),
    "empty_list": ({"token_ids": []}, "token_ids", "at least 1"),
    "too_long": ({"token_ids": "LONG"}, "token_ids", "at most"),
    "token_ids_not_a_list": ({"token_ids": 5}, "token_ids", "valid list"),
    "token_ids_missing": ({"num_tokens": 4}, "token_ids", "required"),
    "num_tokens_zero": ({"token_ids": [1], "num_tokens": 0}, "num_tokens", "greater than or equal to 1"),
    "num_tokens_17": ({"token_ids": [1], "num_tokens": 17}, "num_tokens", "less than or equal to 16"),
    "num_tokens_string": ({"token_ids": [1], "num_tokens": "4"}, "num_tokens", "valid integer"),
    "num_tokens_bool": ({"token_ids": [1], "num_tokens": True}, "num_tokens", "valid integer"),
    "unknown_field": ({"token_ids": [1], "temperature": 0.5}, "temperature", "unknown field"),
    "temperature_negative": ({"token_ids": [1], "sampling": {"temperature": -0.1}}, "sampling.temperature",
                             "greater than or equal to 0"),
    "temperature_vanishing": ({"token_ids": [1], "sampling": {"temperature": 1e-9}}, "sampling.temperature",
                              "at least"),
    "temperature_string": ({"token_ids": [1], "sampling": {"temperature": "0.7"}}, "sampling.temperature",
                           "valid number"),
    "top_p_zero": ({"token_ids": [1], "sampling": {"temperature": 1, "top_p": 0}}, "sampling.top_p",
                   "greater than 0"),
    "top_p_above_1": ({"token_ids": [1], "sampling": {"top_p": 1.5}}, "sampling.top_p", "less than or equal to 1"),
    "top_k_negative": ({"token_ids": [1], "sampling": {"top_k": -1}}, "sampling.top_k", "greater than or equal"),
    "top_k_float": ({"token_ids": [1], "sampling": {"top_k": 2.5}}, "sampling.top_k", "valid integer"),
    "seed_negative": ({"token_ids": [1], "sampling": {"seed": -1}}, "sampling.seed", "greater than or equal"),
    "sampling_unknown_field": ({"token_ids": [1], "sampling": {"temp": 1}}, "sampling.temp",
                               "allowed: temperature, top_p, top_k, seed"),
    "sampling_not_object": ({"token_ids": [1], "sampling": 0.7}, "sampling", "dictionary"),
    "return_probs_string": ({"token_ids": [1], "return_probs": "yes"}, "return_probs", "valid boolean"),
    "top_alternatives_65": ({"token_ids": [1], "return_probs": True, "top_alternatives": 65}, "top_alternatives",
                            "less than or equal to 64"),
    "top_alternatives_negative": ({"token_ids": [1], "return_probs": True, "top_alternatives": -1},
                                  "top_alternatives", "greater than or equal to 0"),
    "top_alternatives_without_probs": ({"token_ids": [1], "top_alternatives": 3}, "top_alternatives",
                                       "needs return_probs"),
    "stop_confidence_zero": ({"token_ids": [1], "stop_confidence": 0}, "stop_confidence", "greater than 0"),
    "stop_confidence_negative": ({"token_ids": [1], "stop_confidence": -0.5}, "stop_confidence", "greater than 0"),
    "stop_confidence_above_1": ({"token_ids": [1], "stop_confidence": 1.5}, "stop_confidence",
                                "less than or equal to 1"),
    "stop_confidence_string": ({"token_ids": [1], "stop_confidence": "0.5"}, "stop_confidence", "valid number"),
    "stop_confidence_bool": ({"token_ids": [1], "stop_confidence": True}, "stop_confidence", "valid number"),
    "stop_confidence_list": ({"token_ids": [1], "stop_confidence": [0.5]}, "stop_confidence", "valid number"),
    "body_not_object": ([1, 2, 3], "body", "dictionary"),
}


@pytest.mark.parametrize("case", list(BAD_JSON_BODIES))
def test_bad_json_field_is_422_naming_the_field(live, case):
    url, _ = live
    vocab, limit = _vocab_and_limit(url)
    body, field, reason = BAD_JSON_BODIES[case]
    if isinstance(body, dict) and body.get("token_ids") == ["VOCAB"]:
        body = {"token_ids": [vocab]}
    if isinstance(body, dict) and body.get("token_ids") == "LONG":
        body = {"token_ids": [1] * (limit + 1)}
    assert_error(httpx.post(url + "/draft", json=body), 422, field, reason)


def test_longest_allowed_context_is_served(live):
    url, _ = live
    vocab, limit = _vocab_and_limit(url)
    assert limit == 512 - 16  # tiny model: 512 positions minus num_draft
    r = httpx.post(url + "/draft", json={"token_ids": [vocab - 1] * limit, "num_tokens": 16}, timeout=60)
    assert r.status_code == 200 and len(r.json()["draft_ids"]) == 16


def test_malformed_json_is_400(live):
    url, _ = live
    r = httpx.post(url + "/draft", content=b'{"token_ids": [1, 2', headers={"content-type": "application/json"})
    assert_error(r, 400, "body", "delimiter")


def test_invalid_utf8_is_400(live):
    url, _ = live
    r = httpx.post(url + "/draft", content=b'{"token_ids": [1], "x": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert_error(r, 400, "body")


def test_empty_body_is_422(live):
    url, _ = live
    assert_error(httpx.post(url + "/draft", content=b"", headers={"content-type": "application/json"}),
                 422, "body", "required")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_wrong_content_type_is_415(live, content_type):
    url, _ = live
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(url + "/draft", content=b'{"token_ids": [1]}', headers=headers)
    assert_error(r, 415, "headers.content-type", "application/json")


def test_body_over_the_limit_is_413(live):
    url, _ = live
    big = json.dumps({"token_ids": [1] * 40000}).encode()  # > --max-body-bytes 65536
    assert_error(httpx.post(url + "/draft", content=big, headers={"content-type": "application/json"}),
                 413, "body", "limit")

    def chunks():  # no Content-Length: the streamed size is what counts
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_error(httpx.post(url + "/draft", content=chunks(), headers={"content-type": "application/json"}),
                 413, "body", "limit")


def test_unknown_route_and_method_are_json_4xx(live):
    url, _ = live
    assert_error(httpx.get(url + "/nope"), 404, "path")
    assert_error(httpx.get(url + "/draft"), 405, "path")


def test_server_keeps_serving_and_never_5xx_after_bad_input(live):
    url, _ = live
    with httpx.Client(base_url=url) as c:
        for body in (b"{", b"[]", b'{"token_ids": [1e999]}', b'{"token_ids": [NaN]}', b"\x00" * 100,
                     b'{"token_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
            r = c.post("/draft", content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (body[:40], r.status_code, r.text[:200])
        assert c.post("/draft", json={"token_ids": [1, 2, 3], "num_tokens": 2}).status_code == 200
    samples = metric_samples(url)
    assert not [k for k, v in samples.items() if k[0] == "specdraft_requests_total"
                and dict(k[1])["route"] == "/draft" and dict(k[1])["status"].startswith("5") and v > 0]


def test_openapi_documents_the_limits(live):
    url, _ = live
    spec = httpx.get(url + "/openapi.json").json()
    req = spec["components"]["schemas"]["DraftRequest"]
    assert req["additionalProperties"] is False
    assert req["properties"]["num_tokens"]["maximum"] == 16 and req["properties"]["num_tokens"]["default"] == 16
    assert {"200", "400", "413", "415", "422", "503"} <= set(spec["paths"]["/draft"]["post"]["responses"])
    assert set(spec["paths"]) == {"/draft", "/health", "/metrics"}
    # the sampling block, probabilities and alternatives, with their bounds
    props, schemas = req["properties"], spec["components"]["schemas"]
    assert props["return_probs"]["type"] == "boolean" and props["return_probs"]["default"] is False
    assert props["top_alternatives"]["maximum"] == 64 and props["top_alternatives"]["minimum"] == 0
    assert "return_probs" in props["top_alternatives"]["description"]
    # the fields' dependencies, as a client generated from the schema sees them (schemathesis' own validator)
    import jsonschema_rs
    validator = jsonschema_rs.Draft202012Validator({**req, "components": spec["components"]})
    for body, valid in (({}, True), ({"top_alternatives": 2, "return_probs": True}, True),
                        ({"top_alternatives": 2}, False),
                        ({"guide_ids": [1], "guide_min_ratio": 0.5}, True), ({"guide_alternatives": [[1]]}, True),
                        ({"guide_min_ratio": 0.5}, False), ({"guide_ids": None, "guide_min_ratio": 0.5}, False),
                        ({"guide_ids": [1], "top_alternatives": 2, "return_probs": True}, False),
                        ({"guide_alternatives": [[1]], "sampling": {"temperature": 0.7}}, False),
                        ({"guide_ids": [1], "sampling": {"temperature": 0, "top_k": 3}}, True)):
        assert validator.is_valid({"token_ids": [1, 2, 3], **body}) is valid, body
    assert props["sampling"]["anyOf"][0]["$ref"] == "#/components/schemas/SamplingRequest"
    stop = props["stop_confidence"]["anyOf"][0]
    assert stop == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert "stop_confidence" not in req.get("required", [])  # optional
    sampling = schemas["SamplingRequest"]
    assert sampling["additionalProperties"] is False
    assert set(sampling["properties"]) == {"temperature", "top_p", "top_k", "seed"}
    assert {"enum": [0], "type": "number"} in sampling["properties"]["temperature"]["anyOf"]
    assert sampling["properties"]["top_p"]["exclusiveMinimum"] == 0 and sampling["properties"]["top_p"]["maximum"] == 1
    assert sampling["properties"]["top_k"]["minimum"] == 0
    response = schemas["DraftResponse"]
    assert set(response["properties"]) == {"draft_ids", "model", "draft_probs", "top_ids", "top_probs",
                                           "stop_reason"}
    assert set(response["required"]) == {"draft_ids", "model"}
    assert "1.0" in response["properties"]["draft_probs"]["description"]  # the greedy convention


def test_greedy_default_response_is_unchanged(live):
    """No sampling block, or one that asks for greedy and nothing more: the same body, with only its two fields."""
    url, _ = live
    body = {"token_ids": [5, 9, 33, 70], "num_tokens": 5}
    with httpx.Client(base_url=url, timeout=60) as c:
        plain = c.post("/draft", json=body).json()
        assert set(plain) == {"draft_ids", "model"} and len(plain["draft_ids"]) == 5
        for extra in ({"sampling": {"temperature": 0}}, {"sampling": None}, {"return_probs": False},
                      {"sampling": {"temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 1}, "top_alternatives": 0}):
            assert c.post("/draft", json={**body, **extra}).json() == plain, extra
        greedy_probs = c.post("/draft", json={**body, "return_probs": True, "top_alternatives": 3}).json()
    assert set(greedy_probs) == {"draft_ids", "model", "draft_probs", "top_ids", "top_probs"}
    assert greedy_probs["draft_ids"] == plain["draft_ids"]
    assert greedy_probs["draft_probs"] == [1.0] * 5  # greedy: the one-hot's probability
    assert [ids[0] for ids in greedy_probs["top_ids"]] == plain["draft_ids"]
    assert all(p == [1.0, 0.0, 0.0] for p in greedy_probs["top_probs"])


def test_sampled_drafts_are_seeded_and_batched_equal_alone(live, packed_dir):
    """Seeded sampled requests with different settings, sent alone and then concurrently beside greedy ones: the
    same drafts and probabilities; the in-process engine (same weights and kernel) draws the same."""
    url, _ = live
    vocab, _ = _vocab_and_limit(url)
    rng = random.Random(34)
    requests = []
    for i in range(16):
        r = {"token_ids": [rng.randrange(0, vocab) for _ in range(rng.choice([1, 4, 9, 30]))],
             "num_tokens": rng.randint(1, 16)}
        if i % 4:
            r["sampling"] = {"temperature": rng.choice([0.5, 1.0, 1.4]), "top_p": rng.choice([1.0, 0.9]),
                             "top_k": rng.choice([0, 40]), "seed": 1000 + i}
            r["return_probs"] = i % 2 == 1
            r["top_alternatives"] = 4 if i % 4 == 3 else 0
        requests.append(r)
    with httpx.Client(base_url=url, timeout=60) as client:
        single = [client.post("/draft", json=r).json() for r in requests]
        assert [client.post("/draft", json=r).json() for r in requests[:4]] == single[:4]  # the seed reproduces
    assert post_together(url, requests) == single
    for r, s in zip(requests, single):
        assert len(s["draft_ids"]) == r["num_tokens"]
        asked = r.get("return_probs", False)
        assert ("draft_probs" in s) == asked and ("top_ids" in s) == bool(r.get("top_alternatives"))
        if asked:
            assert len(s["draft_probs"]) == r["num_tokens"] and all(0 < p <= 1 for p in s["draft_probs"])
        if r.get("top_alternatives"):
            assert all(len(ids) == 4 and p == sorted(p, reverse=True) for ids, p in zip(s["top_ids"], s["top_probs"]))
    sampled = [(r, s) for r, s in zip(requests, single) if "sampling" in r][:4]
    served = httpx.get(url + "/health").json()["compute_choice"]  # the server's auto choice, loaded here alike
    engine = load_engine(packed_dir, None, served["compute"], prefill=served["prefill"])
    for r, s in sampled:
        settings = DraftSampling(SamplingParams(**{k: v for k, v in r["sampling"].items() if k != "seed"}),
                                 seed=r["sampling"]["seed"], return_probs=True)
        want = engine.sample([r["token_ids"]], r["num_tokens"], [settings])[0]
        assert s["draft_ids"] == want.tokens
        if "draft_probs" in s:
            assert s["draft_probs"] == pytest.approx(want.probs, abs=1e-6)
    # without a seed, two equal requests draw independently
    hot = {"token_ids": [5, 9, 33], "num_tokens": 16, "sampling": {"temperature": 1.5}}
    assert httpx.post(url + "/draft", json=hot).json() != httpx.post(url + "/draft", json=hot).json()


# ------------------------------------------------------------------------------------------ schemathesis

def _has_float(value) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return False


def run_schemathesis(url: str, max_examples: int) -> tuple[list[str], dict[str, int]]:
    """Schemathesis' engine (what `schemathesis run` drives) over the live /openapi.json: the examples,
    coverage (boundary values) and fuzzing phases in positive and negative modes, with every default check
    (no 5xx, documented status codes, content types and bodies, invalid data rejected, valid data
    accepted). Returns (failures, scenarios per phase)."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import Status, events
    from schemathesis.openapi.checks import RejectedPositiveData

    config = SchemathesisConfig()
    config.projects.default.update(request_timeout=30)
    config.projects.default.generation.update(max_examples=max_examples, deterministic=True)
    config.projects.default.phases.update(phases=["examples", "coverage", "fuzzing"])
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config)

    @schema.hook("filter_failure")
    def strict_ints_are_deliberate(ctx, failure, case, response):
        # JSON Schema counts 1.0 as an integer; the API refuses floats on purpose (pydantic StrictInt).
        return not (isinstance(failure, RejectedPositiveData) and _has_float(case.body))

    failures: list[str] = []
    scenarios: dict[str, int] = {}
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            scenarios[str(event.phase)] = scenarios.get(str(event.phase), 0) + 1
            if event.status in (Status.FAILURE, Status.ERROR):
                for case_id, checks in event.recorder.checks.items():
                    case = event.recorder.cases[case_id].value
                    failures += [f"{event.phase} {event.label} {c.name}: {c.failure_info.failure.title} "
                                 f"body={case.body!r:.200}" for c in checks
                                 if c.status != Status.SUCCESS and c.failure_info is not None]
                if not failures:
                    failures.append(f"{event.phase} {event.label}: {event.status}")
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            failures.append(f"engine error: {event}")
    return failures, scenarios


def test_schemathesis_finds_no_5xx_and_no_schema_violation(live):
    url, _ = live
    failures, scenarios = run_schemathesis(url, max_examples=40)
    assert not failures, "\n".join(failures[:10])
    assert scenarios.get("coverage", 0) >= 1 and scenarios.get("fuzzing", 0) >= 3, scenarios


def test_schemathesis_would_catch_a_5xx_on_long_contexts():
    """The check above can fail: a server that breaks on contexts over 100 tokens is caught."""
    cfg = fake_config()
    with ThreadServer(create_app(cfg, FakeEngine(fail_when=lambda c: len(c) > 100)), cfg) as srv:
        failures, _ = run_schemathesis(srv.url, max_examples=10)
    assert any("not_a_server_error" in f for f in failures), failures


def test_sigterm_with_requests_in_every_state_exits_0_within_the_shutdown_timeout(packed_dir, tmp_path):
    """Over a real socket: SIGTERM while requests are running, queued, long (prefilled in chunks), abandoned by
    their clients and timing out. Each request the server had begun to read gets an answer (200, or 503 when
    there was no time left); a connection it had not begun to read is closed, uvicorn's refusal (the client sees
    a refused, reset or closed connection); the server exits 0 within --shutdown-timeout-s, never by an abort."""
    server = ServerProcess(packed_dir, tmp_path / "serve.log",
                           ["--threads", "1", "--max-batch-size", "2", "--long-context-tokens", "32",
                            "--prefill-chunk-tokens", "8", "--request-timeout-s", "3", "--shutdown-timeout-s", "5"])
    try:
        ok, detail = server.wait_ready(START_TIMEOUT)
        assert ok, detail
        rng = random.Random(7)
        vocab = _vocab_and_limit(server.url)[0]
        bodies = ([{"token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))]} for _ in range(30)]
                  + [{"token_ids": [rng.randrange(3, vocab) for _ in range(200)]} for _ in range(6)])

        def send(i_body):
            i, body = i_body
            try:  # every fifth client gives up at once: its request is abandoned
                return httpx.post(server.url + "/draft", json=body, timeout=0.05 if i % 5 == 0 else 60).status_code
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                return "refused"
            except httpx.TimeoutException:
                return "client gave up" if i % 5 == 0 else "no answer within 60 s"

        with ThreadPoolExecutor(len(bodies)) as pool:
            results = pool.map(send, enumerate(bodies))
            time.sleep(0.5)  # requests in flight, queued and abandoned
            t = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(30)
            seconds = time.monotonic() - t
            results = list(results)
    finally:
        server.stop()
    log = server.log_text()
    assert code == 0 and seconds < 5 + 5, (code, seconds, log[-2000:])
    assert "terminate called" not in log and "Traceback" not in log
    assert "scheduler stopped after" in log
    assert set(results) <= {200, 503, "refused", "client gave up"}, results
    assert results.count(200) >= 1, results


# ------------------------------------------------------------------------- in process, fake engines

def test_queue_full_is_503_with_retry_after_not_a_hang():
    # One at a time: sent together, the second could reach the 1-slot queue before the worker took the first, and
    # be refused itself.
    with held_worker(clients=2, max_queue=1) as w:
        queued = w.pool.submit(httpx.post, w.srv.url + "/draft", json={"token_ids": [2]}, timeout=90)
        wait_until(lambda: metric_samples(w.srv.url)[("specdraft_queue_depth", ())] >= 1,
                   what="the second request waiting in the queue")
        t = time.perf_counter()
        r = httpx.post(w.srv.url + "/draft", json={"token_ids": [3]}, timeout=30)
        assert time.perf_counter() - t < 5  # refused at once, not after the 30 s request timeout
        assert r.status_code == 503 and r.json()["error"] == "queue_full" and r.headers["retry-after"] == "1"
        refused = ("specdraft_draft_outcomes_total", (("outcome", "refused_queue_full"),))
        assert metric_samples(w.srv.url)[refused] == 1
        w.gate.set()
        assert [h.result().status_code for h in (w.held, queued)] == [200, 200]


def test_heap_is_trimmed_once_loaded_and_then_after_model_work(monkeypatch):
    import specdraft.server.engine as engine_mod
    trims = []
    monkeypatch.setattr(engine_mod, "heap_trimmer", lambda: lambda: trims.append(1))
    engine = FakeEngine(fail_when=lambda c: c == [13])
    for trim_heap in (True, False):
        trims.clear()
        cfg = fake_config(max_wait_ms=0, trim_heap=trim_heap)
        with ThreadServer(create_app(cfg, engine), cfg) as srv:
            assert len(trims) == (1 if trim_heap else 0)  # what loading freed, before any request
            time.sleep(1.1)  # at most one trim a second after iterations
            assert httpx.post(srv.url + "/draft", json={"token_ids": [1, 2], "num_tokens": 2}).status_code == 200
            assert httpx.post(srv.url + "/draft", json={"token_ids": [13]}).status_code == 500  # also a failed one
        assert len(trims) == (2 if trim_heap else 0)


def test_every_runs_at_most_once_per_period_and_glibc_trim_runs():
    calls = []
    run = every(0.2, lambda: calls.append(time.monotonic()))
    for _ in range(5):
        run()
    time.sleep(0.25)
    run()
    assert len(calls) == 2
    trim = heap_trimmer()
    if sys.platform.startswith("linux"):  # this project's machines: glibc
        assert trim is not None and trim() in (0, 1)
    else:
        assert trim is None


def test_failed_batch_is_an_error_for_its_requests_and_the_server_goes_on():
    engine = FakeEngine(fail_when=lambda c: c == [13])
    cfg = fake_config(max_wait_ms=1)
    with ThreadServer(create_app(cfg, engine), cfg) as srv:
        r = httpx.post(srv.url + "/draft", json={"token_ids": [13]})
        assert r.status_code == 500 and r.json()["error"] == "draft_failed"
        r = httpx.post(srv.url + "/draft", json={"token_ids": [1, 2], "num_tokens": 3})
        assert r.status_code == 200 and r.json() == {"draft_ids": [3, 4, 5], "model": "fake"}
        samples = metric_samples(srv.url)
        assert samples[("specdraft_iteration_failures_total", ())] == 1
        assert samples[("specdraft_draft_outcomes_total", (("outcome", "failed"),))] == 1


def test_health_is_503_until_the_weights_are_loaded(monkeypatch, packed_dir):
    import specdraft.server.app as app_mod
    release = threading.Event()
    real = app_mod.load_serving_engine

    def slow_load(*a, **kw):
        release.wait(20)
        return real(*a, **kw)

    monkeypatch.setattr(app_mod, "load_serving_engine", slow_load)
    cfg = ServeConfig(model_dir=str(packed_dir), threads=1)
    with ThreadServer(create_app(cfg), cfg) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "model": None, "compute": None,
                                                     "detail": None, "compute_choice": None, "prefix_cache": None}
        r = httpx.post(srv.url + "/draft", json={"token_ids": [1]})
        assert r.status_code == 503 and r.json()["error"] == "not_ready" and "retry-after" in r.headers
        # the request schema is known before the weights: bad input is still a 4xx
        assert httpx.post(srv.url + "/draft", json={"token_ids": [1.5]}).status_code == 422
        release.set()
        health = wait_healthy(srv.url, 60)
        assert health["compute"] == health["compute_choice"]["compute"] and health["compute_choice"]["reason"]
        assert httpx.post(srv.url + "/draft", json={"token_ids": [1], "num_tokens": 2}).status_code == 200


def test_health_reports_what_the_engine_declares():
    engine = FakeEngine()
    assert isinstance(engine, DraftEngine)  # it declares what /health reads: name, compute, compute_choice
    cfg = fake_config()
    with ThreadServer(create_app(cfg, engine), cfg) as srv:
        r = httpx.get(srv.url + "/health")
    body = r.json()
    budget = body["prefix_cache"].pop("budget_bytes")  # a share of the memory available at start
    assert r.status_code == 200 and body == {"status": "ok", "model": "fake", "compute": "float32", "detail": None,
                                             "compute_choice": engine.compute_choice,
                                             "prefix_cache": {"block_tokens": 32, "used_bytes": 0, "blocks": 0}}
    assert 0 < budget <= 1024 << 20


def test_failed_load_reports_failed_health(tmp_path, packed_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in packed_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = bytearray((bad / "draft.qd4").read_bytes())
    data[-1] ^= 0xFF  # corrupt the payload: the strict loader's checksum refuses it
    (bad / "draft.qd4").write_bytes(bytes(data))
    failures = []
    cfg = ServeConfig(model_dir=str(bad))
    with ThreadServer(create_app(cfg, on_load_failed=failures.append), cfg) as srv:
        wait_until(lambda: failures, what="the load failure")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "checksum" in r.json()["detail"]
        assert r.json()["model"] is None and r.json()["compute_choice"] is None  # no engine to describe


def test_graceful_shutdown_answers_requests_in_flight():
    gate = threading.Event()
    engine = FakeEngine(gate=gate, delay=0.1)
    cfg = fake_config(max_batch_size=2, max_wait_ms=0)
    srv = ThreadServer(create_app(cfg, engine), cfg).__enter__()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [i], "num_tokens": 1}, timeout=30)
                   for i in range(4)]
        # In flight = accepted by the server: one or two held in the model (the gate), the rest queued.
        wait_until(lambda: engine.calls and metric_samples(srv.url)[("specdraft_queue_depth", ())] >= 2,
                   what="one request in the model and two queued")
        stopper = threading.Thread(target=srv.__exit__, args=(None, None, None))
        stopper.start()  # SIGTERM's path: stop accepting, finish in-flight, drain
        time.sleep(0.2)
        gate.set()
        stopper.join(60)
        assert [f.result().status_code for f in futures] == [200] * 4
    assert not srv.thread.is_alive()


def test_requests_that_outlast_the_shutdown_timeout_are_refused_with_503_not_cancelled():
    """With --request-timeout-s longer than --shutdown-timeout-s (the defaults: 30 s and 10 s), a request still
    being computed when the shutdown timeout runs out is refused (503 shutting_down): the scheduler starts closing
    when the shutdown begins, and uvicorn, which cancels the handlers still running after its own graceful timeout
    (a 500), waits longer than that."""
    engine = FakeEngine(delay=0.25)  # 16 decode steps: about 4 s per request, the shutdown timeout is 1 s
    cfg = fake_config(max_batch_size=2, max_wait_ms=0, request_timeout_s=30, shutdown_timeout_s=1)
    srv = ThreadServer(create_app(cfg, engine), cfg).__enter__()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [i + 1, i + 2]}, timeout=30)
                   for i in range(4)]
        wait_until(lambda: len(engine.calls) >= 2, what="two engine calls")
        started = time.monotonic()
        srv.__exit__(None, None, None)
        seconds = time.monotonic() - started
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [503] * 4, [r.text for r in responses]
    assert {r.json()["error"] for r in responses} == {"shutting_down"}
    assert seconds < cfg.shutdown_timeout_s + SHUTDOWN_MARGIN_S, seconds
    assert not srv.thread.is_alive()


def test_a_client_that_goes_away_cancels_its_request_before_it_is_computed():
    with held_worker() as w:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(w.srv.url + "/draft", json={"token_ids": [2, 2, 2], "num_tokens": 1}, timeout=0.3)
        cancelled = ("specdraft_draft_outcomes_total", (("outcome", "cancelled"),))
        wait_until(lambda: metric_samples(w.srv.url).get(cancelled, 0) >= 1, what="the handler seeing the disconnect")
        w.gate.set()
        assert w.held.result().status_code == 200
        samples = metric_samples(w.srv.url)
        assert samples[("specdraft_dropped_total", (("outcome", "cancelled"), ("where", "queued")))] == 1
    assert all(lengths != [3] for _, lengths in w.engine.calls)  # its 3-token context never reached the model


def test_a_deadline_passed_in_the_queue_is_a_503_without_compute():
    with held_worker(request_timeout_s=0.5) as w:
        t = time.perf_counter()
        r = httpx.post(w.srv.url + "/draft", json={"token_ids": [2, 2, 2], "num_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"] == "timeout" and time.perf_counter() - t < 5
        w.gate.set()
        assert w.held.result().status_code in (200, 503)  # the held one's own 0.5 s may have passed too
        samples = metric_samples(w.srv.url)
        assert samples[("specdraft_draft_outcomes_total", (("outcome", "timed_out"),))] >= 1
    assert all(lengths != [3] for _, lengths in w.engine.calls)


def test_overload_is_refused_at_once_with_retry_after():
    engine = FakeEngine(delay=0.1)
    cfg = fake_config(max_wait_ms=0, request_timeout_s=1.0)
    with ThreadServer(create_app(cfg, engine), cfg) as srv:
        # 16 tokens at >= 0.1 s an iteration cannot fit in 1 s: the first, with no costs measured yet, is taken
        # and times out; the next is refused before any work
        assert httpx.post(srv.url + "/draft", json={"token_ids": [1]}, timeout=30).status_code == 503
        t = time.perf_counter()
        r = httpx.post(srv.url + "/draft", json={"token_ids": [2]}, timeout=30)
        assert time.perf_counter() - t < 0.5
        assert r.status_code == 503 and r.json()["error"] == "overloaded" and int(r.headers["retry-after"]) >= 1
        assert httpx.post(srv.url + "/draft", json={"token_ids": [3], "num_tokens": 2}, timeout=30).status_code == 200
        samples = metric_samples(srv.url)
        assert samples[("specdraft_draft_outcomes_total", (("outcome", "refused_overload"),))] == 1
        assert samples[("specdraft_request_seconds_count", (("route", "/draft"),))] == 3
        assert samples[("process_resident_memory_bytes", ())] > 0


def test_config_limits_are_checked():
    with pytest.raises(ValueError, match="exceeds"):
        create_app(fake_config(max_context=300), FakeEngine())  # 272 positions - 16
    app = create_app(fake_config(max_context=100, num_draft=8), FakeEngine())
    assert app.state.max_context == 100
    with pytest.raises(ValueError):
        ServeConfig(model_dir="x", compute="int8")


def test_serve_refuses_a_dir_without_a_model(tmp_path, caplog):
    from specdraft.cli import main
    assert main(["serve", "--model-dir", str(tmp_path), "--port", "0"]) == 2
    assert "not a model dir" in caplog.text


def test_the_listening_socket_turns_nagle_off_for_its_connections():
    # asyncio sets TCP_NODELAY only on connections of a socket whose proto is TCP; with Nagle on, every answer's
    # body waited for the client's delayed ACK of its headers (about 40 ms a call on Linux)
    import socket

    from specdraft.server.app import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        sock.listen()
        assert sock.proto == socket.IPPROTO_TCP
        client = socket.create_connection(sock.getsockname())
        conn, _ = sock.accept()
        with client, conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()
