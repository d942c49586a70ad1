"""`specdraft demo`: run the declared steps (``demo.steps.STEPS``) in order on one run dir -- each resumed from its
marker when it ran already -- then gather what they measured into ``demo_summary.json`` and render it
(``reports.demo``).

Before the first step the machine probe (``demo.plan``) says how long each step should take here.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from specdraft.core.io import atomic_write_json, atomic_write_text, read_json
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.demo.budgets import BUDGETS, Budget
from specdraft.demo.config import DemoConfig
from specdraft.demo.plan import plan
from specdraft.demo.steps import STAGES, STEPS, Run
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM
from specdraft.drafting.hybrid_rule import AGAINST_BETTER, against_better_groups
from specdraft.drafting.prediction import TargetCosts, ceiling
from specdraft.drafting.spec import DrafterSpec
from specdraft.model.compat import check_pipeline_models
from specdraft.model.specs import DEFAULT_TARGET, model_summary
from specdraft.reports.demo import reference_results, summary_markdown
from specdraft.reports.eval import compute_choice_of

log = logging.getLogger(__name__)


def run_stage(run_dir: Path, name: str, fingerprint: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` unless a marker says it already ran with the same fingerprint."""
    marker = run_dir / ".stages" / f"{name}.json"
    if marker.is_file():
        saved = read_json(marker)
        if saved.get("fingerprint") == json.loads(json.dumps(fingerprint, default=str)):
            log.info("demo: %s done earlier, skipped", name)
            return saved.get("result")
    log.info("demo: %s ...", name)
    started = time.time()
    result = fn()
    atomic_write_json(marker, {"fingerprint": fingerprint, "result": result,
                               "seconds": round(time.time() - started, 1)})
    log.info("demo: %s finished in %.1fs", name, time.time() - started)
    return result


def run_steps(run: Run) -> dict[str, dict[str, Any]]:
    """Every step in order; (what happened to each: ran, its seconds this time, or why it was unavailable)."""
    status: dict[str, dict[str, Any]] = {}
    for step in STEPS:
        why = step.unavailable(run)
        if why is not None:
            status[step.name] = {"ran": False, "unavailable": why}
            continue
        started = time.time()
        if step.always:
            log.info("demo: %s ...", step.name)
            run.results[step.name] = step.run(run)
        else:
            run.results[step.name] = run_stage(run.run_dir, step.name, step.fingerprint(run),
                                            lambda step=step: step.run(run))
        status[step.name] = {"ran": True, "seconds": round(time.time() - started, 1)}
    return status


def run_demo(cfg: DemoConfig, budget: Budget | None = None, budget_name: str | None = None) -> int:
    """The pipeline on ``cfg.target`` at ``cfg.budget`` (or an explicit ``budget``, as the reference rehearsal's);
    a target or draft start it cannot carry is refused before any stage runs (``check_pipeline_models``)."""
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    budget = budget or BUDGETS[cfg.budget]
    started = time.time()
    with stage_log(run_dir / "demo.log"):
        init_spec, frozen = draft_start(cfg, budget)
        models = check_pipeline_models(cfg.target, init_spec)
        for note in models.notes:
            log.info("demo: %s", note)
        done = {m.stem for m in (run_dir / ".stages").glob("*.json")}
        expected = plan(budget, [s for s in STAGES if s not in done], cfg.threads)
        for line in expected.lines():
            log.info("demo: %s", line)
        run = Run(cfg, budget, run_dir, init_spec, frozen, models)
        status = run_steps(run)
        summary = collect_summary(run, status)
        summary["plan"] = expected.to_json()
        summary["budget"] = budget_name or cfg.budget
        summary["wall_seconds"] = round(time.time() - started, 1)
        # a marker older than this invocation is a stage an earlier one finished (and this one skipped); whole
        # seconds, for file systems that keep coarse modification times
        markers = sorted((m.stat().st_mtime, m.stem) for m in (run_dir / ".stages").glob("*.json"))
        summary["stages_done_earlier"] = [name for mtime, name in markers if mtime < int(started)]
        summary.update(run_metadata())
        atomic_write_json(run_dir / "demo_summary.json", summary)
        table = summary_markdown(summary)
        atomic_write_text(run_dir / "demo_summary.md", table)
        print(table)
    return 0 if summary.get("audit_exit") in (None, 0) and summary.get("selfcheck_exit") in (None, 0) else 1


