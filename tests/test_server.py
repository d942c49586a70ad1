"""The draft server: batcher units, the int4 linear layer, and the HTTP API end to end over real sockets.

A `specdraft serve` subprocess on a packed tiny model (port 0, found from its log, ready when /health
says 200) serves the end-to-end tests; in-process servers with fake engines cover overload, failing
batches, loading and shutdown without a model.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdraft import qd4
from specdraft.server import Batcher, BatchFailedError, QueueFullError, ServeConfig, create_app
from specdraft.server.app import bind_socket, make_server, trimmed, url_of
from specdraft.server.batcher import BatcherClosedError
from specdraft.server.engine import Int4Linear, ModelLoadError, apply_compute, heap_trimmer, load_engine

START_TIMEOUT = 120
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- helpers

class FakeEngine:
    """Duck-typed engine: draft row i = [sum(context) + k for k in range(n)] (mod vocab)."""

    name, compute, vocab_size, max_positions = "fake", "float32", 1000, 272

    def __init__(self, delay: float = 0.0, fail_when=None, gate: threading.Event | None = None):
        self.delay, self.fail_when, self.gate, self.calls = delay, fail_when, gate, []

    def draft(self, contexts, n):
        self.calls.append(len(contexts))
        if self.gate is not None:
            self.gate.wait(90)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_when is not None and any(self.fail_when(c) for c in contexts):
            raise RuntimeError("boom")
        return [[(sum(c) + k) % self.vocab_size for k in range(n)] for c in contexts]

    @staticmethod
    def expected(context, n):
        return [(sum(context) + k) % FakeEngine.vocab_size for k in range(n)]


class ThreadServer:
    """uvicorn in a thread on a pre-bound port-0 socket (the app's lifespan runs as in `serve`)."""

    def __init__(self, app, config: ServeConfig):
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.server = make_server(config, app, self.sock, lambda: None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "in-process server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def fake_config(**kw) -> ServeConfig:
    return ServeConfig(model_dir="unused", **kw)


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


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def assert_error(r: httpx.Response, status: int, field: str, reason: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "message", "details"}
    fields = [d["field"] for d in body["details"]]
    assert field in fields, (field, body)
    if reason:
        assert any(reason.lower() in d["reason"].lower() for d in body["details"] if d["field"] == field), body
    return body


# ----------------------------------------------------------------------------------------- batcher

def test_batcher_batches_and_answers_each_request_with_its_row():
    engine = FakeEngine(delay=0.05)
    b = Batcher(engine.draft, max_batch_size=8, max_wait_s=0.05).start()
    try:
        contexts = [[i, i + 1] for i in range(12)]
        futures = [b.submit(c, 1 + i % 5) for i, c in enumerate(contexts)]
        rows = [f.result(10) for f in futures]
    finally:
        b.close()
    assert rows == [FakeEngine.expected(c, 1 + i % 5) for i, c in enumerate(contexts)]
    assert max(engine.calls) > 1 and sum(engine.calls) == 12 and max(engine.calls) <= 8


def test_batcher_failed_batch_fails_its_requests_and_goes_on():
    engine = FakeEngine(fail_when=lambda c: c == [666])
    b = Batcher(engine.draft, max_batch_size=4, max_wait_s=0.05).start()
    try:
        bad = [b.submit([666], 3), b.submit([1], 3)]  # same batch as the poison row
        for f in bad:
            with pytest.raises(BatchFailedError, match="boom"):
                f.result(10)
        assert b.submit([2, 3], 4).result(10) == FakeEngine.expected([2, 3], 4)
    finally:
        b.close()


def test_batcher_asserts_one_output_per_input():
    b = Batcher(lambda contexts, n: [[0] * n], max_batch_size=4, max_wait_s=0.05).start()
    try:
        futures = [b.submit([1], 2), b.submit([2], 2)]
        for f in futures:
            with pytest.raises(BatchFailedError, match="1 rows for 2 requests"):
                f.result(10)
    finally:
        b.close()


def test_batcher_full_queue_is_refused_at_once_and_close_drains():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    b = Batcher(engine.draft, max_batch_size=1, max_wait_s=0, max_queue=2).start()
    first = b.submit([1], 1)
    deadline = time.time() + 30
    while not engine.calls:  # the worker holds the first request inside the (blocked) step
        assert time.time() < deadline
        time.sleep(0.01)
    queued = [b.submit([2], 1), b.submit([3], 1)]
    t = time.perf_counter()
    with pytest.raises(QueueFullError):
        b.submit([4], 1)
    assert time.perf_counter() - t < 0.5
    gate.set()
    b.close(drain=True, timeout=10)
    assert [f.result(0) for f in [first, *queued]] == [[1], [2], [3]]
    with pytest.raises(BatcherClosedError):
        b.submit([5], 1)


def test_batcher_splits_by_token_budget_in_length_order():
    engine = FakeEngine(delay=0.05)
    b = Batcher(engine.draft, max_batch_size=8, max_wait_s=0.1, max_batch_tokens=40).start()
    try:
        futures = [b.submit([1] * length, 4) for length in (16, 1, 16, 2)]
        assert [len(f.result(10)) for f in futures] == [4, 4, 4, 4]
    finally:
        b.close()
    assert sum(engine.calls) == 4 and max(engine.calls) <= 2  # (16 + 4) x 2 rows = 40 tokens per step


# --------------------------------------------------------------------------------------- int4 layer

@pytest.mark.parametrize("shape,group", [((48, 64), 32), ((320, 128), 64), ((64, 256), 128)])
def test_int4_linear_matches_dequantised_float_matmul(shape, group):
    torch.manual_seed(0)
    q = qd4.quantize(torch.randn(*shape) * 0.1, group)
    layer = Int4Linear(q)
    x = torch.randn(5, shape[1])
    ref = x.to(torch.bfloat16).float() @ qd4.dequantize(q).T  # the kernel sees bf16 activations
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, shape[0])
    # bf16 output rounding: relative 2^-8 of the largest output
    assert (got - ref).abs().max() <= 2 ** -7 * ref.abs().max()
    # A wrong zero-point convention (zero = min instead of min + 8 * scale) is off by 8 steps per weight.
    wrong = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), layer.packed, group,
        torch.stack([q.scales.float(), q.mins.float()], -1).transpose(0, 1).contiguous().bfloat16()).float()
    assert (wrong - ref).abs().max() > 10 * (got - ref).abs().max()


