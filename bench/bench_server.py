"""Benchmark the draft server: batch-1 draft latency per compute format, and HTTP throughput under load.

  .venv/bin/python bench/bench_server.py --out runs/bench_server.json                  # stand-in draft
  .venv/bin/python bench/bench_server.py --draft-dir runs/demo/packed --out ...        # the trained draft

Without --draft-dir it builds a stand-in: the embedded target's first --standin-layers layers, saved as an
HF dir and packed to QD04 (cached under --work). Evaluation points come from --validation
(validation.jsonl: context_ids + the target's next 16 greedy tokens) or, by default, from the target's
greedy continuations of a built-in prompt list.

Part 1 (in process, batch 1): for each compute format, the p50/p99 latency of one 16-token draft
(``draft_batch``), its acceptance against the target and its agreement with the float32 draft, next to
``model.generate(max_new_tokens=16)`` of the float model on the same contexts, and the memory-bandwidth
floor: (weight bytes read per token) x 16 / bandwidth.

Part 2 (over HTTP): `specdraft serve` in a subprocess; 1, 8 and 32 closed-loop keep-alive clients for
--duration seconds each: requests/s, p50/p99, errors, rows decoded together per iteration, and the server's
RSS over the run.

The result goes to ``bench/results/server.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness import (
    RssSampler,
    add_out_argument,
    argument_parser,
    log_to_console,
    metric_values,
    save_result,
    stopwatch,
    timed,
)
from specdraft.core.io import read_json
from specdraft.core.machine import describe
from specdraft.drafting.acceptance import percentile  # NaN without values: a level nothing answered still prints
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for staying focused while studying.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Translate 'Where is the train station?' into Spanish.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a short email asking a colleague to review a document.",
    "How does a refrigerator keep food cold?",
    "List five fruits that are high in vitamin C.",
    "What is 17 multiplied by 23? Show your working.",
    "Describe the water cycle.",
    "Write a SQL query that returns the ten most recent orders.",
    "Why is the sky blue?",
    "Give me a recipe for a simple tomato pasta.",
    "Explain what a binary search does and when to use it.",
    "Write a limerick about a cat who loves to code.",
    "What causes the seasons on Earth?",
    "Suggest a name for a bakery and explain why.",
    "How do vaccines work?",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What is the difference between weather and climate?",
    "Explain recursion with a simple example.",
]


# ---------------------------------------------------------------------------------------------- inputs

def build_standin(layers: int, out: Path, target: str) -> Path:
    """The target's first ``layers`` layers as an HF dir (with the tokenizer): a stand-in draft."""
    from specdraft.model.specs import load_model, load_tokenizer

    if (out / "config.json").is_file():
        return out
    model, tok = load_model(target), load_tokenizer(target)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def ensure_draft(args) -> tuple[Path, str]:
    """(packed draft dir, description)."""
    if args.draft_dir:
        return Path(args.draft_dir), f"draft {args.draft_dir}"
    from specdraft.cli import main as cli

    work = Path(args.work)
    float_dir = build_standin(args.standin_layers, work / f"standin-L{args.standin_layers}", args.target)
    packed = work / f"standin-L{args.standin_layers}-packed"
    if not (packed / "draft.qd4").is_file():
        rc = cli(["pack", "--checkpoint", str(float_dir), "--out", str(packed), "--overwrite"])
        if rc:
            raise SystemExit(f"pack failed ({rc})")
    return packed, f"stand-in: first {args.standin_layers} layers of {args.target}, packed QD04"


