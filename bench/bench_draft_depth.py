"""Acceptance against draft cost: drafts of several depths cut from the embedded target, trained on the same
traces with the same recipe, side by side (issue 33, item 5).

For each ``--depth N=LAYERS`` (layer ids of the target, as ``truncate:`` takes them): train from that cut (the first
half of its layers frozen, as the 24-layer default freezes 12), pack with the defaults, score the packed draft on the
validation points (in process, int4, as the server computes), export it as GGUF; then the cost of one draft decode
step relative to one target decode step, on a 96-token context:

- specdraft's engine: the packed draft's eager lean step (int4) against the float32 target's step, both as
  `specdraft speculate` runs them (``harness.forward_seconds``; CPU time, median of repeats);
- llama.cpp: one-token ``llama_decode`` of the draft's GGUF against the embedded target's GGUF (wall time, median).

The result goes to ``bench/results/draft_depth.<cpu class>.json`` and to --out, after every depth.

    .venv/bin/python bench/bench_draft_depth.py --traces TRACES.jsonl --validation VALIDATION.jsonl --out depth.json \
        --depth 12=0-7,26-29 --depth 16=0-11,26-29 --depth 24=0-15,22-29 --epochs 1 --threads 1
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from harness import add_out_argument, argument_parser, forward_seconds, median, save_result, stopwatch, timed
from specdraft.core.io import read_json
from specdraft.demo import BUDGETS
from specdraft.model.loader import load_draft
from specdraft.model.specs import DEFAULT_TARGET, embedded_gguf_path, load_model
from specdraft.stages.evaluate import EvalConfig, run_eval
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.train import TrainConfig, run_train

CONTEXT = 96


def layer_ids(spec: str) -> list[int]:
    """``0-7,26-29`` -> [0..7, 26..29]."""
    ids: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ids += list(range(int(lo), int(hi or lo) + 1))
    return ids


def llama_step_seconds(gguf: Path, threads: int, repeats: int) -> float:
    """Median wall time of one one-token decode in llama.cpp after a CONTEXT-token prefill."""
    from specdraft.model.llamacpp import LlamaCppModel

    model = LlamaCppModel(gguf, n_ctx=512, threads=threads)
    try:
        context = list(range(100, 100 + CONTEXT))
        model.decode(context, 0)
        # the first calls warm llama.cpp's buffers
        return median(timed(lambda: model.decode([5], CONTEXT), repeats, warmup=2))
    finally:
        model.close()


def run_depth(name: str, layers: list[int], args, target) -> dict[str, Any]:
    work = args.work_dir / f"depth{name}"
    budget = BUDGETS[args.budget]
    init = f"truncate:{DEFAULT_TARGET}:{','.join(map(str, layers))}"
    out: dict[str, Any] = {"depth": len(layers), "layers": layers, "init": init, "frozen": len(layers) // 2}
    draft_dir = work / "draft"
    with stopwatch() as training:
        if not (draft_dir / "train_meta.json").is_file():
            run_train(TrainConfig(traces=str(args.traces), init=init, out=str(draft_dir),
                                  epochs=args.epochs or budget.epochs, lr=budget.lr, freeze_layers=len(layers) // 2,
                                  threads=args.threads, seed=args.seed))
    meta = read_json(draft_dir / "train_meta.json")
    out["train"] = {"seconds": round(training.wall, 1), "steps": meta.get("steps"), "best": meta.get("best")}
    pack = work / "model"
    run_pack(PackConfig(checkpoint=str(draft_dir), out=str(pack), overwrite=True))
    run_eval(EvalConfig(validation=args.validation, model_dir=pack, compute="int4", out=work / "eval",
                        threads=args.threads))
    report = read_json(work / "eval" / "report.json")
    out["acceptance"] = {"pooled": report["mean_accepted_pooled"], "per_prompt": report["mean_accepted_per_prompt"],
                         "points": report["points"]}
    gguf = work / "draft.gguf"
    run_export(ExportConfig(model_dir=str(pack), format="gguf", out=str(gguf), overwrite=True))
    model, _ = load_draft(pack, "int4")
    # Side by side, alternated, so that a slow spell on a shared machine hits both
    engine, llama = [], []
    for _ in range(args.rounds):
        engine.append(forward_seconds(model, 1, CONTEXT, args.repeats, "cpu", "lean")
                      / forward_seconds(target, 1, CONTEXT, args.repeats, "cpu", "model"))
        target_gguf = embedded_gguf_path(DEFAULT_TARGET.split(":")[-1])
        llama.append(llama_step_seconds(gguf, args.threads, args.repeats)
                     / llama_step_seconds(target_gguf, args.threads, args.repeats))
    out["cost_vs_target"] = {"specdraft_int4_lean": median(engine), "llama_cpp": median(llama),
                             "rounds": args.rounds}
    return out


def main() -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--traces", type=Path, required=True)
    ap.add_argument("--validation", type=Path, required=True)
    add_out_argument(ap)
    ap.add_argument("--work-dir", type=Path, default=None, help="default: OUT without .json")
    ap.add_argument("--depth", action="append", required=True, metavar="NAME=LAYERS", help="e.g. 12=0-7,26-29")
    ap.add_argument("--budget", default="default", choices=sorted(BUDGETS), help="the recipe (lr) to train with")
    ap.add_argument("--epochs", type=float, default=None, help="override the budget's epochs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.work_dir = args.work_dir or args.out.with_suffix("")
    torch.set_num_threads(args.threads)
    target = load_model(DEFAULT_TARGET)
    results: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "depths": []}
    for item in args.depth:
        name, _, spec = item.partition("=")
        results["depths"].append(run_depth(name, layer_ids(spec), args, target))
        save_result("draft_depth", results, args.out)
        print(json.dumps(results["depths"][-1], default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
