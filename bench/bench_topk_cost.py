"""What keeping the target's top-K distribution costs the traces stage: the same prompts decoded with
``--top-logprobs 0`` and ``K`` alternately (so drift on a shared machine hits both), decode seconds and bytes.

    python bench/bench_topk_cost.py --prompts RUN_DIR/prompts/prompts.jsonl --limit 48 --max-new-tokens 64 \
        --top-k 16 --repeats 2 --out bench/out/topk_cost.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from specdraft.core.io import atomic_write_json, read_json
from specdraft.stages.traces import TracesConfig, run_traces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = args.out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)
    runs = []
    for rep in range(args.repeats):
        for k in (0, args.top_k):
            traces = work / f"r{rep}_k{k}" / "traces.jsonl"
            run_traces(TracesConfig(prompts=args.prompts, out=traces, max_new_tokens=args.max_new_tokens,
                                    limit=args.limit, top_logprobs=k))
            this = read_json(traces.with_name("traces.summary.json"))["this_run"]
            runs.append({"top_logprobs": k, "repeat": rep, "decode_s": this["wall_s"],
                         "tokens_per_s": this["completion_tokens_per_s"], "bytes": traces.stat().st_size})
            print(json.dumps(runs[-1]), flush=True)
    atomic_write_json(args.out, {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs})


if __name__ == "__main__":
    main()
