"""The draft server against its peer: `specdraft serve` and llama.cpp's `llama-server` on the same contexts and the
same draft weights, at 1, 4 and 16 closed-loop clients, with equal compute threads.

  flock /tmp/bench.lock bash bench/build_llama_cpp.sh      # once: llama-server from the pinned llama-cpp-python
                                                           # 0.3.36 sdist, cached under ~/.cache/specdraft/llama.cpp
  flock /tmp/bench.lock .venv/bin/python bench/bench_server_peers.py --model-dir runs/demo/model \\
      --gguf runs/demo/export/draft.gguf --validation runs/demo/validation/validation.jsonl \\
      --concurrency 1 4 16 --duration 120 --out runs/peers/peers.json

The draft: --model-dir is the packed dir `specdraft serve --model-dir` serves, --gguf the same draft written by
`specdraft export MODEL_DIR --format gguf` (its 4-bit tensors are the packed codes, stored as Q4_1 without loss).
The contexts: the points of --validation (context_ids and the target's next 16 greedy tokens), in one shuffled
order (--seed) that every run walks from its start, so both servers answer the same contexts in the same order.

Equal compute threads: both servers get --threads T compute threads (default: the CPUs - 1, at least 1, which is
`specdraft serve`'s own default: on the 2-core reference machine one core computes and the other is left to the
HTTP side and to this load generator). specdraft: `specdraft serve --threads T` (torch intra-op threads of its one
model worker), its other settings at their defaults (iteration-level batching of up to 32 rows). llama-server:
`-t T -tb T -np C -c C*S --cont-batching --cache-ram 0` (C slots for C clients, S tokens of context per slot: the
longest context + 16, rounded up to 256; continuous batching, its default, decodes every slot in one batch).
Neither side reuses work across requests: specdraft serve has no prompt cache, and llama-server gets
`"cache_prompt": false` and no host-memory prompt cache, so every request prefills its whole context.

Requests: specdraft `POST /draft {"token_ids": ids, "num_tokens": 16}`; llama-server `POST /completion {"prompt":
ids, "n_predict": 16, "temperature": 0, "top_k": 1, "cache_prompt": false, "return_tokens": true}` -- the prompt
as token ids (no BOS is added to an id list), greedy, the token ids returned in `tokens`. llama-server stops after
an end-of-generation token (then it returns fewer than 16, that token included; counted as `short drafts`).
Acceptance: the accepted length of each answer's tokens against the target's 16 (greedy verification,
`specdraft.drafting.metrics.accepted_length`), averaged over the answered requests; and over the contexts both
servers answered at that level, with the share of identical drafts (llama.cpp's CPU Q4_1 matmul quantises the
activations to 8 bits, so its drafts are not bit-identical to the packed draft's).

Each level: for each server in turn (specdraft first at the 1st, 3rd, ... level, llama-server first at the others,
so that drifting machine load spreads over both), a fresh server; --warmup requests (contexts from the end of the
order); then C keep-alive clients (httpx), each sending its next context as soon as its answer arrives, until
--duration seconds have passed or --max-requests were sent. Answered/s counts the answers within that window (or
until the last answer when --max-requests ended it first); the requests still in flight at its end are answered
and their latencies counted in p50/p99. A client waits 1 s after an error. Then SIGTERM, and the exit code.

Writes ``bench/results/server_peers.<cpu class>.json`` and --out, after every level (JSON: the machine, the command,
the configuration, llama.cpp's build, per level and server: answered/s, p50/p99, errors, acceptance, the server's
CPU use and peak RSS; the specdraft / llama-server ratios; ``clients`` and ``memory_mb``: per client count, what
bench/report.py quotes), a markdown table beside --out (.md) and a plot (.png: answered/s and p99 against clients).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import logging
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from harness import RssSampler, add_out_argument, argument_parser, log_to_console, percentile, save_result, stopwatch
from specdraft.core.io import atomic_write_bytes, atomic_write_text, read_json
from specdraft.core.machine import describe
from specdraft.core.records import ValidationPoint, load_validation
from specdraft.drafting.metrics import accepted_length
from specdraft.drafting.remote import retry_after_seconds
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench.peers")

LLAMA_CPP_PYPI = "llama-cpp-python==0.3.36"
SPECDRAFT, LLAMA = "specdraft serve", "llama-server"
JSON_HEADERS = {"content-type": "application/json"}


def default_llama_server() -> Path:
    """Where bench/build_llama_cpp.sh leaves llama-server."""
    home = Path(os.environ.get("SPECDRAFT_HOME") or Path.home() / ".cache" / "specdraft")
    return home / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYPI.split('==')[1]}" / "build" / "bin" / "llama-server"


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ the servers

class SpecdraftPeer:
    """`specdraft serve --model-dir DIR --threads T` through ServerProcess; `POST /draft`."""

    name, route = SPECDRAFT, "/draft"

    def __init__(self, args: argparse.Namespace):
        self.model_dir, self.k = args.model_dir, args.num_tokens
        self.extra = ["--threads", str(args.threads), *shlex.split(args.serve_args)]
        self.server: ServerProcess | None = None

    def start(self, clients: int, log_path: Path, timeout: float) -> dict[str, Any]:
        self.server = ServerProcess(self.model_dir, log_path, self.extra)
        ready, detail = self.server.wait_ready(timeout)
        if not ready:
            self.server.stop()
            raise RuntimeError(f"{self.name} did not start: {detail}")
        health = httpx.get(self.server.url + "/health", trust_env=False, timeout=10).json()
        return {"health": health, "loaded_line": next((line for line in self.server.log_text().splitlines()
                                                       if "loaded qd4" in line), None)}

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    @property
    def argv(self) -> list[str]:
        return self.server.argv

    def stop(self) -> int | None:
        return self.server.stop()

    def body(self, context_ids: list[int]) -> bytes:
        return json.dumps({"token_ids": context_ids, "num_tokens": self.k}).encode()

    def tokens(self, answer: dict[str, Any]) -> list[int]:
        return answer["draft_ids"]


class LlamaPeer:
    """`llama-server -m draft.gguf -t T -tb T -np C -c C*S --cont-batching --cache-ram 0`; `POST /completion`."""

    name, route = LLAMA, "/completion"

    def __init__(self, args: argparse.Namespace, slot_context: int, cache_prompt: bool = False):
        self.binary, self.gguf, self.k = str(args.llama_server), str(args.gguf), args.num_tokens
        self.cache_prompt = cache_prompt  # off in this benchmark: like specdraft serve, every request prefills whole
        self.threads, self.slot_context = args.threads, slot_context
        self.extra = shlex.split(args.llama_args)
        self.proc: subprocess.Popen | None = None
        self.argv: list[str] = []
        self.url = ""

    def start(self, clients: int, log_path: Path, timeout: float) -> dict[str, Any]:
        port = free_port()
        self.argv = [self.binary, "-m", self.gguf, "--host", "127.0.0.1", "--port", str(port),
                     "-t", str(self.threads), "-tb", str(self.threads), "-np", str(clients),
                     "-c", str(clients * self.slot_context), "--cont-batching", "--cache-ram", "0", *self.extra]
        self.url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log_file:
            self.proc = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-8:])
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {tail}")
                try:
                    if http.get("/health").status_code == 200:
                        props = http.get("/props").json()
                        return {"build_info": props.get("build_info"), "total_slots": props.get("total_slots"),
                                "n_ctx_per_slot": props.get("default_generation_settings", {}).get("n_ctx"),
                                "model_path": props.get("model_path")}
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {timeout:.0f}s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None

    def body(self, context_ids: list[int]) -> bytes:
        return json.dumps({"prompt": context_ids, "n_predict": self.k, "temperature": 0, "top_k": 1,
                           "cache_prompt": self.cache_prompt, "return_tokens": True}).encode()

    def tokens(self, answer: dict[str, Any]) -> list[int]:
        return answer["tokens"][: self.k]


# ------------------------------------------------------------------------------------------------- the load

@dataclass
class Answer:
    index: int            # the validation point
    seconds: float        # latency
    done: float           # perf_counter when it came back
    tokens: list[int] | None = None
    error: str | None = None


async def closed_loop(peer, bodies: list[bytes], order: list[int], clients: int, duration: float,
                      max_requests: int | None, timeout: float) -> tuple[list[Answer], float, float, float]:
    """``clients`` keep-alive clients walking ``order`` together; (answers, start, stop_at, end)."""
    answers: list[Answer] = []
    sent = itertools.count()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=peer.url, timeout=timeout, limits=limits, trust_env=False) as http:
        start = time.perf_counter()
        stop_at = start + duration

        async def client() -> None:
            while time.perf_counter() < stop_at:
                n = next(sent)
                if max_requests is not None and n >= max_requests:
                    return
                index = order[n % len(order)]
                t0 = time.perf_counter()
                answer = Answer(index, 0.0, 0.0)
                wait = 1.0
                try:
                    r = await http.post(peer.route, content=bodies[index], headers=JSON_HEADERS)
                    if r.status_code == 200:
                        answer.tokens = peer.tokens(r.json())
                    else:
                        answer.error = f"{r.status_code}: {r.text[:160]}"
                        wait = retry_after_seconds(r)  # a refusal says when to come back (503 + Retry-After)
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    answer.error = f"{type(e).__name__}: {e}"
                answer.done = time.perf_counter()
                answer.seconds = answer.done - t0
                answers.append(answer)
                if answer.error is not None:
                    await asyncio.sleep(wait)

        await asyncio.gather(*(client() for _ in range(clients)))
        return answers, start, stop_at, time.perf_counter()


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def run_server(peer, clients: int, points: list[ValidationPoint], order: list[int], args: argparse.Namespace,
               work: Path) -> tuple[dict[str, Any], dict[int, list[int]]]:
    """One fresh server at one concurrency: start, warm up, measure, stop. (summary, tokens by point)."""
    k = args.num_tokens
    slug = "specdraft" if peer.name == SPECDRAFT else "llama"
    with stopwatch() as startup:
        info = peer.start(clients, work / f"{slug}_c{clients}.log", args.start_timeout)
    bodies = [peer.body(p.context_ids) for p in points]
    try:
        with RssSampler(peer.pid) as rss:
            warm, w0, _, w1 = asyncio.run(closed_loop(peer, bodies, order[::-1], min(clients, max(args.warmup, 1)),
                                                      3600, args.warmup, args.timeout))
            cpu0 = cpu_seconds(peer.pid)
            answers, start, stop_at, end = asyncio.run(closed_loop(peer, bodies, order, clients, args.duration,
                                                                   args.max_requests, args.timeout))
            cpu_s = cpu_seconds(peer.pid) - cpu0
    finally:
        exit_code = peer.stop()
    window_end = min(stop_at, end)  # --max-requests may end the run before --duration
    seconds = window_end - start
    ok = [a for a in answers if a.tokens is not None]
    errors = [a.error for a in answers if a.error is not None]
    latencies = [a.seconds for a in ok]
    accepted = [accepted_length(a.tokens, points[a.index].target_ids[:k]) for a in ok]
    in_window = sum(1 for a in ok if a.done <= window_end)
    summary = {
        "server": peer.name, "clients": clients, "argv": peer.argv, "server_info": info,
        "startup_s": startup.wall, "warmup": {"requests": len(warm), "errors": sum(a.error is not None for a in warm),
                                           "seconds": w1 - w0},
        "seconds": seconds, "drain_s": max(0.0, end - stop_at), "sent": len(answers), "answered": len(ok),
        "answered_in_window": in_window, "answered_per_s": in_window / seconds if seconds > 0 else 0.0,
        "p50_s": percentile(latencies, 50), "p99_s": percentile(latencies, 99),
        "mean_s": statistics.fmean(latencies) if latencies else None, "max_s": max(latencies, default=None),
        "errors": len(errors), "error_examples": sorted(set(errors))[:5],
        "mean_accepted": statistics.fmean(accepted) if accepted else None,
        "accepted_histogram": [accepted.count(a) for a in range(k + 1)],
        "short_drafts": sum(len(a.tokens) < k for a in ok),
        "cpu_s": cpu_s, "cpu_cores_busy": cpu_s / (end - start) if end > start else None,
        "rss_peak_mb": rss.peak_mb, "exit_code": exit_code,
    }
    log.info("%s, %d clients: %.2f answered/s, p50 %.2f s, p99 %.2f s, %d errors, accepted %.2f of %d, "
             "%.2f cores busy, exit %s", peer.name, clients, summary["answered_per_s"], summary["p50_s"] or math.nan,
             summary["p99_s"] or math.nan, len(errors), summary["mean_accepted"] or math.nan, k,
             summary["cpu_cores_busy"] or math.nan, exit_code)
    tokens: dict[int, list[int]] = {}
    for a in ok:
        tokens.setdefault(a.index, a.tokens)
    return summary, tokens


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(runs: dict[str, dict[str, Any]], tokens: dict[str, dict[int, list[int]]],
            points: list[ValidationPoint], k: int) -> dict[str, Any]:
    """specdraft / llama-server at one level, and acceptance on the contexts both answered."""
    s, ll = runs[SPECDRAFT], runs[LLAMA]
    common = sorted(set(tokens[SPECDRAFT]) & set(tokens[LLAMA]))

    def mean_acc(name: str) -> float | None:
        acc = [accepted_length(tokens[name][i], points[i].target_ids[:k]) for i in common]
        return statistics.fmean(acc) if acc else None

    return {
        "answered_per_s_ratio": ratio(s["answered_per_s"], ll["answered_per_s"]),
        "p50_ratio": ratio(s["p50_s"], ll["p50_s"]), "p99_ratio": ratio(s["p99_s"], ll["p99_s"]),
        "common_contexts": len(common),
        "accepted_on_common": {SPECDRAFT: mean_acc(SPECDRAFT), LLAMA: mean_acc(LLAMA)},
        "identical_drafts_on_common": (sum(tokens[SPECDRAFT][i] == tokens[LLAMA][i] for i in common) / len(common)
                                       if common else None),
    }


# ----------------------------------------------------------------------------------------------- the report

def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def quoted(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """What bench/report.py quotes: per client count, each server's answered/s, their ratio and each one's p99
    (specdraft's first); each server's peak RSS, lowest and highest over the levels."""
    clients = {}
    for level in levels:
        ours, theirs = level["servers"][SPECDRAFT], level["servers"][LLAMA]
        clients[str(level["clients"])] = {
            "specdraft_answered_per_s": _round(ours["answered_per_s"]),
            "llama_server_answered_per_s": _round(theirs["answered_per_s"]),
            "ratio": _round(level["comparison"]["answered_per_s_ratio"]),
            "p99_s": [_round(ours["p99_s"]), _round(theirs["p99_s"])]}
    peaks = {key: [level["servers"][name]["rss_peak_mb"] for level in levels]
             for key, name in (("specdraft", SPECDRAFT), ("llama_server", LLAMA))}
    return {"clients": clients, "memory_mb": {key: [round(min(mb)), round(max(mb))] for key, mb in peaks.items()}}


def markdown(record: dict[str, Any]) -> str:
    res = record["figures"]
    cfg, k = res["config"], res["config"]["num_tokens"]
    lines = [
        f"`specdraft serve` vs `llama-server` ({res['llama_cpp']['source']}, build {res['llama_cpp']['build_info']}),"
        f" the same draft, {cfg['threads']} compute thread(s) each, {cfg['duration_s']:.0f} s per server and level, "
        f"{res['points']} contexts (mean {res['mean_context_tokens']:.0f} tokens, longest "
        f"{res['max_context_tokens']}); {describe(record['machine'])}; {record['date']}.",
        "",
        f"| server | clients | answered/s | p50 s | p99 s | accepted of {k} | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for level in res["levels"]:
        for name in (SPECDRAFT, LLAMA):
            r = level["servers"][name]
            lines.append(f"| {name} | {level['clients']} | {_f(r['answered_per_s'])} | {_f(r['p50_s'])} | "
                         f"{_f(r['p99_s'])} | {_f(r['mean_accepted'])} | {r['errors']} |")
    lines += ["", "| clients | answered/s, specdraft / llama-server | p99, specdraft / llama-server | accepted on the "
              "contexts both answered (specdraft / llama-server) | identical drafts |", "|---:|---:|---:|---|---:|"]
    for level in res["levels"]:
        c = level["comparison"]
        acc, same = c["accepted_on_common"], c["identical_drafts_on_common"]
        lines.append(f"| {level['clients']} | {_f(c['answered_per_s_ratio'])}× | {_f(c['p99_ratio'])}× | "
                     f"{_f(acc[SPECDRAFT])} / {_f(acc[LLAMA])} ({c['common_contexts']} contexts) | "
                     f"{_f(None if same is None else 100 * same, 0)}% |")
    lines += ["", "```bash", record["command"], "```", ""]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    clients = [level["clients"] for level in res["levels"]]
    for col, (key, label) in enumerate([("answered_per_s", "answered/s"), ("p99_s", "p99 latency (s)")]):
        ax = fig.add_subplot(1, 2, col + 1)
        for name, marker in ((SPECDRAFT, "o"), (LLAMA, "s")):
            ys = [level["servers"][name][key] for level in res["levels"]]
            ax.plot(clients, [math.nan if y is None else y for y in ys], marker=marker, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels([str(c) for c in clients])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{label}, {res['config']['threads']} compute thread(s) each")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


# --------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", required=True, help="the packed draft dir `specdraft serve` serves")
    ap.add_argument("--gguf", required=True, help="the same draft exported by `specdraft export --format gguf`")
    ap.add_argument("--validation", required=True, help="validation.jsonl: context_ids + the target's 16 tokens")
    ap.add_argument("--llama-server", type=Path, default=default_llama_server(),
                    help="the llama-server binary (default: bench/build_llama_cpp.sh's cached build)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="closed-loop clients per level")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="compute threads of each server (default: CPUs - 1, at least 1)")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of traffic per server and level")
    ap.add_argument("--max-requests", type=int, default=None, help="also stop a run after this many requests")
    ap.add_argument("--warmup", type=int, default=4, help="requests sent to a fresh server before measuring")
    ap.add_argument("--points", type=int, default=None, help="use only the first N validation points")
    ap.add_argument("--num-tokens", type=int, default=16, help="tokens drafted per request")
    ap.add_argument("--slot-context", type=int, default=None,
                    help="llama-server context per slot (default: longest context + num-tokens, rounded up to 256)")
    ap.add_argument("--seed", type=int, default=0, help="shuffles the contexts")
    ap.add_argument("--timeout", type=float, default=600.0, help="client timeout per request, seconds")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be healthy")
    ap.add_argument("--serve-args", default="", help="extra `specdraft serve` options")
    ap.add_argument("--llama-args", default="", help="extra llama-server options")
    add_out_argument(ap, "runs/peers/peers.json", beside="; a markdown table (.md) and a plot (.png) beside it")
    args = ap.parse_args(argv)
    log_to_console()

    if not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: run `bash bench/build_llama_cpp.sh` first")
    out = Path(args.out)
    work = out.parent / (out.stem + "_logs")
    points = load_validation(args.validation, k=args.num_tokens, limit=args.points)
    lengths = [len(p.context_ids) for p in points]
    slot_context = args.slot_context or 256 * math.ceil((max(lengths) + args.num_tokens) / 256)
    order = list(range(len(points)))
    random.Random(args.seed).shuffle(order)
    peers = {SPECDRAFT: SpecdraftPeer(args), LLAMA: LlamaPeer(args, slot_context)}
    log.info("%d contexts (mean %.0f tokens, longest %d), %d compute thread(s) per server, llama-server slots of %d",
             len(points), statistics.fmean(lengths), max(lengths), args.threads, slot_context)

    res: dict[str, Any] = {
        "config": {"model_dir": args.model_dir, "gguf": args.gguf, "validation": args.validation,
                   "llama_server": str(args.llama_server), "concurrency": args.concurrency, "threads": args.threads,
                   "duration_s": args.duration, "max_requests": args.max_requests, "warmup": args.warmup,
                   "num_tokens": args.num_tokens, "slot_context": slot_context, "seed": args.seed,
                   "serve_args": args.serve_args, "llama_args": args.llama_args},
        "fairness": f"{args.threads} compute thread(s) each (specdraft --threads, llama-server -t/-tb); no prompt "
                    "cache on either side; same contexts in the same order; servers alternate first per level",
        "load_average_start": os.getloadavg(),
        "points": len(points), "mean_context_tokens": statistics.fmean(lengths), "max_context_tokens": max(lengths),
        "llama_cpp": {"source": f"{LLAMA_CPP_PYPI} sdist, vendor/llama.cpp", "binary": str(args.llama_server),
                      "build_info": None},
        "levels": [],
    }
    for i, clients in enumerate(args.concurrency):
        names = [SPECDRAFT, LLAMA] if i % 2 == 0 else [LLAMA, SPECDRAFT]
        runs, tokens = {}, {}
        for name in names:
            runs[name], tokens[name] = run_server(peers[name], clients, points, order, args, work)
            time.sleep(2.0)  # let the stopped server's memory go before the next one starts
        res["llama_cpp"]["build_info"] = runs[LLAMA]["server_info"].get("build_info")
        res["levels"].append({"clients": clients, "order": names, "servers": runs,
                              "comparison": compare(runs, tokens, points, args.num_tokens)})
        res.update(quoted(res["levels"]))
        save_result("server_peers", res, out)  # what is done so far survives a later failure
    res["load_average_end"] = os.getloadavg()
    table = markdown(read_json(save_result("server_peers", res, out)))
    atomic_write_text(out.with_suffix(".md"), table)
    plot(res, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