def eval_points(args, draft_dir: Path) -> list[dict[str, Any]]:
    """[{context_ids, target_ids}]: from --validation, else the target's greedy continuations (cached)."""
    if args.validation:
        rows = [json.loads(line) for line in Path(args.validation).read_text().splitlines() if line.strip()]
        return [{"context_ids": r["context_ids"], "target_ids": r["target_ids"][:16]} for r in rows][: args.points]
    import torch

    from specdraft.model.decode import greedy_decode
    from specdraft.model.specs import load_model, load_tokenizer

    cache = Path(args.work) / f"points-{args.target.replace(':', '_').replace('/', '_')}.json"
    if cache.is_file():
        return json.loads(cache.read_text())[: args.points]
    tok = load_tokenizer(args.target)
    target = load_model(args.target, torch.float32)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for p in PROMPTS]
    points = []
    for start in range(0, len(prompts), 8):
        batch = prompts[start:start + 8]
        for prompt, gen in zip(batch, greedy_decode(target, batch, 64)):
            for off in (0, 16, 32, 48):
                if len(gen.tokens) >= off + 16:
                    points.append({"context_ids": prompt + gen.tokens[:off],
                                   "target_ids": gen.tokens[off:off + 16]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(points))
    return points[: args.points]


def measure_read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of a streaming read (sum of a large float32 tensor), best of ``repeats``: now, on this machine."""
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / min(timed(x.sum, repeats)) / 1e9


# -------------------------------------------------------------------------------------- batch-1 latency

def latency_bench(args, draft_dir: Path, points: list[dict[str, Any]], read_gbs: float) -> dict[str, Any]:
    import torch

    from specdraft.drafting.metrics import accepted_length
    from specdraft.model.loader import load_packed_model
    from specdraft.server.engine import load_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    n = 16
    contexts = [p["context_ids"] for p in points]
    results: dict[str, Any] = {"contexts": len(contexts), "num_tokens": n, "threads": torch.get_num_threads(),
                               "mean_context_tokens": statistics.mean(len(c) for c in contexts)}

    def each_context(fn) -> tuple[list[float], list[list[int]]]:
        """Seconds of ``fn(context)`` for every context, ``args.repeats`` times over, and the last pass's outputs."""
        for c in contexts[:3]:
            fn(c)  # warm-up
        times, outs = [], []
        for _ in range(args.repeats):
            outs = []
            for c in contexts:
                with stopwatch() as lap:
                    outs.append(fn(c))
                times.append(lap.wall)
        return times, outs

    def summary(times: list[float], outs: list[list[int]]) -> dict[str, Any]:
        acc = [accepted_length(o[:n], p["target_ids"][:n]) for o, p in zip(outs, points)]
        return {"p50_ms": 1000 * percentile(times, 50), "p99_ms": 1000 * percentile(times, 99),
                "mean_ms": 1000 * statistics.mean(times), "samples": len(times),
                "mean_accepted": statistics.mean(acc), "acceptance_rate": statistics.mean(acc) / n}

    float_src = args.float_dir or str(draft_dir)
    if args.float_dir:
        from transformers import AutoModelForCausalLM
        float_model = AutoModelForCausalLM.from_pretrained(args.float_dir, dtype=torch.float32).eval()
    else:
        float_model, _ = load_packed_model(draft_dir, torch.float32)

    @torch.inference_mode()
    def generate(c: list[int]) -> list[int]:
        ids = torch.tensor([c])
        out = float_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=float_model.generation_config.pad_token_id
                                   or float_model.config.eos_token_id)
        return out[0, len(c):].tolist()

    log.info("timing model.generate(max_new_tokens=16) of the float model (%s)", float_src)
    times, gen_outs = each_context(generate)
    results["generate_float32"] = summary(times, gen_outs)
    float_model = None  # free it before the draft engines load (the closure above is done with it)

    modes: dict[str, Any] = {}
    float_drafts: list[list[int]] | None = None
    for mode in args.computes:
        compute, _, variant = mode.partition("/")  # "int4/hf": decode steps through transformers' forward
        engine = load_engine(draft_dir, None, compute, lean=variant != "hf")
        log.info("timing draft_batch at batch 1, compute=%s, lean decode %s", compute, engine.load_info["lean_forward"])
        times, outs = each_context(lambda c: engine.draft([c], n)[0])
        s = summary(times, outs)
        s["weight_bytes_per_token"] = engine.bytes_per_token()
        s["floor_ms"] = 1000 * n * engine.bytes_per_token() / (args.bandwidth_gbs * 1e9)
        s["floor_ms_measured_bw"] = 1000 * n * engine.bytes_per_token() / (read_gbs * 1e9)
        s["speedup_vs_generate"] = results["generate_float32"]["p50_ms"] / s["p50_ms"]
        s["lean_forward"] = engine.load_info["lean_forward"]
        if mode == "float32":
            float_drafts = outs
            s["generate_agreement"] = _agreement(outs, gen_outs)
        if float_drafts is not None:
            s["agreement_vs_float32"] = _agreement(outs, float_drafts)
        if mode == args.server_compute:
            s["batched_equals_single"] = _batched_vs_single(engine, contexts, outs, n)
        modes[mode] = s
        engine = None  # free this engine before the next loads
    results["modes"] = modes
    ref = modes.get("float32")
    if ref:
        for s in modes.values():
            s["acceptance_vs_float32_pct"] = 100 * (s["mean_accepted"] / ref["mean_accepted"] - 1) \
                if ref["mean_accepted"] else 0.0
    return results


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    tokens = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return {"drafts_identical": sum(ra == rb for ra, rb in zip(a, b)) / len(a),
            "tokens_identical": tokens / sum(len(r) for r in a)}


