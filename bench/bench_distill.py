"""Offline distillation from the target's stored top-K against today's recipe (cross-entropy on the target's
tokens), side by side on one machine (issue 33, items 1-2).

From a demo run dir (its prompts and validation points, `specdraft demo`), for each variant: the traces (the
same prompts; with ``--top-logprobs K`` for the distilling variants), training from the same init with the demo
budget's recipe, the pack, and acceptance of the packed draft on the run's validation points (in process, int4,
as the server computes). Reports each stage's wall time, the traces' bytes, and acceptance, after every variant, to
``bench/results/distill.<cpu class>.json`` and --out.

    .venv/bin/python bench/bench_distill.py --run-dir runs/demo --out bench/out/distill.json --budget small \
        --variants ce kd16 --kd-weight 0.5
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import add_out_argument, argument_parser, save_result, stopwatch
from specdraft.core.io import read_json
from specdraft.demo import BUDGETS, DemoConfig, draft_start
from specdraft.stages.evaluate import EvalConfig, run_eval
from specdraft.stages.label import LabelConfig, run_label
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.traces import TracesConfig, run_traces
from specdraft.stages.train import TrainConfig, run_train


def variant_settings(name: str) -> tuple[int, bool, bool]:
    """(top_logprobs, kd_stored, on_policy) of a variant name: ``ce`` (today's recipe) or ``kdK`` (stored top-K),
    with ``-op`` for on-policy labels added (the init draft's continuations of the traced prompts, labelled by the
    target: `specdraft label --answers-from RUN_DIR/init`)."""
    base, on_policy = (name[:-3], True) if name.endswith("-op") else (name, False)
    if base == "ce":
        return 0, False, on_policy
    if base.startswith("kd") and base[2:].isdigit():
        return int(base[2:]), True, on_policy
    raise ValueError(f"variant {name!r}: ce or kdK (e.g. kd16), optionally with -op")


def recipe_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set lr=2e-3 warmup_steps=2`` -> TrainConfig fields over the budget's recipe (values parsed as JSON,
    else kept as text; TrainConfig validates them)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in TrainConfig.model_fields:
            raise ValueError(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of TrainConfig's fields")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run_variant(name: str, args, work: Path) -> dict[str, Any]:
    top_k, kd, on_policy = variant_settings(name)
    budget = BUDGETS[args.budget]
    trace_prompts = args.trace_prompts or budget.trace_prompts
    trace_tokens = args.trace_tokens or budget.trace_tokens
    init, frozen = draft_start(DemoConfig(), budget)
    out: dict[str, Any] = {"variant": name, "top_logprobs": top_k, "kd_stored": kd, "kd_weight": args.kd_weight,
                           "on_policy": on_policy}
    run_name = name + args.tag
    # --traces-top K: every variant reads one traces file written with K (the tokens are the same; ce ignores
    # the stored distribution), which halves the traces' cost of a comparison
    written_k = args.traces_top if args.traces_top is not None else top_k
    if written_k < top_k:
        raise ValueError(f"variant {name}: needs traces with top-{top_k}, --traces-top is {written_k}")
    traces = work / f"traces_top{written_k}" / "traces.jsonl"
    summary_path = traces.with_name("traces.summary.json")
    # resumed up to the prompts asked for (the summary records its rows): a larger --trace-prompts decodes only the
    # prompts not traced yet
    if not summary_path.is_file() or read_json(summary_path)["rows"] < trace_prompts:
        run_traces(TracesConfig(prompts=args.run_dir / "prompts" / "prompts.jsonl", out=traces,
                                max_new_tokens=trace_tokens, limit=trace_prompts, top_logprobs=written_k))
    summary = read_json(summary_path)
    out["traces"] = {"seconds": summary["this_run"].get("wall_s"), "bytes": traces.stat().st_size,
                     "completion_tokens": summary["completion_tokens"],
                     "tokens_per_s": summary["this_run"].get("completion_tokens_per_s")}
    labels = work / "labels_on_policy" / "labels.jsonl"
    if on_policy:
        if not labels.is_file():
            run_label(LabelConfig(prompts=str(args.run_dir / "prompts" / "prompts.jsonl"), out=str(labels),
                                  answers_from=str(args.run_dir / "init"), max_new_tokens=trace_tokens,
                                  limit=trace_prompts, min_answer_tokens=1, threads=args.threads))
        out["labels"] = {"seconds": read_json(labels.with_name("labels.summary.json"))["wall_s"],
                         "bytes": labels.stat().st_size}
    pack_cfg = PackConfig(checkpoint=str(work / run_name / "draft"), out=str(work / run_name / "model"),
                          overwrite=True)
    recipe = {"epochs": args.epochs or budget.epochs, "lr": budget.lr, "freeze_layers": frozen}
    recipe |= recipe_overrides(args.set)
    out["recipe"] = recipe
    with stopwatch() as training:
        meta = run_train(TrainConfig(traces=str(traces), init=init, out=str(work / run_name / "draft"),
                                     threads=args.threads, kd_stored=kd, kd_weight=args.kd_weight, seed=args.seed,
                                     labels=str(labels) if on_policy else None,
                                     qat_group_size=pack_cfg.group_size if budget.qat else None, **recipe))
    out["train"] = {"seconds": round(training.wall, 1), "steps": meta.get("steps"), "best": meta.get("best")}
    run_pack(pack_cfg)
    with stopwatch() as evaluation:
        run_eval(EvalConfig(validation=args.run_dir / "validation" / "validation.jsonl",
                            model_dir=Path(pack_cfg.out), compute="int4", out=work / run_name / "eval",
                            threads=args.threads))
    report = read_json(work / run_name / "eval" / "report.json")
    out["acceptance"] = {"pooled": report["mean_accepted_pooled"], "per_prompt": report["mean_accepted_per_prompt"],
                         "points": report["points"]}
    out["eval_seconds"] = round(evaluation.wall, 1)
    return out


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--run-dir", type=Path, required=True, help="a `specdraft demo` run dir (prompts, validation)")
    add_out_argument(ap)
    ap.add_argument("--work-dir", type=Path, default=None, help="default: OUT without .json")
    ap.add_argument("--budget", default="small", choices=sorted(BUDGETS))
    ap.add_argument("--variants", nargs="+", default=["ce", "kd16"])
    ap.add_argument("--kd-weight", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=float, default=None, help="override the budget's epochs")
    ap.add_argument("--trace-prompts", type=int, default=None,
                    help="override the budget's traced prompts (an existing traces file is resumed up to it)")
    ap.add_argument("--trace-tokens", type=int, default=None,
                    help="override the budget's tokens per trace (a work dir holds one traces length)")
    ap.add_argument("--traces-top", type=int, default=None, help="one traces file with this top-K for every variant")
    ap.add_argument("--tag", default="", help="suffix of the variants' dirs (the traces are shared per K)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="train recipe fields over the budget's (e.g. lr=2e-3 warmup_steps=2 freeze_layers=18)")
    args = ap.parse_args()
    work = args.work_dir or args.out.with_suffix("")
    results = {"config": {k: str(v) for k, v in vars(args).items()}, "variants": []}
    for name in args.variants:
        results["variants"].append(run_variant(name, args, work))
        save_result("distill", results, args.out)
        print(json.dumps(results["variants"][-1], indent=1, default=str))


if __name__ == "__main__":
    main()