def test_int4_head_rescoring_gives_the_float32_argmax():
    torch.manual_seed(2)
    q = qd4.quantize(torch.randn(2048, 64), 64)
    x = torch.randn(1000, 64) * 3
    ref = x @ qd4.dequantize(q).T  # float32 logits of the same 4-bit weights
    got = Int4Linear(q, rescore_top_k=8)(x)
    plain = Int4Linear(q)(x)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (plain.argmax(-1) != ref.argmax(-1)).sum() > 0  # bf16 rounding alone flips some near-ties
    win = ref.argmax(-1, keepdim=True)
    assert torch.allclose(got.gather(-1, win), ref.gather(-1, win), rtol=1e-5, atol=1e-4)


def test_int4_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    layer = Int4Linear(qd4.quantize(torch.randn(64, 128), 64))
    x = torch.randn(7, 128)
    assert torch.equal(layer(x)[2:3], layer(x[2:3]))


def test_compute_formats_on_a_packed_model(packed_dir):
    f32 = load_engine(packed_dir, None, "float32")
    int4 = load_engine(packed_dir, None, "int4")
    assert int4.load_info["from_codes"] == len([m for m in int4.model.modules() if isinstance(m, Int4Linear)]) > 0
    assert int4.bytes_per_token() < f32.bytes_per_token() / 5
    ids = torch.tensor([[5, 17, 33, 2, 99, 41]])
    with torch.inference_mode():
        a, b = f32.model(ids).logits, int4.model(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    rng = random.Random(0)
    contexts = [[rng.randrange(3, f32.vocab_size) for _ in range(n)] for n in (3, 9, 20)]
    same = sum(x == y for x, y in zip(f32.draft(contexts, 8), int4.draft(contexts, 8)))
    assert same >= 2


def test_int4_prefill_runs_dense_bf16_and_decode_runs_the_codes(packed_dir, int4_kernel_calls):
    from specdraft.decode import decode_step, left_pad, prefill
    engine = load_engine(packed_dir, None, "int4")
    layers = [m for m in engine.model.modules() if isinstance(m, Int4Linear)]
    head = engine.model.get_output_embeddings()
    assert head.phase is None and head.rescore_top_k > 0  # one row per sequence in both passes
    body = [m for m in layers if m is not head]
    assert body and all(m.phase is body[0].phase and m.dense.dtype == torch.bfloat16 for m in body)
    ids, mask = left_pad([[5, 6, 7, 8], [9]], pad_id=0)
    with int4_kernel_calls() as calls:
        token, state = prefill(engine.model, ids, mask)
    assert body[0].phase.prefill and [a[0].shape[0] for a in calls] == [2]  # prefill: only the head (2 rows)
    with int4_kernel_calls() as calls:
        decode_step(engine.model, token, state)
    assert not body[0].phase.prefill and [a[0].shape[0] for a in calls] == [2] * len(layers)
    # The same through draft_batch (whatever engine decode.py picks), with a one-token context:
    forwards = []
    engine.model.register_forward_pre_hook(
        lambda mod, args, kw: forwards.append(body[0].phase.prefill), with_kwargs=True)  # runs after track_phase
    from specdraft.decode import draft_batch
    from specdraft.lean import lean_forward
    assert lean_forward(engine.model) is not None  # built before counting (its fusion probe calls the kernel)
    for lean in (False, True):
        forwards.clear()
        with int4_kernel_calls() as calls:
            draft_batch(engine.model, [[5, 6, 7, 8], [9]], 3, lean=lean)
        prefills, steps = forwards.count(True), forwards.count(False)
        # the 2 decode steps run every linear on its codes, through model(...) or the lean forward
        assert steps == (0 if lean else 2)
        assert prefills >= 1 and len(calls) == prefills + 2 * len(layers)
    off = load_engine(packed_dir, None, "int4", dense_prefill=False)
    assert all(m.phase is None and not hasattr(m, "dense") for m in off.model.modules() if isinstance(m, Int4Linear))


def test_prefill_row_buckets_are_few_and_cap_padding_at_25_percent():
    from specdraft.server.engine import bucket_rows
    sizes = {bucket_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 50
    assert all(m <= bucket_rows(m) <= 1.25 * m for m in range(1, 8193))


def test_prefill_is_told_from_a_decode_step_by_positions():
    from specdraft.server.engine import INT4_EXTEND_MAX_TOKENS, is_prefill
    assert is_prefill({"position_ids": torch.tensor([[0, 1, 2], [0, 0, 1]])})
    assert is_prefill({"position_ids": torch.tensor([[0]])})  # a one-token context, alone
    assert not is_prefill({"position_ids": torch.tensor([[1], [7]])})
    assert is_prefill({"input_ids": torch.tensor([[4, 5]])}) and not is_prefill({"input_ids": torch.tensor([[4]])})
    # A short extension of a kept cache (speculative catch-up) stays on the codes; a long one is a prefill.
    assert not is_prefill({"position_ids": torch.arange(40, 43)[None]})
    assert not is_prefill({"position_ids": torch.arange(40, 40 + INT4_EXTEND_MAX_TOKENS)[None]})
    assert is_prefill({"position_ids": torch.arange(40, 41 + INT4_EXTEND_MAX_TOKENS)[None]})


def test_from_pretrained_only_without_a_weight_file(tiny_llama_dir, packed_dir, tmp_path):
    engine = load_engine(tiny_llama_dir, None, "int4")  # plain HF dir: from_pretrained, quantised at load
    assert engine.weights is None and engine.load_info["quantised_at_load"] > 0
    with pytest.raises(ModelLoadError, match="weight file not found"):
        load_engine(packed_dir, tmp_path / "nope.qd4", "int4")
    other = tmp_path / "other.qd4"
    other.write_bytes((packed_dir / "draft.qd4").read_bytes())
    with pytest.raises(ModelLoadError, match="not the weight file"):
        load_engine(packed_dir, other, "int4")


def test_apply_compute_rejects_unknown_format(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    with pytest.raises(ValueError, match="compute"):
        apply_compute(model, "int8")


# ----------------------------------------------------------------------------- end to end (subprocess)

@pytest.fixture(scope="module")
def packed_dir(tiny_qwen3_dir, tmp_path_factory):
    from specdraft.cli import main
    out = tmp_path_factory.mktemp("packed") / "tiny-qwen3-packed"
    assert main(["pack", "--checkpoint", str(tiny_qwen3_dir), "--out", str(out)]) == 0
    return out


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
    assert any("batcher drained and stopped" in x for x in lines), lines[-10:]


def test_serve_logs_the_loader_line_and_health(live, packed_dir):
    url, lines = live
    assert any("specdraft.server: loaded qd4 missing=0 unexpected=0" in x and str(packed_dir / "draft.qd4") in x
               for x in lines), lines
    health = httpx.get(url + "/health").json()
    assert health == {"status": "ok", "model": packed_dir.name, "compute": "int4", "detail": None}


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
    assert [s["draft_ids"] for s in single[:4]] == [
        engine.draft([r["token_ids"]], r.get("num_tokens", 16))[0] for r in requests[:4]]
    after = metric_samples(url)
    key = ("specdraft_batch_size_bucket", (("le", "1.0"),))
    batches = after[("specdraft_batch_size_count", ())] - before[("specdraft_batch_size_count", ())]
    singles = after[key] - before[key]
    assert batches - singles > 0, "no batch of more than one request"
    assert after[("specdraft_batch_size_sum", ())] - before[("specdraft_batch_size_sum", ())] == 48
    assert after[("specdraft_draft_tokens_total", ())] > before[("specdraft_draft_tokens_total", ())]


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
    class Fragile(FakeEngine):
        def draft(self, contexts, n):
            if any(len(c) > 100 for c in contexts):
                raise RuntimeError("fragile")
            return super().draft(contexts, n)

    cfg = fake_config()
    with ThreadServer(create_app(cfg, Fragile()), cfg) as srv:
        failures, _ = run_schemathesis(srv.url, max_examples=10)
    assert any("not_a_server_error" in f for f in failures), failures


# ------------------------------------------------------------------------- in process, fake engines

def test_queue_full_is_503_with_retry_after_not_a_hang():
    gate = threading.Event()
    engine = FakeEngine(gate=gate)
    cfg = fake_config(max_batch_size=1, max_queue=1, max_wait_ms=0)
    with ThreadServer(create_app(cfg, engine), cfg) as srv, ThreadPoolExecutor(2) as pool:
        try:
            # One at a time: sent together, the second could reach the 1-slot queue before the worker took
            # the first, and be refused itself.
            deadline = time.time() + 60  # generous: CI machines are shared and slow
            held = [pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [1]}, timeout=90)]
            while not engine.calls:  # the first is in the (gated) step
                assert time.time() < deadline
                time.sleep(0.02)
            held.append(pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [2]}, timeout=90))
            while metric_samples(srv.url)[("specdraft_queue_depth", ())] < 1:  # the second waits in the queue
                assert time.time() < deadline
                time.sleep(0.02)
            t = time.perf_counter()
            r = httpx.post(srv.url + "/draft", json={"token_ids": [3]}, timeout=30)
            assert time.perf_counter() - t < 5  # refused at once, not after the 30 s request timeout
            assert r.status_code == 503 and r.json()["error"] == "queue_full" and r.headers["retry-after"] == "1"
        finally:
            gate.set()  # also when an assertion failed, so the held requests end
        assert [h.result().status_code for h in held] == [200, 200]


