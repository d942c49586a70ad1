"""Each compute format on this CPU, and what ``--compute auto`` picks: a draft's decode step, its prefill of 64 / 256 /
1,024 tokens, and one ``POST /draft`` answer (16 tokens) from `specdraft serve`, side by side in one run.

  .venv/bin/python bench/bench_compute.py --model-dir runs/demo/model

In process (1 thread, the server's default on 2 cores): ``load_engine`` with each format, then per context length the
median of ``--repeats`` timings of ``draft([context], 1)`` (the prefill and the first token) and of
``draft([context], 17)``; a decode step is their difference over 16. Over HTTP: `specdraft serve --compute X` per
format (and with its default, auto), one request at a time, the median answer time per context length; every request
is a context the server has not seen (its prefix cache would answer a repeated one from a hit). The result
goes to ``bench/results/compute.<cpu class>.json``; BENCHMARKS.md's table per CPU class is read from it.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from harness import argument_parser, log_to_console, machine_record, median, metric_values, timed, write_result
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench")

# (name, serve flags): every explicit format, then the default
FORMATS = [("float32", ["--compute", "float32"]), ("bfloat16", ["--compute", "bfloat16"]),
           ("int4, bfloat16 prefill", ["--compute", "int4", "--int4-prefill", "bfloat16"]),
           ("int4, float32 prefill", ["--compute", "int4", "--int4-prefill", "float32"]),
           ("int4, int4 prefill", ["--compute", "int4", "--int4-prefill", "int4"]),
           ("auto (default)", [])]
CONTEXTS = (64, 256, 1024)


def contexts(vocab: int, seed: int = 0) -> dict[int, list[int]]:
    rng = random.Random(seed)
    return {n: [rng.randrange(vocab) for _ in range(n)] for n in CONTEXTS}


def in_process(model_dir: Path, flags: list[str], ctx: dict[int, list[int]], repeats: int) -> dict[str, Any]:
    """Prefill (+ first token) and decode-step seconds per context length, in this process at 1 thread."""
    import torch

    from specdraft.server.engine import load_engine

    torch.set_num_threads(1)
    compute = flags[flags.index("--compute") + 1] if "--compute" in flags else "auto"
    prefill = flags[flags.index("--int4-prefill") + 1] if "--int4-prefill" in flags else "bfloat16"
    engine = load_engine(model_dir, None, compute, prefill=prefill)
    out: dict[str, Any] = {"compute": engine.compute, "choice": engine.compute_choice}
    for n, c in ctx.items():
        first = median(timed(lambda: engine.draft([c], 1), repeats))
        full = median(timed(lambda: engine.draft([c], 17), repeats))
        out[f"prefill_{n}_s"] = round(first, 4)
        out[f"decode_step_{n}_s"] = round((full - first) / 16, 5)
    return out


def served(model_dir: Path, flags: list[str], ctx: dict[int, list[int]], repeats: int, work: Path,
           serve_args: list[str], vocab: int) -> dict[str, Any]:
    """Median seconds of one 16-token ``/draft`` answer per context length, one request at a time, each request a
    context the server has not seen."""
    name = "_".join(flags[1::2]) or "auto"
    with ServerProcess(model_dir, work / f"serve_{name}.log", [*flags, *serve_args]) as server:
        ok, detail = server.wait_ready(600)
        if not ok:
            raise RuntimeError(detail)
        with httpx.Client(base_url=server.url, timeout=600, trust_env=False) as http:
            health = http.get("/health").json()
            out: dict[str, Any] = {"compute": health.get("compute"),
                                   "prefill": (health.get("compute_choice") or {}).get("prefill")}
            for n, c in ctx.items():
                fresh = unseen_contexts(c, vocab)

                def answer() -> None:
                    r = http.post("/draft", json={"token_ids": next(fresh), "num_tokens": 16})
                    r.raise_for_status()
                out[f"answer_{n}_s"] = round(median(timed(answer, repeats)), 4)
            # the prefix cache would turn a repeated context into a hit: each request is new, so none reused a token
            out["context_tokens_reused"] = metric_values(http.get("/metrics").text).get(
                "specdraft_context_tokens_reused_total", 0.0)
            if out["context_tokens_reused"]:
                raise RuntimeError(f"{flags}: the server reused {out['context_tokens_reused']} cached context tokens")
    return out


def unseen_contexts(context: list[int], vocab: int) -> Iterator[list[int]]:
    """The same context with a different first token at each call: as long, but no block of it cached before."""
    for shift in itertools.count(1):
        yield [(context[0] + shift) % vocab, *context[1:]]


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", type=Path, default=Path("runs/demo/model"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("runs/bench_compute"))
    ap.add_argument("--serve-args", default="--threads 1", help="more `specdraft serve` flags for every server")
    ap.add_argument("--only", nargs="*", help="these formats only (names as in the table)")
    args = ap.parse_args(argv)
    log_to_console()
    args.work.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    ctx = contexts(vocab)
    rows: dict[str, Any] = {}
    for name, flags in FORMATS:
        if args.only and name not in args.only:
            continue
        log.info("%s: in process", name)
        rows[name] = {"in_process": in_process(args.model_dir, flags, ctx, args.repeats)}
        log.info("%s: over HTTP", name)
        rows[name]["served"] = served(args.model_dir, flags, ctx, args.repeats, args.work, shlex.split(args.serve_args),
                                   vocab)
        log.info("%s: %s", name, rows[name])
    explicit = [r["served"] for n, r in rows.items() if n != "auto (default)"]
    figures: dict[str, Any] = {"model_dir": str(args.model_dir), "repeats": args.repeats, "formats": rows}
    if "auto (default)" in rows and explicit:
        auto = rows["auto (default)"]["served"]
        figures["auto_vs_fastest_explicit"] = {
            n: round(auto[f"answer_{n}_s"] / min(r[f"answer_{n}_s"] for r in explicit), 3) for n in CONTEXTS}
    path = write_result("compute", figures)
    print(f"machine: {machine_record()['cpu']}; written {path}")
    print(render(figures))
    return 0


def render(figures: dict[str, Any]) -> str:
    lines = ["| compute | decode step (ms) | prefill 64 / 256 / 1,024 (ms) | `/draft` answer 64 / 256 / 1,024 (s) |",
             "|---|---:|---:|---:|"]
    for name, row in figures["formats"].items():
        p, s = row["in_process"], row["served"]
        label = name if not name.startswith("auto") else f"{name} → {s['compute']}" + (
            f", {s['prefill']} prefill" if s["compute"] == "int4" else "")
        lines.append(f"| {label} | {1000 * p['decode_step_256_s']:.1f} | "
                     + " / ".join(f"{1000 * p[f'prefill_{n}_s']:.0f}" for n in CONTEXTS) + " | "
                     + " / ".join(f"{s[f'answer_{n}_s']:.2f}" for n in CONTEXTS) + " |")
    ratios = figures.get("auto_vs_fastest_explicit")
    if ratios:
        lines.append("")
        lines.append("auto / fastest explicit, per context length: "
                     + ", ".join(f"{n}: {r:.2f}x" for n, r in ratios.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
