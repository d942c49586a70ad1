"""Soak the draft server under mixed traffic, each mix for minutes on a fresh server, then SIGTERM it.

  .venv/bin/python bench/bench_soak.py --model-dir runs/demo/model --duration 300 --out soak.json

Mixes (clients of each class, closed loop; a client waits the Retry-After of a 503 unless it misbehaves):

  short       24 clients, contexts of 16-300 tokens
  mixed       the 24 short + 4 long clients, contexts of 2,000-4,000 tokens
  misbehaving the mixed ones + 2 clients sending malformed bodies and 2 abandoning 3,000-token requests after
              0.5 s, not waiting after a 503
  long        8 long clients only
  short_probs, short_sampled
              the short mix with every request asking for draft_probs: greedy (``return_probs``), and sampled
              (temperature 0.7, top-p 0.9, a seed per request, ``return_probs``); each against ``short``, the
              greedy call, by the ratio of median latencies and of throughput (goal: probabilities within 10%)

  .venv/bin/python bench/bench_soak.py --model-dir runs/demo/model --mixes short short_probs short_sampled \
      --duration 60 --short-clients 8

Per client class: status codes, answered per second, p50/p99 of the answered; the server's RSS at start, after
the warm-up, at its peak and at the end; and the exit code and seconds of a SIGTERM sent while the clients still
run. The goal figures (short clients in `mixed` against `short`: throughput >= 70%, p99 <= 2x) are computed at
the end. Contexts are random token ids of the draft's vocabulary (what costs is their length, not their words).
The server runs with `specdraft serve`'s defaults unless --serve-args says otherwise. Every request of a mix is
the same kind of call, so a variant's cost shows in the iterations all its rows share (in a mix of kinds the greedy
rows would pay for the sampled ones beside them, and the ratio would hide it). The result goes to
``bench/results/soak.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shlex
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from harness import RssSampler, add_out_argument, argument_parser, log_to_console, percentile, save_result
from specdraft.drafting.remote import retry_after_seconds
from specdraft.model.specs import load_config
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench.soak")

MIXES = {
    "short": {"short": 24},
    "mixed": {"short": 24, "long": 4},
    "misbehaving": {"short": 24, "long": 4, "malformed": 2, "abandoning": 2},
    "long": {"long": 8},
    "short_probs": {"short_probs": 24},
    "short_sampled": {"short_sampled": 24},
}
SHORT_KINDS = ("short", "short_probs", "short_sampled")  # the classes --short-clients sets
CONTEXTS = {"short": (16, 300), "short_probs": (16, 300), "short_sampled": (16, 300), "long": (2000, 4000),
            "abandoning": (3000, 3000), "malformed": (16, 64)}
# what each class adds to {"token_ids", "num_tokens"}; a sampled request also gets a seed of its own
REQUEST_FIELDS: dict[str, dict[str, Any]] = {
    "short_probs": {"return_probs": True},
    "short_sampled": {"return_probs": True, "sampling": {"temperature": 0.7, "top_p": 0.9}},
}
# the variants measured against the greedy call (`short`), and the goal on their median latency
VARIANT_GOAL_P50_RATIO = 1.10
BAD_BODIES = [b'{"token_ids": [1, 2', b'{"token_ids": "x"}', b'{"num_tokens": 99}', b"[]",
              b'{"token_ids": [1.5, -2]}', b'{"token_ids": [1], "extra": true}']


async def client(url: str, kind: str, vocab: int, seed: int, stop: asyncio.Event, record: list) -> None:
    """One closed-loop client of a class: send, wait for the answer (or give up), repeat until ``stop``."""
    rng = random.Random(seed)
    low, high = CONTEXTS[kind]
    timeout = 0.5 if kind == "abandoning" else 120.0
    async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False) as http:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                if kind == "malformed":
                    r = await http.post("/draft", content=rng.choice(BAD_BODIES),
                                        headers={"content-type": "application/json"})
                else:
                    ids = [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
                    body = {"token_ids": ids, "num_tokens": 16, **REQUEST_FIELDS.get(kind, {})}
                    if "sampling" in body:
                        body["sampling"] = {**body["sampling"], "seed": rng.randrange(2**31)}
                    r = await http.post("/draft", json=body)
                status: int | str = r.status_code
            except httpx.TimeoutException:
                status = "gave up" if kind == "abandoning" else "client timeout"
            except httpx.HTTPError as e:
                status = type(e).__name__
            record.append((kind, status, time.perf_counter() - started, time.monotonic()))
            if status == 503 and kind in (*SHORT_KINDS, "long"):  # a well-behaved client waits as told
                try:
                    await asyncio.wait_for(stop.wait(), retry_after_seconds(r))
                except asyncio.TimeoutError:
                    pass


def run_mix(name: str, classes: dict[str, int], args, vocab: int) -> dict[str, Any]:
    log.info("mix %s: %s for %ds", name, classes, args.duration)
    extra = shlex.split(args.serve_args)
    server = ServerProcess(args.model_dir, Path(args.work) / f"soak_{name}.log", extra)
    ready, detail = server.wait_ready(600)
    if not ready:
        raise RuntimeError(f"server did not start: {detail}")
    t0 = time.monotonic()
    record: list[tuple] = []

    async def main() -> tuple[int | None, float]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(client(server.url, kind, vocab, 1000 * i + j, stop, record))
                 for i, (kind, n) in enumerate(classes.items()) for j in range(n)]
        await asyncio.sleep(args.duration)
        # SIGTERM while the clients still run: in-flight and queued requests are answered or refused
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(server.proc.wait, 60)
        seconds = time.monotonic() - sigterm_at
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return code, seconds

    try:
        with RssSampler(server.proc.pid, every=2.0) as sampler:
            code, sigterm_seconds = asyncio.run(main())
    finally:
        server.stop()
    rss = sampler.samples
    end = t0 + args.duration
    per_class: dict[str, Any] = {}
    for kind in classes:
        rows = [r for r in record if r[0] == kind and r[3] <= end]  # before the SIGTERM
        answered = [r[2] for r in rows if r[1] == 200]
        per_class[kind] = {
            "clients": classes[kind], "requests": len(rows), "statuses": dict(Counter(str(r[1]) for r in rows)),
            "answered_per_s": len(answered) / args.duration,
            "p50_s": percentile(answered, 50), "p99_s": percentile(answered, 99),
        }
    after_sigterm = Counter(str(r[1]) for r in record if r[3] > end)
    warm = sampler.since(args.warmup)
    log_text = server.log_text()
    result = {
        "mix": name, "classes": per_class, "duration_s": args.duration,
        "rss_mb": {"start": rss[0][1] if rss else None, "after_warmup": warm[0] if warm else None,
                   "peak_after_warmup": max(warm) if warm else None, "end": rss[-1][1] if rss else None,
                   "peak": sampler.peak_mb,
                   "growth_after_warmup": (max(warm) / warm[0] - 1) if warm else None},
        "sigterm": {"exit_code": code, "seconds": sigterm_seconds, "after_sigterm_statuses": dict(after_sigterm),
                    "aborted": "terminate called" in log_text},
        "server_argv": server.argv,
        "five_hundreds_other_than_503": sum(n for s, n in Counter(str(r[1]) for r in record).items()
                                            if s.isdigit() and int(s) >= 500 and s != "503"),
    }
    log.info("mix %s: %s", name, json.dumps({k: (v["answered_per_s"], v["p99_s"], v["statuses"])
                                             for k, v in per_class.items()}))
    return result


def variant_goals(by_mix: dict[str, Any]) -> dict[str, Any]:
    """Each probability variant against the greedy call: median latency and throughput ratios, and the goal."""
    if "short" not in by_mix:
        return {}
    greedy = by_mix["short"]["classes"]["short"]
    goals: dict[str, Any] = {}
    for variant in ("short_probs", "short_sampled"):
        if variant not in by_mix:
            continue
        v = by_mix[variant]["classes"][variant]
        ratio = v["p50_s"] / greedy["p50_s"] if v["p50_s"] and greedy["p50_s"] else None
        goals[f"{variant}_p50_ratio"] = ratio
        goals[f"{variant}_throughput_ratio"] = (v["answered_per_s"] / greedy["answered_per_s"]
                                                if greedy["answered_per_s"] else None)
        goals[f"{variant}_p50_within_goal"] = None if ratio is None else ratio <= VARIANT_GOAL_P50_RATIO
    return goals


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", required=True, help="the packed draft to serve (e.g. runs/demo/model)")
    ap.add_argument("--duration", type=int, default=300, help="seconds of traffic per mix")
    ap.add_argument("--warmup", type=int, default=60, help="seconds after which RSS must stay flat")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--short-clients", type=int, default=None,
                    help="short clients in every mix (default: each mix's own, 24)")
    ap.add_argument("--serve-args", default="", help="extra `specdraft serve` options, e.g. '--threads 1'")
    ap.add_argument("--work", default="runs/bench_soak", help="where the servers' logs go")
    add_out_argument(ap, "runs/bench_soak/soak.json")
    args = ap.parse_args(argv)
    log_to_console()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    vocab = int(load_config(args.model_dir).vocab_size)
    mixes = {name: {kind: (args.short_clients if kind in SHORT_KINDS and args.short_clients else n)
                    for kind, n in MIXES[name].items()} for name in args.mixes}
    results = [run_mix(name, mixes[name], args, vocab) for name in args.mixes]
    by_mix = {r["mix"]: r for r in results}
    goals = {}
    if "short" in by_mix and "mixed" in by_mix:
        alone, mixed = by_mix["short"]["classes"]["short"], by_mix["mixed"]["classes"]["short"]
        goals = {"short_throughput_kept": mixed["answered_per_s"] / alone["answered_per_s"]
                 if alone["answered_per_s"] else None,
                 "short_p99_ratio": mixed["p99_s"] / alone["p99_s"] if alone["p99_s"] and mixed["p99_s"] else None}
    goals.update(variant_goals(by_mix))
    save_result("soak", {"results": results, "goals": goals}, args.out)
    print(json.dumps({"goals": goals, "per_mix": {r["mix"]: {
        "classes": {k: {"answered_per_s": round(v["answered_per_s"], 2), "p50_s": v["p50_s"], "p99_s": v["p99_s"],
                        "statuses": v["statuses"]} for k, v in r["classes"].items()},
        "rss_mb": r["rss_mb"], "sigterm": r["sigterm"], "5xx_not_503": r["five_hundreds_other_than_503"]}
        for r in results}}, indent=1, default=lambda x: round(x, 3) if isinstance(x, float) else x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