def test_heap_is_trimmed_once_loaded_and_after_every_step_also_a_failed_one(monkeypatch):
    import specdraft.server.engine as engine_mod
    trims = []
    monkeypatch.setattr(engine_mod, "heap_trimmer", lambda: lambda: trims.append(1))
    engine = FakeEngine(fail_when=lambda c: c == [13])
    for trim_heap, expected in ((True, 3), (False, 0)):
        trims.clear()
        cfg = fake_config(max_wait_ms=0, trim_heap=trim_heap)
        with ThreadServer(create_app(cfg, engine), cfg) as srv:
            assert len(trims) == (1 if trim_heap else 0)  # what loading freed, before any request
            assert httpx.post(srv.url + "/draft", json={"token_ids": [1, 2], "num_tokens": 2}).status_code == 200
            assert httpx.post(srv.url + "/draft", json={"token_ids": [13]}).status_code == 500
        assert len(trims) == expected


def test_trimmed_step_returns_the_steps_rows_and_glibc_trim_runs():
    calls = []
    step = trimmed(lambda contexts, n: [[n] * n for _ in contexts], lambda: calls.append("trim"))
    assert step([[1], [2]], 3) == [[3, 3, 3], [3, 3, 3]] and calls == ["trim"]
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
        assert metric_samples(srv.url)[("specdraft_batch_failures_total", ())] == 1


