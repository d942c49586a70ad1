"""What keeping the target's top-K distribution costs the traces stage: the same prompts decoded with
``--top-logprobs 0`` and ``K`` alternately (so drift on a shared machine hits both), decode seconds and bytes.
The result goes to ``bench/results/topk_cost.<cpu class>.json`` and to --out (the traces to OUT without .json).

    .venv/bin/python bench/bench_topk_cost.py --prompts RUN_DIR/prompts/prompts.jsonl --limit 48 --max-new-tokens 64 \
        --top-k 16 --repeats 2 --out bench/out/topk_cost.json
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness import add_out_argument, argument_parser, save_result
from specdraft.core.io import read_json
from specdraft.stages.traces import TracesConfig, run_traces


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--prompts", type=Path, required=True)
    add_out_argument(ap, beside="; the traces go to OUT without .json")
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
    figures = {"config": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    save_result("topk_cost", figures, args.out)


if __name__ == "__main__":
    main()