def draft_start(cfg: DemoConfig, budget: Budget) -> tuple[str, int]:
    """(the draft's init spec, its frozen layers): ``--draft-init`` with ``truncate:N`` made the target's, else
    the budget's recipe for the embedded target, else the first half of the target's layers."""
    embedded = cfg.target == DEFAULT_TARGET
    init = cfg.draft_init
    if init is None and embedded:
        init = budget.draft_init
    if init is None:
        layers = int(model_summary(cfg.target)["layers"])
        init = f"truncate:{max(1, layers // 2)}"
    if init.startswith("truncate:") and init.count(":") == 1:  # truncate:N names the target's layers
        init = "truncate:{target}:" + init.removeprefix("truncate:")
    init = init.replace("{target}", cfg.target)
    frozen = cfg.freeze_layers if cfg.freeze_layers is not None else (budget.freeze_layers if embedded else 0)
    return init, frozen


def _data_facts(run_dir: Path) -> dict[str, Any]:
    """What the draft saw: prompts kept and dropped, traces and their tokens, training steps, tokens and time."""
    stats = read_json(run_dir / "prompts" / "prompts.stats.json")
    traces = read_json(run_dir / "traces" / "traces.summary.json")
    meta = read_json(run_dir / "draft" / "train_meta.json")
    validation = read_json(run_dir / "validation" / "validation.summary.json")
    dropped: dict[str, int] = {}
    for corpus in stats.get("corpora", {}).values():
        for reason, n in (corpus.get("dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    return {
        "prompts_read": sum(c.get("read", 0) for c in stats.get("corpora", {}).values()),
        "prompts_kept": stats.get("total"),
        "prompts_dropped": {k: v for k, v in dropped.items() if v},
        "corpora": len(stats.get("corpora", {})),
        "traces": traces.get("rows"),
        "trace_completion_tokens": traces.get("completion_tokens"),
        "train_examples": (meta.get("traces") or {}).get("train"),
        "heldout_examples": (meta.get("traces") or {}).get("heldout"),
        "train_steps": meta.get("steps"),
        # over every sitting of a resumed training (older records have only the last sitting's)
        "train_tokens": meta.get("train_tokens", meta.get("train_tokens_this_run")),
        "train_seconds": meta.get("train_seconds", meta.get("seconds_this_run")),
        "train_resumed_from_step": meta.get("resumed_from_step"),
        "eval_points": validation.get("points"),
        "eval_prompts": validation.get("prompts"),
    }


# What each of the demo's evaluations drafts with (its eval report's name -> the drafter)
EVAL_DRAFTERS = {"init": DrafterSpec("init"), "trained": DrafterSpec("server"),
                 "trained_lookup": DrafterSpec("server", behind_lookup=True), "lookup": DrafterSpec("lookup"),
                 "self": DrafterSpec("self")}


def _about(spec: DrafterSpec | None, name: str) -> dict[str, str]:
    return {"label": spec.label, "description": spec.description} if spec else {"label": name, "description": "-"}


def _acceptance(name: str, report: dict) -> dict:
    keys = ("mean_accepted_pooled", "mean_accepted_per_prompt", "points")
    source = report.get("acceptance", report)
    section = report.get("acceptance_at_temperature") or {}
    return {**_about(EVAL_DRAFTERS.get(name), name), **{k: source.get(k) for k in keys},
            "at_temperature": {key: row["mean_expected_accepted_pooled"]
                               for key, row in (section.get("temperatures") or {}).items()}}


def speculate_summary(spec: dict) -> dict:
    """One engine's speculation report as the summary reads it: the engine and its baseline, each drafter's best
    k with its measured and predicted speed-up, the prediction's verdict, and a full-precision table alike."""
    config, prediction = spec.get("config") or {}, spec.get("prediction") or {}
    specs = spec.get("drafter_specs") or {}
    predicted = prediction.get("drafters") or {}
    passes = (prediction.get("costs") or {}).get("pass_seconds")
    costs = TargetCosts({int(n): s for n, s in passes.items()}) if passes else None
    out: dict[str, Any] = {
        "engine": spec.get("engine", "torch"), "exact_engine": spec.get("exact_engine", True),
        "target_dtype": config.get("dtype"), "target_file": (spec.get("target") or {}).get("gguf"),
        "llama_cpp_python": spec.get("llama_cpp_python"), "threads": spec.get("threads"),
        "baseline_tokens_per_s": spec.get("baseline", {}).get("tokens_per_s"), "prompts": spec.get("prompts"),
        "repeats": spec.get("repeats", 1), "max_new_tokens": config.get("max_new_tokens"),
        "clock": spec.get("clock"), "lossless": spec.get("lossless"),
        "drafters": {name: {**_about(DrafterSpec.from_json(specs[name]) if name in specs else None, name),
                            **_drafter_summary(drafter, predicted.get(name) or {}, costs)}
                     for name, drafter in spec.get("drafters", {}).items()},
        "prediction_verdict": prediction.get("verdict") or []}
    if spec.get("full_precision"):
        out["full_precision"] = speculate_summary(spec["full_precision"])
    return out


def _drafter_summary(drafter: dict, predicted: dict[str, dict], costs: TargetCosts | None) -> dict:
    """A drafter at its best k (the fastest pooled over passes); ``predicted``: the prediction's rows by k, with
    the target's measured pass ``costs`` the most it could reach were every drafted token accepted (at its draft
    cost per token over k, as the prediction's verdict reckons it)."""
    best_k = drafter.get("best_k")
    best = drafter.get("per_k", {}).get(str(best_k), {})
    predictions = [row["predicted_speedup"] for row in predicted.values() if row.get("predicted_speedup") is not None]
    draft_costs = [row["draft_cost_per_token_vs_target_step"] for row in predicted.values()
                   if row.get("draft_cost_per_token_vs_target_step")]
    draft_cost = statistics.median(draft_costs) if draft_costs else None
    ceilings = [ceiling(costs, int(k), draft_cost) for k in predicted] if costs and draft_cost else []
    return {"best_k": best_k, "tokens_per_s": drafter.get("best_tokens_per_s"), "speedup": drafter.get("best_speedup"),
            "speedup_median": best.get("speedup_median", drafter.get("best_speedup")),
            "speedup_range": best.get("speedup_range"), "accepted_per_step": best.get("accepted_per_step"),
            "predicted_speedup": best.get("predicted_speedup"),
            "best_predicted_speedup": max(predictions) if predictions else None,
            "all_accepted_speedup": max(ceilings) if ceilings else None,
            "draft_cost_per_token": draft_cost,
            "equal_to_plain_greedy": best.get("equal_to_plain_greedy")}


# The hybrid-rule columns the summary shows, from an eval report's ``hybrid_rule`` section (the fixed rule's key is
# the section's own ``fixed``)
RULE_COLUMNS = ("draft_only", "lookup_alone", "fixed", "chosen")


def rule_summary(section: dict | None) -> dict | None:
    """An eval report's measured hybrid rule as the summary reads it: the rule, the split, and on the reported
    prompts each column's points, accepted total and mean, overall, per category and per context length."""
    if not section:
        return None
    reported = section.get("reported") or {}

    def columns(row: dict) -> dict:
        keys = {name: section["fixed"] if name == "fixed" else name for name in RULE_COLUMNS}
        return {name: {k: row[key][k] for k in ("points", "accepted_total", "mean_accepted")}
                for name, key in keys.items()}
    return {"chosen": section["chosen"], "chosen_words": section["chosen_words"], "split": section["split"],
            "fixed_label": section["candidates"][section["fixed"]]["label"],
            # the chosen rule against the better of the two per group, where the record has it (older ones do not)
            "against_better": against_better_groups(reported)
            if reported and AGAINST_BETTER in reported["overall"] else None,
            "reported": {"overall": columns(reported["overall"]),
                         "per_category": {c: columns(r) for c, r in reported["per_category"].items()},
                         "per_context_length": {b: columns(r) for b, r in reported["per_context_length"].items()}}
            if reported else None}


def mt_bench_summary(run: Run, status: dict[str, Any]) -> dict[str, Any]:
    """What the MT-bench steps measured (both turns), or why they did not run."""
    step = status.get("eval_mt_bench") or {}
    if not step.get("ran"):
        return {"unavailable": step.get("unavailable")}
    points = read_json(run.mt_bench_dir / "validation.summary.json")
    report = read_json(run.run_dir / "eval_mt_bench" / "trained" / "report.json")
    return {"path": str(run.mt_bench), "points": points.get("points"), "prompts": points.get("prompts"),
            "categories": points.get("categories") or {}, "drafter": report.get("drafter"),
            "mean_accepted_pooled": report.get("mean_accepted_pooled"),
            "per_category": report.get("per_category"), "per_context_length": report.get("per_context_length"),
            "lookup_per_category": lookup_per_category(report.get("per_point") or []),
            "hybrid_rule": rule_summary(report.get("hybrid_rule"))}


def lookup_per_category(per_point: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Prompt lookup's accepted tokens per category over every point, from what eval scored at each point beside
    the draft (``lookup_accepted``)."""
    out: dict[str, dict[str, int]] = {}
    for point in per_point:
        cell = out.setdefault(point["category"], {"points": 0, "accepted_total": 0})
        cell["points"] += 1
        cell["accepted_total"] += point["lookup_accepted"]
    return out


def collect_summary(run: Run, status: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the steps measured, from the records they wrote: the data, acceptance per drafter, speed per engine,
    the files, the checks' exits, each step's seconds, and the reference figures the summary quotes."""
    run_dir, cfg = run.run_dir, run.cfg
    reports = {name: read_json(run_dir / "eval" / name / "report.json")
               for name in ("init", "lookup", "self", "trained", "trained_lookup")}
    speculate = read_json(run_dir / "speculate" / "speculate.json")
    llama = status["speculate_llama_cpp"]
    arch = read_json(run_dir / "model" / "architecture.json")
    arch_self = read_json(run_dir / "model_self" / "architecture.json")
    markers = {m.stem: read_json(m).get("seconds") for m in (run_dir / ".stages").glob("*.json")}
    embedded = cfg.target == DEFAULT_TARGET
    return {
        "budget": cfg.budget,
        "target": cfg.target,
        "manifest": run.manifest or "the prompt corpus shipped in the package",
        "eval_set": {"path": run.eval_set[0], "kind": run.eval_set[1]},
        "data": _data_facts(run_dir),
        "draft_init": run.init_spec,
        "frozen_layers": run.frozen,
        "models": run.models.to_json(),
        "hybrid_min_ngram": DEFAULT_HYBRID_MIN_NGRAM,
        "acceptance": {name: _acceptance(name, r) for name, r in reports.items()},
        "hybrid_rule": rule_summary(reports["trained"].get("hybrid_rule")),
        "mt_bench": mt_bench_summary(run, status),
        "draft_latency": reports["trained"].get("latency"),
        "compute": _compute_choices(reports, speculate),
        "speculate": speculate_summary(speculate),
        "speculate_llama_cpp": (speculate_summary(read_json(run_dir / "speculate_llama_cpp" / "speculate.json"))
                                if llama["ran"] else None),
        "llama_cpp_not_measured": llama.get("unavailable"),
        "pack": {"bytes": arch["bytes"], "parameters": arch["parameters"]},
        "pack_self": {"bytes": arch_self["bytes"], "parameters": arch_self["parameters"]},
        "export": run.results.get("export"),
        "selfcheck_exit": run.results.get("selfcheck"),
        "audit_exit": run.results.get("audit"),
        "stages": STAGES,
        "stage_seconds": {**markers, **{name: s["seconds"] for name, s in status.items()
                                        if s.get("ran") and name not in markers}},
        # the measured figures are the embedded target's: quoted for it alone
        "embedded_target": embedded,
        "reference": reference_results(cfg.reference_results) if embedded else None,
    }


def _compute_choices(reports: dict[str, dict], speculate: dict) -> dict[str, Any]:
    """What each model-running step computed its draft in, and why (auto: measured on this machine at load)."""
    out = {f"eval {name}": compute_choice_of(report.get("drafter_source") or {}) for name, report in reports.items()}
    out.update({f"speculate {name}": source.get("compute_choice")
                for name, source in (speculate.get("drafter_sources") or {}).items()})
    return {where: {"compute": c["compute"], "prefill": c.get("prefill"), "reason": c["reason"]}
            for where, c in out.items() if c}