def test_health_is_503_until_the_weights_are_loaded(monkeypatch, packed_dir):
    import specdraft.server.engine as engine_mod
    release = threading.Event()
    real = engine_mod.load_engine

    def slow_load(*a, **kw):
        release.wait(20)
        return real(*a, **kw)

    monkeypatch.setattr(engine_mod, "load_engine", slow_load)
    cfg = ServeConfig(model_dir=str(packed_dir), threads=1)
    with ThreadServer(create_app(cfg), cfg) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(srv.url + "/draft", json={"token_ids": [1]})
        assert r.status_code == 503 and r.json()["error"] == "not_ready" and "retry-after" in r.headers
        # the request schema is known before the weights: bad input is still a 4xx
        assert httpx.post(srv.url + "/draft", json={"token_ids": [1.5]}).status_code == 422
        release.set()
        assert wait_healthy(srv.url, 60)["compute"] == "int4"
        assert httpx.post(srv.url + "/draft", json={"token_ids": [1], "num_tokens": 2}).status_code == 200


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
        deadline = time.time() + 60
        while not failures:
            assert time.time() < deadline
            time.sleep(0.05)
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed" and "checksum" in r.json()["detail"]


def test_graceful_shutdown_answers_requests_in_flight():
    engine = FakeEngine(delay=1.0)
    cfg = fake_config(max_batch_size=2, max_wait_ms=0)
    srv = ThreadServer(create_app(cfg, engine), cfg).__enter__()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, srv.url + "/draft", json={"token_ids": [i]}, timeout=30)
                   for i in range(4)]
        # In flight = accepted by the server: two in the model step, two waiting in the queue.
        deadline = time.time() + 60
        while not (engine.calls and metric_samples(srv.url)[("specdraft_queue_depth", ())] >= 2):
            assert time.time() < deadline
            time.sleep(0.01)
        srv.__exit__(None, None, None)  # SIGTERM's path: stop accepting, finish in-flight, drain
        assert [f.result().status_code for f in futures] == [200] * 4
    assert not srv.thread.is_alive()