def _batched_vs_single(engine, contexts: list[list[int]], single: list[list[int]], n: int) -> dict[str, Any]:
    batched: list[list[int]] = []
    for start in range(0, len(contexts), 8):
        batched += engine.draft(contexts[start:start + 8], n)
    same = sum(b == s for b, s in zip(batched, single))
    return {"rows": len(contexts), "identical": same, "batch_size": 8}


# ---------------------------------------------------------------------------------- acceptance per format

def acceptance_bench(args, model_dirs: dict[str, Path], points: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean accepted length (16-token drafts vs the target's greedy tokens) of each compute format, per
    model; decoded in batches of 8 (the server's batched path). Δ is relative to float32 of the same weights."""
    from specdraft.drafting.metrics import accepted_length
    from specdraft.server.engine import load_engine

    contexts = [p["context_ids"] for p in points]
    out: dict[str, Any] = {}
    for label, model_dir in model_dirs.items():
        per_mode: dict[str, Any] = {}
        drafts_f32: list[list[int]] | None = None
        for compute in args.computes:
            base, _, variant = compute.partition("/")
            engine = load_engine(model_dir, None, base, lean=variant != "hf")
            drafts: list[list[int]] = []
            with stopwatch() as lap:
                for start in range(0, len(contexts), 8):
                    drafts += engine.draft(contexts[start:start + 8], 16)
            acc = [accepted_length(d, p["target_ids"][:16]) for d, p in zip(drafts, points)]
            per_mode[compute] = {"mean_accepted": statistics.mean(acc), "seconds": lap.wall,
                                 "histogram": [acc.count(a) for a in range(17)]}
            if compute == "float32":
                drafts_f32 = drafts
            if drafts_f32 is not None:
                per_mode[compute]["agreement_vs_float32"] = _agreement(drafts, drafts_f32)
            del engine
        ref = per_mode.get("float32", {}).get("mean_accepted")
        for s in per_mode.values():
            s["delta_vs_float32_pct"] = 100 * (s["mean_accepted"] / ref - 1) if ref else None
        out[label] = {"model_dir": str(model_dir), "modes": per_mode}
        log.info("acceptance %s: %s", label, {c: round(s["mean_accepted"], 3) for c, s in per_mode.items()})
    return out


def ensure_proxy(args) -> Path:
    """The full target packed to QD04: a draft that does predict the target, so that the acceptance cost of
    a compute format shows even when the draft under test (e.g. the stand-in) accepts ~nothing."""
    from specdraft.cli import main as cli
    from specdraft.model.specs import resolve_model

    packed = Path(args.work) / "target-packed"
    if not (packed / "draft.qd4").is_file():
        if cli(["pack", "--checkpoint", str(resolve_model(args.target)), "--out", str(packed), "--overwrite"]):
            raise SystemExit("packing the acceptance proxy failed")
    return packed


# ------------------------------------------------------------------------------------------ HTTP phase

async def _client(host: str, port: int, bodies: list[bytes], offset: int, stop_at: float,
                  latencies: list[float], errors: list[str]) -> None:
    """One closed-loop keep-alive client: send, read the whole response, repeat until stop_at."""
    reader = writer = None
    i = offset
    while time.perf_counter() < stop_at:
        body = bodies[i % len(bodies)]
        i += 1
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            t0 = time.perf_counter()
            writer.write(b"POST /draft HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status_line = await reader.readline()
            length = 0
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            payload = await reader.readexactly(length)
            elapsed = time.perf_counter() - t0
            status = int(status_line.split()[1])
            if status == 200 and b"draft_ids" in payload:
                latencies.append(elapsed)
            else:
                errors.append(f"{status}: {payload[:200]!r}")
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            if writer is not None:
                writer.close()
            reader = writer = None
    if writer is not None:
        writer.close()


def run_clients(url: str, bodies: list[bytes], clients: int, seconds: float) -> tuple[list[float], list[str], float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    latencies: list[float] = []
    errors: list[str] = []

    async def main() -> float:
        start = time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(_client(host.strip("[]"), int(port), bodies, k * 7, stop_at, latencies, errors)
                               for k in range(clients)))
        return time.perf_counter() - start

    elapsed = asyncio.run(main())
    return latencies, errors, elapsed


def _scrape(url: str) -> dict[str, float]:
    import httpx

    return metric_values(httpx.get(url + "/metrics", timeout=10).text)


def http_bench(args, draft_dir: Path, points: list[dict[str, Any]]) -> dict[str, Any]:
    extra = ["--compute", args.server_compute, "--max-batch-size", str(args.max_batch_size),
             "--max-wait-ms", str(args.max_wait_ms)]
    if args.server_threads:
        extra += ["--threads", str(args.server_threads)]
    server = ServerProcess(draft_dir, Path(args.work) / "bench_server.log", extra)
    ready, detail = server.wait_ready(600)
    if not ready:
        raise RuntimeError(f"server did not start: {detail}")
    url = server.url
    log.info("server at %s (%s)", url, shlex.join(server.argv))
    bodies = [json.dumps({"token_ids": p["context_ids"], "num_tokens": 16}).encode() for p in points]
    levels = []
    try:
        with RssSampler(server.proc.pid, every=0.5) as rss:
            run_clients(url, bodies, 2, args.warmup)
            for clients in args.clients:
                before = _scrape(url)
                t0 = rss.elapsed()
                lat, errors, elapsed = run_clients(url, bodies, clients, args.duration)
                after = _scrape(url)
                window = rss.since(t0)
                batches = after["specdraft_iteration_rows_count"] - before.get("specdraft_iteration_rows_count", 0)
                rows = after["specdraft_iteration_rows_sum"] - before.get("specdraft_iteration_rows_sum", 0)
                level = {
                    "clients": clients, "seconds": elapsed, "requests": len(lat), "errors": len(errors),
                    "error_examples": sorted(set(errors))[:5], "rps": len(lat) / elapsed,
                    "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99),
                    "max_ms": 1000 * max(lat or [0]), "mean_batch": rows / batches if batches else 0.0,
                    "rss_mb_start": window[0] if window else None, "rss_mb_end": window[-1] if window else None,
                    "rss_mb_max": max(window) if window else None,
                }
                levels.append(level)
                log.info("%d clients: %.1f req/s, p50 %.0f ms, p99 %.0f ms, %d errors, mean batch %.1f", clients,
                         level["rps"], level["p50_ms"], level["p99_ms"], level["errors"], level["mean_batch"])
    finally:
        rc = server.stop()
    base = levels[0]["rps"] if levels and levels[0]["clients"] == 1 else None
    for level in levels:
        level["rps_vs_1_client"] = level["rps"] / base if base else None
    trace = rss.samples
    return {"server_argv": server.argv, "url": url, "levels": levels, "server_exit_code": rc,
            "rss_mb": {"samples": len(trace), "first": trace[0][1] if trace else None,
                       "last": trace[-1][1] if trace else None, "max": rss.peak_mb,
                       "trace": [(round(t, 1), round(m, 1)) for t, m in trace[:: max(1, len(trace) // 200)]]},
            "loaded_line": next((line for line in server.log_text().splitlines() if "loaded qd4" in line), None)}


# ---------------------------------------------------------------------------------------------- report

def print_report(record: dict[str, Any]) -> None:
    res = record["figures"]
    print(f"\ncommand: {record['command']}")
    print(f"draft: {res['draft']}  ({res['draft_dir']})  machine: {describe(record['machine'])}, load average "
          f"{res['load_average_start']:.1f} at start")
    lat = res.get("latency")
    if lat:
        g = lat["generate_float32"]
        print(f"\nbatch-1 latency of one {lat['num_tokens']}-token draft, {lat['contexts']} contexts x "
              f"{res['args']['repeats']} (mean context {lat['mean_context_tokens']:.0f} tokens), "
              f"torch threads {lat['threads']}; read bandwidth now {lat.get('read_gbs', 0):.1f} GB/s")
        print(f"{'':28}{'p50 ms':>9}{'p99 ms':>9}{'vs gen':>8}{'MB/tok':>8}{'floor ms':>9}{'accepted':>9}"
              f"{'Δacc %':>8}{'=f32 tok':>9}")
        print(f"{'generate (float32, HF)':28}{g['p50_ms']:9.1f}{g['p99_ms']:9.1f}{1.0:8.2f}{'':8}{'':9}"
              f"{g['mean_accepted']:9.2f}")
        for name, s in lat["modes"].items():
            agree = s.get("agreement_vs_float32", {}).get("tokens_identical", float("nan"))
            print(f"{'draft_batch ' + name:28}{s['p50_ms']:9.1f}{s['p99_ms']:9.1f}{s['speedup_vs_generate']:8.2f}"
                  f"{s['weight_bytes_per_token'] / 1e6:8.1f}{s['floor_ms']:9.1f}{s['mean_accepted']:9.2f}"
                  f"{s.get('acceptance_vs_float32_pct', 0):8.2f}{agree:9.3f}")
        print(f"(floor = 16 x weight bytes per token / {res['args']['bandwidth_gbs']} GB/s)")
    acc = res.get("acceptance")
    if acc:
        print("\nacceptance (mean accepted of 16, batches of 8; Δ vs float32 of the same weights; =f32: tokens "
              "identical to the float32 draft)")
        for label, entry in acc.items():
            cells = "  ".join(f"{c} {s['mean_accepted']:.2f} (Δ {s['delta_vs_float32_pct'] or 0:+.2f}%, "
                              f"=f32 {s.get('agreement_vs_float32', {}).get('tokens_identical', 1):.3f})"
                              for c, s in entry["modes"].items())
            print(f"  {label}: {cells}")
    http = res.get("http")
    if http:
        print(f"\nHTTP, {res['args']['duration']}s per level, server: {shlex.join(http['server_argv'][3:])}")
        print(f"{'clients':>8}{'req/s':>9}{'x 1 cl':>8}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'batch':>7}"
              f"{'RSS MB start→end (max)':>26}")
        for lv in http["levels"]:
            rss = (f"{lv['rss_mb_start']:.0f}→{lv['rss_mb_end']:.0f} ({lv['rss_mb_max']:.0f})"
                   if lv["rss_mb_start"] else "")
            print(f"{lv['clients']:8d}{lv['rps']:9.1f}{(lv['rps_vs_1_client'] or 0):8.2f}{lv['p50_ms']:9.0f}"
                  f"{lv['p99_ms']:9.0f}{lv['errors']:8d}{lv['mean_batch']:7.1f}{rss:>26}")
        print(f"server RSS first {http['rss_mb']['first']:.0f} MB, last {http['rss_mb']['last']:.0f} MB, "
              f"max {http['rss_mb']['max']:.0f} MB; exit code {http['server_exit_code']}")


def main(argv: list[str] | None = None) -> int:
    p = argument_parser(__doc__)
    add_out_argument(p)
    p.add_argument("--draft-dir", help="packed draft dir (default: build the stand-in)")
    p.add_argument("--float-dir", help="float HF dir for the generate() baseline (default: the packed dir "
                                       "dequantised to float32)")
    p.add_argument("--target", default="embedded:smollm2-135m-instruct", help="target model spec")
    p.add_argument("--standin-layers", type=int, default=6, help="layers of the target kept by the stand-in")
    p.add_argument("--work", default="runs/bench_server", help="cache dir for the stand-in and eval points")
    p.add_argument("--validation", help="validation.jsonl to take contexts and target tokens from")
    p.add_argument("--points", type=int, default=48, help="evaluation points (contexts) to use")
    p.add_argument("--repeats", type=int, default=2, help="timing passes over the contexts (latency part)")
    p.add_argument("--computes", default="float32,bfloat16,int4",
                   help="compute formats to time; a '/hf' suffix (int4/hf) times the same format with decode steps "
                        "through transformers' forward instead of specdraft.lean")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the latency part")
    p.add_argument("--bandwidth-gbs", type=float, default=22.0, help="memory read bandwidth for the floor")
    p.add_argument("--server-compute", default="int4", choices=["float32", "bfloat16", "int4"])
    p.add_argument("--server-threads", type=int, default=None, help="--threads for the server")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--clients", default="1,8,32", help="client counts for the HTTP part")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per client level (target figure: 300)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of warm-up traffic before the levels")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--skip-acceptance", action="store_true")
    p.add_argument("--acceptance-proxy", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the formats' acceptance on the full target packed to QD04")
    args = p.parse_args(argv)
    args.computes = [c.strip() for c in args.computes.split(",") if c.strip()]
    args.clients = [int(c) for c in args.clients.split(",")]
    log_to_console()

    draft_dir, description = ensure_draft(args)
    points = eval_points(args, draft_dir)
    res: dict[str, Any] = {"args": vars(args), "draft": description, "draft_dir": str(draft_dir),
                           "points": len(points), "load_average_start": os.getloadavg()[0]}
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if not args.skip_latency:
        read_gbs = measure_read_bandwidth()
        res["latency"] = {**latency_bench(args, draft_dir, points, read_gbs), "read_gbs": read_gbs}
    if not args.skip_acceptance:
        dirs = {"draft": draft_dir}
        if args.acceptance_proxy:
            dirs["proxy: full target, packed"] = ensure_proxy(args)
        res["acceptance"] = acceptance_bench(args, dirs, points)
    if not args.skip_http:
        res["http"] = http_bench(args, draft_dir, points)
    res["load_average_end"] = os.getloadavg()[0]
    print_report(read_json(save_result("server", res, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
