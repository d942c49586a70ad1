"""What training rows in conversations add (`specdraft conversations`): drafts trained at the small demo budget's
recipe on single-turn traces only, and on the same number of rows with part of them spent on rows whose context holds
the target's own first answer, measured on MT-bench (both turns) and the packaged held-out set, per category, against
prompt lookup.

    .venv/bin/python bench/bench_multiturn_data.py --threads 1 --eval-prompts 30 --mt-bench-questions 16
    .venv/bin/python bench/bench_multiturn_data.py --variants baseline,followup --work runs/bench_multiturn

(the first: the recorded result, about 40 minutes at one torch thread on a shared 2-core machine; one thread,
because OpenMP's spinning makes two threads far slower where another process holds a core)

Data: the prompts stage on ``configs/manifest.shared.json`` when ``../shared/data`` is there (else the packaged
corpus), decontaminated against the packaged held-out set and MT-bench (every turn), as the demo builds them. The
variants, each ``--rows`` training rows of ``--trace-tokens`` target tokens at most:

baseline  the first ``--rows`` prompts traced (the small budget's traces);
followup  the first ``rows - new`` prompts traced (the first turns), then ``new`` = ``--new-share`` of the rows as
          conversations: a first turn, the target's own answer, a follow-up (ShareGPT's own second turn where the
          prompt came from a ShareGPT chat, else a packaged one), the target's greedy answer;
passage   the same first turns, then ``new`` rows of a packaged request (summarise, translate, answer from the text)
          around the text of a first answer;
control   the same first turns, then ``new`` other single-turn prompts traced (prompts ``rows`` to ``rows + new``
          of the file): how far swapping that many single-turn rows moves the figures by itself, the noise the
          other variants' differences are read against.

The baseline's traces are the first turns' file resumed with ``--limit rows`` (the last prompts only are decoded),
so every variant shares the same first turns, and the baseline's tracing time is the two runs' sum. Each variant's
draft trains as the small budget's does (``DRAFT_INIT``, 1 epoch, lr 5e-4, every layer, QAT at the pack's group
size), is packed, and evaluated in process (greedy, k 16, ``--choose-hybrid-rule`` so lookup is scored beside it at
every point): on the first ``--eval-prompts`` of the held-out set (``--eval-tokens`` target tokens each) and on both
turns of ``--mt-bench-questions`` MT-bench questions (first answers of ``--mt-bench-answer-tokens``, the small
budget's 128). Reported per variant: the wall and CPU seconds it cost (tracing, conversations, training), its rows
and tokens, and mean accepted tokens (of 16, pooled over points) overall, per turn and per category, the draft's and
lookup's, and the ratios to the baseline. Each step leaves a marker in ``--work`` so that a killed run resumes.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from harness import add_out_argument, argument_parser, log_to_console, save_result, stopwatch
from specdraft.core.io import atomic_write_json, atomic_write_text, jsonl_line, read_json
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.data.corpus import heldout_path
from specdraft.data.mt_bench import interleave_categories, read_mt_bench
from specdraft.demo.budgets import BUDGETS
from specdraft.demo.config import REPO_ROOT
from specdraft.drafting.metrics import paired_difference as paired_difference_over_prompts
from specdraft.drafting.mt_bench import write_mt_bench_points
from specdraft.model.specs import DEFAULT_TARGET
from specdraft.model.trace_backend import HFBackend
from specdraft.stages.conversations import ConversationsConfig, run_conversations
from specdraft.stages.evaluate import EvalConfig, run_eval
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.prompts import PromptsConfig, build_prompts
from specdraft.stages.traces import TracesConfig, ValidationConfig, run_traces, run_validation
from specdraft.stages.train import TrainConfig, run_train

VARIANTS = ("baseline", "followup", "passage", "control")
SHARED = REPO_ROOT.parent / "shared" / "data"


class Steps:
    """Each step once: its wall and CPU seconds kept in a marker (``WORK/.timings/NAME.json``), so a rerun skips it."""

    def __init__(self, work: Path):
        self.dir = work / ".timings"
        self.dir.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, fn: Callable[[], Any]) -> dict[str, Any]:
        marker = self.dir / f"{name}.json"
        if marker.is_file():
            return read_json(marker)
        with stopwatch() as lap:
            result = fn()
        record = {"wall_s": round(lap.wall, 2), "cpu_s": round(lap.cpu, 2), "result": result}
        atomic_write_json(marker, record)
        return record


def accepted_by_group(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Mean accepted tokens, the draft's and lookup's, pooled over points: all, per turn (``turnN/`` categories)
    and per category."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in report["per_point"]:
        groups["all"].append(row)
        groups[row["category"]].append(row)
        if row["category"].startswith("turn"):
            groups[row["category"].split("/")[0]].append(row)
    return {name: {"points": len(rows), "draft": round(sum(r["accepted"] for r in rows) / len(rows), 3),
                   "lookup": round(sum(r["lookup_accepted"] for r in rows) / len(rows), 3)}
            for name, rows in sorted(groups.items())}


def paired_difference(report: dict[str, Any], baseline: dict[str, Any], group: str) -> dict[str, Any]:
    """The draft's mean accepted tokens minus the baseline's on the same points of ``group`` ("all" or a turn), and a
    90% bootstrap interval over prompts (``metrics.paired_difference``)."""
    def by_prompt(rep: dict[str, Any]) -> dict[str, list[int]]:
        rows: dict[str, list[int]] = defaultdict(list)
        for row in rep["per_point"]:
            if group == "all" or row["category"].startswith(group + "/"):
                rows[row["id"]].append(row["accepted"])
        return rows
    ours, theirs = by_prompt(report), by_prompt(baseline)
    pairs = [(i, a - b) for i in sorted(ours) for a, b in zip(ours[i], theirs[i], strict=True)]
    out = paired_difference_over_prompts([d for _, d in pairs], [i for i, _ in pairs])
    return {"prompts": out["prompts"], "difference": round(out["difference"], 3),
            "interval_90": [round(v, 3) for v in out["interval_90"]]}


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--work", default="runs/bench_multiturn", help="working directory (resumable)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--rows", type=int, default=BUDGETS["small"].trace_prompts, help="training rows per variant")
    parser.add_argument("--trace-tokens", type=int, default=BUDGETS["small"].trace_tokens)
    parser.add_argument("--new-share", type=float, default=0.2, help="share of the rows made by the conversations "
                                                                      "stage in the followup and passage variants")
    parser.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts evaluated")
    parser.add_argument("--eval-tokens", type=int, default=BUDGETS["small"].val_tokens)
    parser.add_argument("--mt-bench-questions", type=int, default=24)
    parser.add_argument("--mt-bench-answer-tokens", type=int, default=BUDGETS["small"].mt_bench_answer_tokens)
    parser.add_argument("--seed", type=int, default=0, help="the conversations stage's seed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_out_argument(parser, default=None)
    args = parser.parse_args()
    log_to_console()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    work = Path(args.work)
    steps = Steps(work)
    target, budget = DEFAULT_TARGET, BUDGETS["small"]
    mt_bench = SHARED / "dev" / "mt_bench.jsonl"
    mt_bench = mt_bench if mt_bench.is_file() else None
    manifest = str(REPO_ROOT / "configs" / "manifest.shared.json") if (SHARED / "train").is_dir() else None
    eval_sets = [str(heldout_path())] + ([str(mt_bench)] if mt_bench else [])
    new_rows = round(args.rows * args.new_share)
    first_count = args.rows - new_rows

    prompts = PromptsConfig(manifest=manifest, out=str(work / "prompts" / "prompts.jsonl"), tokenizer=target,
                            eval_set=eval_sets)
    steps.run("prompts", lambda: {"total": build_prompts(prompts).total})
    first = TracesConfig(target=target, prompts=Path(prompts.out), out=work / "first_turns" / "traces.jsonl",
                         max_new_tokens=args.trace_tokens, limit=first_count)
    costs: dict[str, dict[str, Any]] = {}
    costs["first_turns"] = steps.run("first_turns", lambda: {"rows": run_traces(first).rows})

    def baseline_traces() -> dict[str, Any]:
        """The first turns' file resumed to --rows prompts: only the last ones are decoded."""
        out = work / "baseline" / "traces.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        for src in (first.out, first.out.with_name("traces.summary.json")):
            shutil.copyfile(src, out.parent / src.name)
        return {"rows": run_traces(first.model_copy(update={"out": out, "limit": args.rows})).rows}

    def control_traces() -> dict[str, Any]:
        """The first turns plus ``new`` prompts after the baseline's: a prompts file of those, the first turns' file
        resumed over it (only the new prompts are decoded)."""
        out = work / "control" / "traces.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = Path(prompts.out).read_text(encoding="utf-8").splitlines(keepends=True)
        subset = out.parent / "prompts.jsonl"
        atomic_write_text(subset, "".join(lines[:first_count] + lines[args.rows:args.rows + new_rows]))
        for src in (first.out, first.out.with_name("traces.summary.json")):
            shutil.copyfile(src, out.parent / src.name)
        return {"rows": run_traces(first.model_copy(update={"out": out, "prompts": subset, "limit": None})).rows}

    training: dict[str, Path] = {}
    if "control" in variants:
        costs["control"] = steps.run("control_traces", control_traces)
        training["control"] = work / "control" / "traces.jsonl"
    if "baseline" in variants:
        costs["baseline"] = steps.run("baseline_traces", baseline_traces)
        training["baseline"] = work / "baseline" / "traces.jsonl"
    for kind in ("followup", "passage"):
        if kind in variants:
            cfg = ConversationsConfig(target=target, prompts=Path(prompts.out), first_turns=first.out,
                                      out=work / kind / "traces.jsonl", max_new_tokens=args.trace_tokens,
                                      seed=args.seed, eval_set=[str(mt_bench)] if mt_bench else [],
                                      **{f"{kind}s": new_rows})
            costs[kind] = steps.run(f"{kind}_rows", lambda cfg=cfg: {
                key: value for key, value in run_conversations(cfg).summary_data.items()
                if key in ("rows", "kinds", "prompt_tokens", "completion_tokens", "not_made", "planned")})
            training[kind] = cfg.out

    # evaluation points: the held-out set's first prompts, and both MT-bench turns
    validation = ValidationConfig(target=target, prompts=heldout_path(), out=work / "eval_points" / "heldout.jsonl",
                                  max_new_tokens=args.eval_tokens, limit=args.eval_prompts)
    steps.run("heldout_points", lambda: {"points": run_validation(validation).rows})
    point_sets = {"heldout": validation.out}
    if mt_bench:
        mt_dir = work / "eval_points" / "mt_bench"
        questions = interleave_categories(read_mt_bench(mt_bench), args.mt_bench_questions)
        listed = mt_dir / "questions.jsonl"
        answers = TracesConfig(target=target, prompts=listed, out=mt_dir / "answers.jsonl",
                               max_new_tokens=args.mt_bench_answer_tokens)

        def mt_bench_points() -> dict[str, Any]:
            atomic_write_text(listed, "".join(jsonl_line(q.to_json()) + "\n" for q in questions))
            run_traces(answers)
            summary = write_mt_bench_points(mt_dir / "validation.jsonl", questions, listed, answers.out, target,
                                            lambda: HFBackend(target, "auto", answers.batch_size), DRAFT_TOKENS,
                                            args.eval_tokens)
            return {"points": summary["points"]}
        steps.run("mt_bench_points", mt_bench_points)
        point_sets["mt_bench"] = mt_dir / "validation.jsonl"

    figures: dict[str, Any] = {"recipe": {"rows": args.rows, "first_turns": first_count, "new_rows": new_rows,
                                          "trace_tokens": args.trace_tokens, "draft_init": budget.draft_init,
                                          "epochs": budget.epochs, "lr": budget.lr, "qat": budget.qat,
                                          "freeze_layers": budget.freeze_layers, "seed": args.seed,
                                          "manifest": manifest or "packaged corpus"},
                               "evaluation": {"heldout_prompts": args.eval_prompts, "eval_tokens": args.eval_tokens,
                                              "mt_bench_questions": args.mt_bench_questions if mt_bench else 0,
                                              "mt_bench_answer_tokens": args.mt_bench_answer_tokens, "k": DRAFT_TOKENS},
                               "variants": {}}
    pack_group = PackConfig.model_fields["group_size"].default
    for name in variants:
        draft_dir, model_dir = work / name / "draft", work / name / "model"
        train = TrainConfig(traces=str(training[name]), init=budget.draft_init.replace("{target}", target),
                            out=str(draft_dir), target=target, epochs=budget.epochs, lr=budget.lr,
                            freeze_layers=budget.freeze_layers, eval_every=budget.eval_every,
                            threads=args.threads or None, qat_group_size=pack_group if budget.qat else None)
        trained = steps.run(f"{name}_train", lambda train=train: {
            "steps": run_train(train).get("steps")})
        steps.run(f"{name}_pack", lambda name=name, draft_dir=draft_dir, model_dir=model_dir: {
            "bytes": run_pack(PackConfig(checkpoint=str(draft_dir), out=str(model_dir), overwrite=True)).bytes})
        accepted = {}
        for set_name, points in point_sets.items():
            out = work / name / "eval" / set_name
            steps.run(f"{name}_eval_{set_name}", lambda points=points, out=out, model_dir=model_dir: run_eval(
                EvalConfig(validation=points, model_dir=model_dir, out=out, target=target, choose_hybrid_rule=True,
                           temperatures=[], threads=args.threads or None, plots=False)))
            accepted[set_name] = accepted_by_group(read_json(out / "report.json"))
        cost_steps = {"baseline": ["first_turns", "baseline"], "followup": ["first_turns", "followup"],
                      "passage": ["first_turns", "passage"], "control": ["first_turns", "control"]}[name]
        data_cost = {"wall_s": round(sum(costs[s]["wall_s"] for s in cost_steps), 1),
                     "cpu_s": round(sum(costs[s]["cpu_s"] for s in cost_steps), 1)}
        traces_summary = read_json(training[name].with_name("traces.summary.json"))
        figures["variants"][name] = {
            "rows": traces_summary["rows"], "prompt_tokens": traces_summary["prompt_tokens"],
            "completion_tokens": traces_summary["completion_tokens"],
            "kinds": traces_summary.get("kinds", {"first_turn": traces_summary["rows"]}),
            "data_seconds": data_cost, "train_seconds": {"wall_s": trained["wall_s"], "cpu_s": trained["cpu_s"]},
            "train_steps": trained["result"]["steps"], "accepted": accepted}
    if "baseline" in figures["variants"]:
        base = figures["variants"]["baseline"]["accepted"]
        for name, record in figures["variants"].items():
            record["draft_vs_baseline"] = {
                set_name: {group: round(values["draft"] / base[set_name][group]["draft"], 3)
                           for group, values in groups.items() if base[set_name][group]["draft"]}
                for set_name, groups in record["accepted"].items()}
            if name != "baseline":
                record["paired_vs_baseline"] = {
                    set_name: {group: paired_difference(read_json(work / name / "eval" / set_name / "report.json"),
                                                        read_json(work / "baseline" / "eval" / set_name /
                                                                  "report.json"), group)
                               for group in ("all", "turn1", "turn2") if group in record["accepted"][set_name]}
                    for set_name in record["accepted"]}
    save_result("multiturn_data", figures, args.out)


if __name__ == "__main__":
    main()
