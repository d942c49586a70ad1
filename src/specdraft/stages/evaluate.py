"""`specdraft eval`: how many of a drafter's k tokens the target would accept, on held-out points.

Every validation point holds a context and the target's next 16 greedy tokens; ``drafting.acceptance``
scores the drafter's k tokens against them. This stage picks the drafter -- the draft server
(``HTTPDrafter``), a draft model in process (``model.loader.load_draft``: a packed QD04 dir or an HF
checkpoint dir) or model-free prompt lookup, optionally behind lookup (``HybridDrafter``) -- and writes
``report.json``, ``report.md`` and PNG plots: overall, per category (the points' own) and per context-length bucket
(``drafting.metrics.CONTEXT_BUCKETS``).

``--choose-hybrid-rule`` measures when lookup should draft in front of the model rather than fixing it
(``drafting.hybrid_rule``): the model drafts at every point, lookup is scored beside it, a rule is chosen on a
calibration split and reported on the other prompts (``hybrid_rule`` in the record).

Acceptance at temperature (``--temperatures``, ``drafting.acceptance.evaluate_at_temperatures``): the expected
accepted length of speculative sampling from the target's distributions (``--target``, one forward per point) and
the drafter's along each point's reference continuation. The draft server answers sampled drafts, not
distributions, so with ``--server`` the drafter's distributions come from the pack it serves loaded here
(``--pack-dir``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator

from specdraft.core.config import StageConfig
from specdraft.core.io import RecordFileError, atomic_write_json, atomic_write_text, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.core.records import load_validation
from specdraft.drafting.acceptance import evaluate_at_temperatures, evaluate_drafter, guided_acceptance
from specdraft.drafting.base import Drafter, DrafterError
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.hybrid_rule import GUIDE_MIN_RATIOS, HybridRule, calibration_split, measure_rules, rule_points
from specdraft.drafting.lookup import MAX_NGRAM, LookupDrafter, lookup_continuations
from specdraft.drafting.metrics import accepted_length
from specdraft.drafting.remote import HTTPDrafter
from specdraft.model.device import DEVICE_HELP, resolve_device
from specdraft.model.loader import load_draft
from specdraft.model.sampling import SamplingParams
from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_model
from specdraft.quant.compute_choice import COMPUTE_HELP, EVAL_WORKLOAD, ComputeSetting, Workload
from specdraft.quant.linear import Int4Prefill
from specdraft.reports.eval import compute_choice_of, compute_words, report_markdown, write_plots

log = logging.getLogger(__name__)


class EvalConfig(StageConfig):
    validation: Path = Field(description="validation.jsonl: {id, category, offset, context_ids, target_ids}")
    server: str | None = Field(None, description="draft server base URL (POST /draft), e.g. http://127.0.0.1:8000")
    model_dir: Path | None = Field(None, description="in-process drafter: a packed QD04 model dir "
                                   "(draft.qd4) or a plain HF checkpoint dir")
    lookup: bool = Field(False, description="use the model-free prompt-lookup drafter")
    out: Path = Field(description="report directory (report.json, report.md, PNG plots, eval.log)")
    k: int = Field(16, ge=1, le=64, description="draft tokens asked per point (validation holds 16 targets)")
    concurrency: int = Field(8, ge=1, le=256, description="HTTP requests in flight at once (--server)")
    batch_size: int = Field(16, ge=1, le=1024, description="points per in-process drafter call (--model-dir)")
    timeout_s: float = Field(120.0, gt=0, description="HTTP timeout per request, seconds")
    limit: int | None = Field(None, ge=1, description="evaluate only the first N points")
    compute: ComputeSetting = Field(
        "auto", description="in-process drafter's linear layers: " + COMPUTE_HELP + "; with --server and "
                            "--pack-dir, auto loads the pack as the server runs it (its /health)")
    int4_prefill: Int4Prefill = Field("bfloat16", description="with --compute int4: what the prefill runs on "
                                                              "(bfloat16 or float32 dense copies, or the int4 codes)")
    plots: bool = Field(True, description="write PNG plots")
    threads: int | None = Field(None, ge=1, description="torch CPU threads for an in-process drafter (None: "
                                                        "torch's default)")
    device: str = Field("auto", description=f"in-process drafter: {DEVICE_HELP}; int4 off the CPU runs in bfloat16")
    hybrid_min_ngram: int | None = Field(
        None, ge=1, le=4, description="with --server or --model-dir: prompt lookup first wherever the context's "
                                      "last N (or more, up to 4) tokens occurred before, the model only elsewhere "
                                      "(reported as its own drafter)")
    choose_hybrid_rule: bool = Field(
        False, description="with --server or --model-dir: also score prompt lookup at every point and choose when it "
                           "drafts in front of the model (never, or where its match is at least n tokens, n = 1, 2 "
                           "(the fixed rule), 3, 4, 8, 16; per category where that pays) on every other prompt of "
                           "each category, reported on the others (report.json: hybrid_rule)")
    temperatures: list[float] = Field(
        [0.0, 0.7, 1.0], description="acceptance at temperature: the expected accepted length of speculative "
                                     "sampling at each (0 = greedy, equal to the greedy figures); an empty list "
                                     "skips it")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="acceptance at temperature: nucleus sampling for target "
                                                          "and draft alike (1: off)")
    top_k: int = Field(0, ge=0, description="acceptance at temperature: top-k for target and draft alike (0: off)")
    target: str = Field(DEFAULT_TARGET, description="the target the validation points come from (its greedy "
                                                    "continuations): its distributions give acceptance at "
                                                    "temperature > 0 (loaded in float32 on --device)")
    pack_dir: Path | None = Field(None, description="with --server: the pack the server serves, loaded here (with "
                                                    "--compute) for the draft's distributions at temperature > 0; "
                                                    "without it --server reports temperature 0 only")

    @model_validator(mode="after")
    def _one_drafter(self):
        chosen = [name for name, on in (("--server", self.server), ("--model-dir", self.model_dir),
                                        ("--lookup", self.lookup)) if on]
        if len(chosen) != 1:
            raise ValueError("give exactly one drafter: --server URL, --model-dir DIR or --lookup "
                             f"(got {', '.join(chosen) or 'none'})")
        if self.lookup and self.hybrid_min_ngram is not None:
            raise ValueError("--hybrid-min-ngram puts lookup in front of a model: use it with --server or "
                             "--model-dir, not --lookup")
        if self.choose_hybrid_rule and (self.lookup or self.hybrid_min_ngram is not None):
            raise ValueError("--choose-hybrid-rule measures the model alone at every point beside lookup: use it "
                             "with --server or --model-dir, without --lookup or --hybrid-min-ngram")
        if self.pack_dir is not None and not self.server:
            raise ValueError("--pack-dir names the pack a --server serves; without --server use --model-dir")
        for t in self.temperatures:
            SamplingParams(temperature=t, top_p=self.top_p, top_k=self.top_k)  # its own checks, with the value
        return self

    @property
    def distributions_unknown(self) -> bool:
        """A server without --pack-dir: the draft's distributions are out of reach (its greedy figures stand for
        temperature 0)."""
        return bool(self.server) and self.pack_dir is None


def build_drafter(config: EvalConfig, model_dir: Path | None = None) -> tuple[Drafter, dict]:
    """(drafter, source description) for the one drafter the config names; with ``model_dir``, that model in
    process in place of the server (the served pack, for acceptance at temperature)."""

    if config.lookup:
        return LookupDrafter(), {"kind": "lookup"}
    if config.server and model_dir is None:
        http = HTTPDrafter(config.server, config.concurrency, config.timeout_s)
        drafter, source = http, {"kind": "http", "url": config.server}
        served = served_compute(http)
        if served:
            source["compute_choice"] = served
    else:
        model_dir = Path(model_dir or config.model_dir)
        compute, prefill = config.compute, config.int4_prefill
        if config.server and compute == "auto":  # the served pack: as the server runs it, where it says how
            with HTTPDrafter(config.server, 1, config.timeout_s) as http:
                served = served_compute(http)
            if served:
                compute, prefill = served["compute"], served["prefill"]
        workload = Workload(decode_rows=(config.batch_size,), context_tokens=EVAL_WORKLOAD.context_tokens)
        model, source = load_draft(model_dir, compute, prefill=prefill, device=config.device, workload=workload)
        name = f"{source['format']}:{model_dir.name}"
        drafter, source = (ModelDrafter(model, name=name, max_batch_size=config.batch_size),
                           {"kind": "in-process", **source})
    if config.hybrid_min_ngram is not None:
        drafter = HybridDrafter(drafter, min_ngram=config.hybrid_min_ngram)
        source = {"kind": "hybrid", "min_ngram": config.hybrid_min_ngram, "model": source}
    return drafter, source


def served_compute(http: HTTPDrafter) -> dict[str, Any] | None:
    """The compute a draft server runs and why (its /health), None from a server that does not say."""
    try:
        return http.health().get("compute_choice")
    except DrafterError as e:
        log.warning("%s", e)
        return None


def acceptance_at_temperature(config: EvalConfig, drafter: Drafter, source: dict, points, *,
                              greedy_drafts: list[list[int]] | None = None) -> dict[str, Any] | None:
    """``evaluate_at_temperatures`` for the configured drafter (the served pack in process for a server), with
    where the distributions came from; None without temperatures. ``greedy_drafts``: the greedy pass's drafts,
    which temperature 0 scores (greedy acceptance by construction, with no second decode)."""
    temperatures = list(config.temperatures)
    if not temperatures:
        return None
    if config.distributions_unknown:
        log.warning("acceptance at temperature skipped: a draft server answers sampled drafts, not its "
                    "distributions; give --pack-dir (the pack it serves)")
        return {"temperatures": {}, "skipped": {
            "temperatures": temperatures,
            "why": "a draft server answers sampled drafts, not its distributions: give --pack-dir (the pack it "
                   "serves) to compute them in process"}}
    in_process = None
    if config.server and config.pack_dir is not None:
        in_process, source = build_drafter(config, config.pack_dir)
        in_process.name = drafter.name
        source = {**source, "served_by": config.server,
                  "note": f"the draft's distributions come from the pack the server serves ({config.pack_dir}), "
                          f"loaded in process with compute {compute_words(compute_choice_of(source))}"}
    target = None
    if any(t > 0 for t in temperatures):
        target = load_model(config.target, dtype=torch.float32, device=resolve_device(config.device))
        vocab = target.config.vocab_size
        for p in points:
            if max(p.context_ids + p.target_ids) >= vocab:
                raise RecordFileError(f"{config.validation}: point {p.id!r} (offset {p.offset}) has a token id >= "
                                      f"the target's vocab size {vocab} ({config.target})")
    try:
        result = evaluate_at_temperatures(in_process or drafter, target, points, temperatures, config.k,
                                          top_p=config.top_p, top_k=config.top_k, greedy_drafts=greedy_drafts,
                                          progress=True)
    finally:
        if in_process is not None:
            in_process.close()
    result["draft_distributions"] = source
    result["target"] = describe_source(config.target) if target is not None else None
    return result


def hybrid_rule_record(report: dict[str, Any], points, k: int, drafter: Drafter,
                       scorer: Drafter | None) -> dict[str, Any]:
    """``measure_rules`` over the model's accepted lengths in ``report`` and lookup's, measured here; each point's
    lookup figures join its ``per_point`` row. With ``scorer`` (the model in process, teacher-forced) the guided rules
    are candidates too, scored from its distributions along each point's reference tokens; where a guided rule is
    chosen, ``drafter`` drafts the reported points guided, so that what the record reports is measured, and the
    record says how often the prediction matched (``guided_check``)."""
    found = [lookup_continuations(p.context_ids, k, MAX_NGRAM, 1) for p in points]
    guides = [continuations for continuations, _ in found]  # the first: lookup's own draft
    rows = rule_points(points, [row["accepted"] for row in report["per_point"]], k,
                       [(continuations[0] if continuations else [], match) for continuations, match in found])
    for row, scored in zip(report["per_point"], rows):
        row["lookup_accepted"], row["lookup_match"] = scored.lookup, scored.match
    if scorer is not None:
        log.info("scoring the guided hybrid rules (ratios %s) from %s's distributions along the reference tokens",
                 ", ".join(f"{r:g}" for r in GUIDE_MIN_RATIOS), scorer.name)
        scores = guided_acceptance(scorer, points, guides, GUIDE_MIN_RATIOS, k)
        rows = [replace(r, guided=g) for r, g in zip(rows, scores)]
        for row, predicted in zip(report["per_point"], scores):
            row["guided_predicted"] = {f"{r:g}": n for r, n in predicted.items()}
    else:
        log.info("guided hybrid rules not scored: they need the draft's distributions (--model-dir, or --pack-dir "
                 "with --server)")
    record = measure_rules(rows)
    chosen = HybridRule.from_json(record["chosen"])
    if chosen.guided:
        reported = [i for i, cal in enumerate(calibration_split(rows)) if not cal and guides[i]]
        ratio = chosen.guide_min_ratio
        drafts = drafter.draft_guided([points[i].context_ids for i in reported], k, [guides[i] for i in reported],
                                      [ratio] * len(reported))
        measured = {i: accepted_length(d[:k], points[i].target_ids[:k]) for i, d in zip(reported, drafts)}
        check = {"points": len(measured), "predicted_equal": sum(rows[i].guided[ratio] == a
                                                                 for i, a in measured.items()),
                 "guide_min_ratio": ratio,
                 "what": "the reported points with a lookup draft, drafted guided at the chosen ratio: how many "
                         "accept what the teacher-forced prediction said (the reported figures are the drafted "
                         "ones; the calibration's and the other ratios' are predictions)"}
        rows = [replace(r, guided={**r.guided, ratio: measured[i]}) if i in measured else r
                for i, r in enumerate(rows)]
        record = measure_rules(rows)
        record["guided_check"] = check
        log.info("guided drafts on %d reported points: %d as predicted", check["points"], check["predicted_equal"])
    log.info("hybrid rule chosen on %d calibration points: %s", record["split"]["calibration"]["points"],
             record["chosen_words"])
    return record


def guided_scorer(config: EvalConfig, drafter: Drafter) -> Drafter | None:
    """The model in process whose teacher-forced distributions score the guided rules: the drafter itself with
    --model-dir, the served pack with --server and --pack-dir; None otherwise."""
    if drafter.teacher_forced_paths:
        return drafter
    if config.server and config.pack_dir is not None:
        scorer, _ = build_drafter(config, config.pack_dir)
        return scorer
    return None


def run_eval(config: EvalConfig) -> int:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    with stage_log(out / "eval.log"):
        points = load_validation(config.validation, config.k, config.limit)
        log.info("%d points from %s", len(points), config.validation)
        drafter, source = build_drafter(config)
        try:
            vocab = drafter.vocab_size
            if vocab is not None:
                for p in points:
                    if max(p.context_ids) >= vocab:
                        raise RecordFileError(f"{config.validation}: point {p.id!r} (offset {p.offset}) has "
                                                  f"token id {max(p.context_ids)} >= draft vocab size {vocab}")
            with torch.inference_mode():  # scoped: a library must not switch autograd off globally
                report = evaluate_drafter(drafter, points, config.k,
                                          batch_size=(4 * config.concurrency if config.server
                                                      else config.batch_size),
                                          progress=True)
            if drafter.backpressure is not None:
                report["backpressure"] = drafter.backpressure
            if config.choose_hybrid_rule:
                scorer = guided_scorer(config, drafter)
                try:
                    with torch.inference_mode():
                        report["hybrid_rule"] = hybrid_rule_record(report, points, config.k, drafter, scorer)
                finally:
                    if scorer is not None and scorer is not drafter:
                        scorer.close()
            if drafter.lookup_used is not None:  # counted by the greedy pass alone
                report["hybrid"] = {"min_ngram": config.hybrid_min_ngram, "lookup_points": drafter.lookup_used,
                                    "model_points": drafter.model_used}
            with torch.inference_mode():
                report["acceptance_at_temperature"] = acceptance_at_temperature(
                    config, drafter, source, points, greedy_drafts=[row["draft"] for row in report["per_point"]])
        finally:
            drafter.close()
        report["drafter_source"] = source
        report["plots"] = write_plots(report, out) if config.plots else []
        atomic_write_text(out / "report.md", report_markdown(report))
        report["provenance"] = {
            **run_metadata(),
            "stage": "eval",
            "config": config.to_json_dict(),
            "validation_sha256": sha256_file(config.validation),
            "files": {name: sha256_file(out / name) for name in ["report.md", *report["plots"]]},
        }
        atomic_write_json(out / "report.json", report)
        lat = report["latency"]
        log.info("%s: pooled %.3f, per-prompt %.3f (of %d) over %d points; latency p50 %.1f ms p99 %.1f ms per %s",
                 report["drafter"], report["mean_accepted_pooled"], report["mean_accepted_per_prompt"], config.k,
                 report["points"], lat["p50_ms"], lat["p99_ms"], lat["unit"])
        section = report["acceptance_at_temperature"] or {"temperatures": {}}
        at_temperature = "".join(f", at temperature {key} {row['mean_expected_accepted_pooled']:.3f}"
                                 for key, row in section["temperatures"].items() if row["temperature"] > 0)
        print(f"{report['drafter']}: mean accepted (of {config.k}) pooled {report['mean_accepted_pooled']:.3f}, "
              f"per-prompt {report['mean_accepted_per_prompt']:.3f}{at_temperature}; report in {out}")
    return 0
