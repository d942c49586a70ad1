"""RSS of the draft engine over many steps of varying shapes, with and without malloc_trim after each step.

The server's model step in process (no HTTP): ``--calls`` drafts of 16 tokens, each a batch of 1..32 random
contexts of 20..400 tokens (seeded, so every variant sees the same sequence of shapes). Each variant runs in
its own subprocess, one after the other; RSS (from /proc/self/statm) is sampled every 10 calls. With trimming,
glibc's ``malloc_trim(0)`` (``specdraft.server.engine.heap_trimmer``) follows every step; `specdraft serve` trims
after its iterations, at most once a second. The result goes to ``bench/results/memory.<cpu class>.json`` and to
--out.

    .venv/bin/python bench/bench_memory.py --model-dir runs/demo/model            # about 10 minutes
    .venv/bin/python bench/bench_memory.py --model-dir runs/demo/model --calls 20  # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from typing import Any, Callable

import torch

from harness import add_out_argument, argument_parser, median, rss_mb, save_result, stopwatch
from specdraft.server.engine import heap_trimmer, load_engine

Step = Callable[[list[list[int]], int], Any]


def trimmed(step: Step) -> Step:
    """``step`` followed by ``malloc_trim(0)``, also when the step fails (its buffers were freed all the same)."""
    trim = heap_trimmer()
    if trim is None:
        raise SystemExit("no glibc malloc_trim here: nothing to compare")

    def run(contexts: list[list[int]], n: int) -> Any:
        try:
            return step(contexts, n)
        finally:
            trim()
    return run


def child(model_dir: str, trim: bool, calls: int, seed: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    engine = load_engine(model_dir, None, "int4")
    step = trimmed(engine.draft) if trim else engine.draft
    rng = random.Random(seed)
    samples, times = [(0, rss_mb())], []
    for i in range(1, calls + 1):
        contexts = [[rng.randrange(3, engine.vocab_size) for _ in range(rng.randint(20, 400))]
                    for _ in range(rng.randint(1, 32))]
        with stopwatch() as lap:
            step(contexts, 16)
        times.append(lap.wall)
        if i % 10 == 0:
            samples.append((i, rss_mb()))
    return {"trim": trim, "rss_mb": samples, "median_step_s": median(times), "total_step_s": sum(times)}


def main(argv=None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("--model-dir", required=True, help="packed draft dir")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    add_out_argument(p, "bench_memory.json")
    p.add_argument("--child", choices=["trim", "no-trim"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model_dir, args.child == "trim", args.calls, args.seed, args.threads)))
        return 0
    results: dict[str, Any] = {"variants": {}}
    for variant in ("no-trim", "trim"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--model-dir", args.model_dir,
                              "--calls", str(args.calls), "--seed", str(args.seed), "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout
        results["variants"][variant] = json.loads(out.strip().splitlines()[-1])
        print(variant, results["variants"][variant]["rss_mb"][::2], flush=True)
    save_result("memory", results, args.out)
    print("\n| malloc_trim after each step | RSS MB after load | after 10 calls | at the end | max | median step s |\n"
          "|---|---:|---:|---:|---:|---:|")
    for variant, r in results["variants"].items():
        rss = [m for _, m in r["rss_mb"]]
        print(f"| {'yes' if r['trim'] else 'no'} | {rss[0]:.0f} | {rss[1]:.0f} | {rss[-1]:.0f} | {max(rss):.0f} | "
              f"{r['median_step_s']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
