"""A packed draft on every MT-bench question, both turns (the second asked after the target's own first answer):
the draft alone, prompt lookup, and the draft behind lookup with its rule measured, per turn, category and context
length.

  .venv/bin/python bench/bench_mt_bench.py --model-dir runs/demo/model --work runs/bench_mt_bench

The small demo evaluates 16 of MT-bench's 80 questions (about 2 points a category and turn); this evaluates every
question with the small budget's settings (first answers of 128 target tokens, points every 16 tokens of 32 scored
target tokens after each turn's prompt), so that each category holds enough points to read. As in the demo, the
hybrid's rule is chosen on every other prompt of each category and reported on the others (``--choose-hybrid-rule``);
the draft and lookup are reported over every point too. The first answers and the points are decoded once into
``--work`` (a rerun reuses them); the evaluation runs in process. ``--validation`` scores points decoded elsewhere
instead (a demo's own ``mt_bench/validation.jsonl``, with its budget's answer lengths):

  .venv/bin/python bench/bench_mt_bench.py --model-dir runs/demo_default/model --work runs/bench_mt_bench_default \
      --validation runs/demo_default/mt_bench/validation.jsonl --name demo_default

Result: ``bench/results/mt_bench_<name>.<cpu class>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from harness import argument_parser, log_to_console, save_result, stopwatch
from specdraft.core.io import atomic_write_text, jsonl_line, read_json
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.data.mt_bench import interleave_categories, read_mt_bench
from specdraft.demo.budgets import BUDGETS
from specdraft.demo.config import REPO_ROOT
from specdraft.drafting.mt_bench import write_mt_bench_points
from specdraft.model.specs import DEFAULT_TARGET
from specdraft.model.trace_backend import HFBackend
from specdraft.stages.evaluate import EvalConfig, run_eval
from specdraft.stages.traces import TracesConfig, run_traces


def means(per_point: list[dict[str, Any]], field: str) -> dict[str, Any]:
    """Mean accepted of ``field`` over every point, per turn and per category."""
    groups: dict[str, list[int]] = {}
    for point in per_point:
        category = point["category"]
        for key in ("all", category.split("/")[0], category):
            groups.setdefault(key, []).append(point[field])
    return {key: {"points": len(values), "mean": round(sum(values) / len(values), 3)}
            for key, values in sorted(groups.items())}


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", required=True, help="the packed draft (config.json + draft.qd4)")
    ap.add_argument("--work", type=Path, required=True, help="folder for the answers, points and evaluation")
    ap.add_argument("--mt-bench", type=Path, default=REPO_ROOT.parent / "shared" / "data" / "dev" / "mt_bench.jsonl")
    ap.add_argument("--questions", type=int, default=80, help="MT-bench questions, round-robin over the categories")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="demo_small", help="the result's name: mt_bench_NAME.<cpu class>.json")
    ap.add_argument("--validation", type=Path, default=None,
                    help="score these points (a demo's mt_bench/validation.jsonl) instead of decoding the small "
                         "budget's into --work")
    args = ap.parse_args()
    log_to_console()
    torch.set_num_threads(args.threads)
    budget = BUDGETS["small"]
    args.work.mkdir(parents=True, exist_ok=True)
    validation = args.validation or args.work / "validation.jsonl"
    with stopwatch() as decoding:
        if args.validation is None:
            points, questions = decode_points(args, budget), args.questions
        else:
            rows = [json.loads(line) for line in args.validation.open() if line.strip()]
            points, questions = {"points": len(rows)}, len({row["id"].rsplit("-", 1)[0] for row in rows})
    with stopwatch() as evaluating:
        run_eval(EvalConfig(validation=validation, model_dir=args.model_dir,
                            out=args.work / "eval", target=DEFAULT_TARGET, threads=args.threads,
                            choose_hybrid_rule=True, temperatures=[]))
    report = read_json(args.work / "eval" / "report.json")
    rule = report["hybrid_rule"]
    save_result(f"mt_bench_{args.name}", {
        "model_dir": args.model_dir, "questions": questions,
        # what --compute auto measured fastest here: near-equal formats may flip between runs, and with them a
        # near-tie token of the draft's
        "compute": {k: report["drafter_source"]["compute_choice"][k] for k in ("compute", "prefill")},
        "points": points["points"], "validation": str(validation),
        **({"answer_tokens": budget.mt_bench_answer_tokens, "scored_tokens": budget.mt_bench_eval_tokens}
           if args.validation is None else {}),
        "draft": means(report["per_point"], "accepted"), "lookup": means(report["per_point"], "lookup_accepted"),
        "hybrid_rule": {"chosen": rule["chosen"], "chosen_words": rule["chosen_words"], "split": rule["split"],
                        "reported": rule["reported"], "guided_check": rule.get("guided_check")},
        "decode_seconds": round(decoding.wall, 1), "eval_seconds": round(evaluating.wall, 1)})


def decode_points(args, budget) -> dict[str, Any]:
    """The small budget's first answers and points for --questions questions, into --work (reused on a rerun)."""
    questions = interleave_categories(read_mt_bench(args.mt_bench), args.questions)
    listed = args.work / "questions.jsonl"
    atomic_write_text(listed, "".join(jsonl_line(q.to_json()) + "\n" for q in questions))
    answers = TracesConfig(target=DEFAULT_TARGET, prompts=listed, out=args.work / "answers.jsonl",
                           max_new_tokens=budget.mt_bench_answer_tokens)
    run_traces(answers)
    return write_mt_bench_points(args.work / "validation.jsonl", questions, listed, answers.out, DEFAULT_TARGET,
                                 lambda: HFBackend(DEFAULT_TARGET, "cpu", answers.batch_size), DRAFT_TOKENS,
                                 budget.mt_bench_eval_tokens)


if __name__ == "__main__":
    main()