def test_config_limits_are_checked():
    with pytest.raises(ValueError, match="exceeds"):
        create_app(fake_config(max_context=300), FakeEngine())  # 272 positions - 16
    app = create_app(fake_config(max_context=100, num_draft=8), FakeEngine())
    assert app.state.max_context == 100
    with pytest.raises(ValueError):
        ServeConfig(model_dir="x", compute="int8")


def test_int4_head_of_an_embedding_stored_raw_searches_codes_and_scores_its_rows(tiny_qwen3_dir, tmp_path):
    """An f16 embedding kept on purpose: the tied head searches on G=32 codes made at load and rescores its top
    candidates from the f16 rows, so its argmax is the float model's (here: 1,000 random hidden states)."""
    from specdraft.cli import main
    out = tmp_path / "packed-f16-embedding"
    assert main(["pack", "--checkpoint", str(tiny_qwen3_dir), "--out", str(out), "--embedding-encoding", "f16"]) == 0
    engine = load_engine(out, None, "int4")
    head = engine.model.lm_head
    assert isinstance(head, Int4Linear) and head.group_size == 32 and head.exact_rows.dtype == torch.float16
    assert engine.load_info["bf16_fallback"] == [] and engine.load_info["head_search_codes"].startswith("q4g G32")
    assert engine.load_info["from_codes"] == 14 and engine.load_info["quantised_at_load"] == 0
    emb = engine.model.get_input_embeddings().weight  # float32 values of the stored f16 rows
    torch.manual_seed(0)
    x = torch.randn(1000, emb.shape[1]) * 2
    ref = x @ emb.T
    got = head(x)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    win = ref.argmax(-1, keepdim=True)
    assert torch.allclose(got.gather(-1, win), ref.gather(-1, win), rtol=1e-5, atol=1e-4)
    searched = Int4Linear(qd4.quantize(emb, 32))(x)  # the codes alone get some argmaxes wrong
    assert (searched.argmax(-1) != ref.argmax(-1)).sum() > 0


