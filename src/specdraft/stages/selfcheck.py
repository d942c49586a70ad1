"""`specdraft selfcheck --model-dir DIR`: start the draft server on a packed model dir and check it end to end.

Checks, each printed as PASS/FAIL (exit code 1 on any FAIL), all written to ``selfcheck.json``:

* the weight file's byte count and sha256 against ``architecture.json``;
* the server (``server.process.ServerProcess``: `specdraft serve --model-dir DIR --port 0`) binds a free
  port, answers ``/health`` with 200 and logs ``missing=0 unexpected=0`` for the strict QD04 load;
* valid ``POST /draft`` requests get ``num_tokens`` ints in the vocabulary; the same request twice gets
  the same draft; concurrent requests get the answers they get alone;
* every class of invalid request gets a 4xx whose body names the field at fault;
* no request at all gets a 5xx; ``/metrics`` answers; the server exits cleanly on SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
from pydantic import Field
from transformers import AutoTokenizer

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, read_json, sha256_file
from specdraft.core.provenance import run_metadata
from specdraft.server.process import ServerProcess

log = logging.getLogger(__name__)


LOAD_CLEAN = "missing=0 unexpected=0"


class SelfcheckConfig(StageConfig):
    model_dir: Path = Field(description="packed model dir (config.json, draft.qd4, architecture.json, tokenizer)")
    out: Path = Field(Path("."), description="directory for selfcheck.json and selfcheck_server.log")
    num_tokens: int = Field(16, ge=1, le=64, description="num_tokens of the valid requests")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for /health to say ok")
    request_timeout_s: float = Field(120.0, gt=0, description="timeout of one HTTP request")
    concurrency: int = Field(8, ge=2, le=64, description="requests sent at once in the concurrency check")
    threads: int | None = Field(None, ge=1, description="--threads for the server (None: its default)")
    compute: str | None = Field(None, description="--compute for the server (None: its default)")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


class Checks:
    def __init__(self, echo: bool = True):
        self.items: list[Check] = []
        self.echo = echo

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.items.append(Check(name, bool(ok), detail))
        if self.echo:
            print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail else ""), flush=True)
        return bool(ok)

    def run(self, name: str, fn: Callable[[], tuple[bool, str]]) -> bool:
        try:
            ok, detail = fn()
        except Exception as e:  # a check that crashes is a failed check, not a crashed selfcheck
            ok, detail = False, f"{type(e).__name__}: {e}"
        return self.add(name, ok, detail)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.items)


# ----------------------------------------------------------------------------------------- weight file

def check_weight_file(model_dir: Path, checks: Checks) -> None:
    arch_path = model_dir / "architecture.json"
    try:
        arch = read_json(arch_path)
    except (OSError, ValueError) as e:
        checks.add("architecture.json readable", False, f"{arch_path}: {e}")
        return
    kinds = {"weight_file": str, "bytes": int, "sha256": str}
    bad = [f"{k} (missing)" if k not in arch else f"{k} (not {kind.__name__}: {arch[k]!r})"
           for k, kind in kinds.items() if not isinstance(arch.get(k), kind) or isinstance(arch.get(k), bool)]
    if not checks.add("architecture.json readable", not bad,
                      f"{arch_path}: bad keys {bad}" if bad else f"weight_file={arch['weight_file']}"):
        return
    weight = model_dir / str(arch["weight_file"])
    if not weight.is_file():
        checks.add("weight file bytes", False, f"{weight} is missing")
        checks.add("weight file sha256", False, f"{weight} is missing")
        return
    size = weight.stat().st_size
    checks.add("weight file bytes", size == arch["bytes"], f"{size:,} on disk, {arch['bytes']:,} recorded")
    digest = sha256_file(weight)
    checks.add("weight file sha256", digest == arch["sha256"],
               f"{digest[:16]}… on disk, {str(arch['sha256'])[:16]}… recorded")


# ------------------------------------------------------------------------------------------- requests

def valid_contexts(model_dir: Path, vocab: int) -> list[list[int]]:
    """A few contexts: tokenised text (when the tokenizer loads), one token, and a longer repeated span."""
    contexts: list[list[int]] = []
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        for text in ("The capital of France is", "def add(a, b):\n    return"):
            ids = [int(i) for i in tok(text)["input_ids"] if 0 <= int(i) < vocab]
            if ids:
                contexts.append(ids)
    except Exception as e:  # no usable tokenizer: the synthetic contexts below still exercise the server
        log.warning("tokenizer of %s not usable for the selfcheck (%s)", model_dir, e)
    contexts.append([min(5, vocab - 1)])
    contexts.append([(7 * i + 3) % vocab for i in range(40)])
    return contexts


def invalid_requests(vocab: int, num_tokens: int) -> list[tuple[str, dict[str, Any], str]]:
    """(name, httpx request kwargs, field the error must name)."""
    ok = [1, 2, 3]
    j = lambda body: {"json": body}  # noqa: E731
    return [
        ("token_ids missing", j({"num_tokens": num_tokens}), "token_ids"),
        ("token_ids not a list", j({"token_ids": "1 2 3"}), "token_ids"),
        ("token_ids empty", j({"token_ids": []}), "token_ids"),
        ("token id negative", j({"token_ids": [1, -4]}), "token_ids"),
        ("token id >= vocab", j({"token_ids": [1, vocab]}), "token_ids"),
        ("token id float", j({"token_ids": [1, 2.5]}), "token_ids"),
        ("token id string", j({"token_ids": [1, "2"]}), "token_ids"),
        ("token id boolean", j({"token_ids": [True]}), "token_ids"),
        ("token id null", j({"token_ids": [1, None]}), "token_ids"),
        ("token_ids too long", j({"token_ids": [1] * 200_000}), "token_ids"),
        ("num_tokens zero", j({"token_ids": ok, "num_tokens": 0}), "num_tokens"),
        ("num_tokens negative", j({"token_ids": ok, "num_tokens": -3}), "num_tokens"),
        ("num_tokens too large", j({"token_ids": ok, "num_tokens": 100_000}), "num_tokens"),
        ("num_tokens string", j({"token_ids": ok, "num_tokens": "16"}), "num_tokens"),
        ("num_tokens float", j({"token_ids": ok, "num_tokens": 4.5}), "num_tokens"),
        ("unknown field", j({"token_ids": ok, "temperature": 0.7}), "temperature"),
        ("body not an object", j([1, 2, 3]), "body"),
        ("malformed JSON", {"content": b'{"token_ids": [1, 2,', "headers": {"content-type": "application/json"}},
         "body"),
        ("wrong content type", {"content": b'{"token_ids": [1]}', "headers": {"content-type": "text/plain"}},
         "content-type"),
        ("body too large", {"content": b'{"token_ids": [' + b"1, " * 1_200_000 + b'1]}',
                            "headers": {"content-type": "application/json"}}, "body"),
    ]


def _draft_ok(response, vocab: int, num_tokens: int) -> tuple[bool, str, list[int] | None]:
    if response.status_code != 200:
        return False, f"HTTP {response.status_code}: {response.text[:200]}", None
    body = response.json()
    ids = body.get("draft_ids") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return False, f"draft_ids is not a list of ints: {str(body)[:200]}", None
    if len(ids) != num_tokens:
        return False, f"{len(ids)} ids, expected {num_tokens}", ids
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        return False, f"ids outside 0..{vocab - 1}: {bad[:5]}", ids
    if not isinstance(body.get("model"), str):
        return False, "no 'model' name in the answer", ids
    return True, f"{num_tokens} ids in vocab, model {body['model']!r}", ids


def check_server(config: SelfcheckConfig, model_dir: Path, vocab: int, checks: Checks,
                 statuses: list[tuple[str, int]]) -> None:
    extra: list[str] = []
    if config.threads:
        extra += ["--threads", str(config.threads)]
    if config.compute:
        extra += ["--compute", config.compute]
    server = ServerProcess(model_dir, Path(config.out) / "selfcheck_server.log", extra)
    try:
        ready, detail = server.wait_ready(config.startup_timeout_s)
        checks.add("server starts on a free port and /health is ok", ready, detail)
        if not ready:
            checks.add("load log shows missing=0 unexpected=0", LOAD_CLEAN in server.log_text(),
                       "found" if LOAD_CLEAN in server.log_text() else f"not in the log: {server.log_tail(4)}")
            return
        loaded = server.loaded()
        checks.add("load log shows missing=0 unexpected=0", loaded == (0, 0),
                   f"missing={loaded[0]} unexpected={loaded[1]}" if loaded
                   else "no 'loaded qd4 missing=' line in the log")
        n = config.num_tokens
        with httpx.Client(base_url=server.url, timeout=config.request_timeout_s) as client:
            def post(name: str, **kwargs):
                r = client.post("/draft", **kwargs)
                statuses.append((name, r.status_code))
                return r

            contexts = valid_contexts(model_dir, vocab)
            answers: list[list[int] | None] = []
            for i, ctx in enumerate(contexts):
                ok, detail, ids = _draft_ok(post(f"valid {i}", json={"token_ids": ctx, "num_tokens": n}), vocab, n)
                answers.append(ids if ok else None)
                checks.add(f"valid request {i} ({len(ctx)} context ids) -> {n} ids in vocab", ok, detail)

            def same_twice() -> tuple[bool, str]:
                ok, detail, ids = _draft_ok(post("repeat", json={"token_ids": contexts[0], "num_tokens": n}), vocab, n)
                return ok and ids == answers[0], detail if not ok else f"first {answers[0][:4]}…, again {ids[:4]}…"
            checks.run("same request twice -> same draft", same_twice)

            def concurrent() -> tuple[bool, str]:
                jobs = [contexts[i % len(contexts)] for i in range(config.concurrency)]
                with ThreadPoolExecutor(config.concurrency) as pool:
                    rs = list(pool.map(lambda c: post("concurrent", json={"token_ids": c, "num_tokens": n}), jobs))
                got = [_draft_ok(r, vocab, n) for r in rs]
                if not all(g[0] for g in got):
                    return False, next(g[1] for g in got if not g[0])
                differ = [i for i, (g, c) in enumerate(zip(got, jobs)) if g[2] != answers[contexts.index(c)]]
                return not differ, (f"{len(jobs)} concurrent requests, each equal to its answer alone" if not differ
                                    else f"requests {differ} differ from their answers alone")
            checks.run(f"{config.concurrency} concurrent requests -> same answers as alone", concurrent)

            for name, kwargs, field in invalid_requests(vocab, n):
                def invalid(kwargs=kwargs, field=field, name=name) -> tuple[bool, str]:
                    r = post(name, **kwargs)
                    named = field in r.text
                    ok = 400 <= r.status_code < 500 and named
                    detail = f"HTTP {r.status_code}" + ("" if named else f", body does not name {field!r}")
                    if not ok:
                        detail += f": {r.text[:160]}"
                    return ok, detail
                checks.run(f"invalid: {name} -> 4xx naming {field!r}", invalid)

            def metrics() -> tuple[bool, str]:
                r = client.get("/metrics")
                statuses.append(("metrics", r.status_code))
                return r.status_code == 200 and len(r.text) > 0, f"HTTP {r.status_code}, {len(r.text)} bytes"
            checks.run("GET /metrics answers", metrics)

        five = [(name, code) for name, code in statuses if code >= 500]
        checks.add("no request got a 5xx", not five,
                   f"{len(statuses)} requests" if not five else f"5xx answers: {five[:5]}")
    finally:
        code = server.stop()
    if ready:
        # uvicorn re-raises the signal after a graceful shutdown, so -SIGTERM is a clean exit too.
        drained = "Application shutdown complete" in server.log_text()
        checks.add("server shuts down gracefully on SIGTERM", code in (0, -signal.SIGTERM) and drained,
                   f"exit code {code}, " + ("shutdown complete" if drained else "no 'Application shutdown "
                                            "complete' in the log"))


# ---------------------------------------------------------------------------------------------- stage

def run_selfcheck(config: SelfcheckConfig) -> int:
    model_dir = Path(config.model_dir)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    statuses: list[tuple[str, int]] = []
    started = time.time()
    if not model_dir.is_dir():
        checks.add("model dir exists", False, f"{model_dir}: no such directory")
    else:
        check_weight_file(model_dir, checks)
        vocab = None
        try:
            vocab = int(read_json(model_dir / "config.json")["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            checks.add("config.json has vocab_size", False, f"{model_dir / 'config.json'}: {e!r}")
        if vocab:
            check_server(config, model_dir, vocab, checks, statuses)
    passed = checks.passed
    failed = [c.name for c in checks.items if not c.ok]
    report = {
        "model_dir": str(model_dir),
        "passed": passed,
        "checks": [asdict(c) for c in checks.items],
        "counts": {"pass": sum(c.ok for c in checks.items), "fail": len(failed)},
        "failed": failed,
        "requests": [{"request": n, "status": s} for n, s in statuses],
        "seconds": round(time.time() - started, 2),
        "provenance": {**run_metadata(), "stage": "selfcheck", "config": config.to_json_dict()},
    }
    atomic_write_json(out / "selfcheck.json", report)
    print(f"{'PASS' if passed else 'FAIL'}: {report['counts']['pass']} checks passed, {len(failed)} failed "
          f"({out / 'selfcheck.json'})", flush=True)
    return 0 if passed else 1