def test_bf16_linear_takes_a_last_position_slice_as_one_matmul():
    """x[:, -1:] of a longer hidden state (a catch-up's last position) has an odd stride on its size-1 dim;
    linear on it as 3-D bf16 ran a batched matmul that copied the whole weight transposed per call."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from specdraft.server.engine import BF16Linear

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    lin = BF16Linear(torch.randn(96, 32), torch.randn(96))
    x = torch.randn(1, 3, 32)[:, -1:]
    assert x.stride() == (96, 32, 1)
    with Ops() as ops:
        y = lin(x)
    assert "aten.bmm" not in ops.seen and ("aten.mm" in ops.seen or "aten.addmm" in ops.seen), ops.seen
    expected = torch.nn.functional.linear(x.contiguous().bfloat16(), lin.weight).float() + lin.bias
    assert y.shape == (1, 1, 96) and torch.equal(y, expected)


def test_int4_runs_each_tensor_at_its_own_group_size(tmp_path):
    """A pack with layers kept on their finer G=32 grid: every linear still runs on its own codes, at its G."""
    from transformers import AutoModelForCausalLM
    from specdraft.pack import PackConfig, run_pack
    from specdraft.tiny import build_tiny_model
    src = build_tiny_model(tmp_path / "src", "qwen3")
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for m in model.model.layers[0].modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(qd4.dequantize(qd4.quantize(m.weight, 32)))
    model.save_pretrained(src)
    out = run_pack(PackConfig(checkpoint=str(src), out=str(tmp_path / "packed"))).out
    engine = load_engine(out, None, "int4")
    layers = {n: m for n, m in engine.model.named_modules() if isinstance(m, Int4Linear)}
    assert engine.load_info["from_codes"] == len(layers) == 15 and not engine.load_info["bf16_fallback"]
    assert {n for n, m in layers.items() if m.group_size == 32} == {
        n for n in layers if n.startswith("model.layers.0.")} and len(layers) - 7 == sum(
        m.group_size == 64 for m in layers.values())
    f32 = load_engine(out, None, "float32")
    ids = torch.tensor([[5, 17, 33, 2, 99, 41]])
    with torch.inference_mode():
        a, b = f32.model(ids).logits, engine.model(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_serve_refuses_a_dir_without_a_model(tmp_path, caplog):
    from specdraft.cli import main
    assert main(["serve", "--model-dir", str(tmp_path), "--port", "0"]) == 2
    assert "not a model dir" in caplog.text
