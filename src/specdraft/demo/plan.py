"""The demo sized for the machine it runs on: a few seconds' probe of this CPU before the first stage, and the wall
time each stage should take here.

The probe times a fixed float32 workload (the embedded target's MLP shapes at 1, 32 and 128 rows: decode steps,
batched traces, prefill and training) at the stages' thread count. The estimate scales a reference run of the
small budget (``assets/demo_reference.json``: each stage's seconds, the probe on that machine, the machine) by the
probe's ratio, and by each stage's work (``stage_units``) for the larger budgets. A stage whose work is of another
kind than the reference run's (``stage_kinds``: a GPTQ pack against a rounding one) is not expected: units of one
kind do not scale the other. It is a model, and says so: the summary puts what each stage took beside what was
expected.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.core.machine import describe, machine
from specdraft.demo.budgets import BUDGETS

REFERENCE = "demo_reference.json"
REFERENCE_PATH = Path(__file__).resolve().parents[1] / "assets" / REFERENCE
PROBE_SHAPES = ((1536, 576), (576, 1536))  # the embedded target's MLP: where its forward spends its time
PROBE_ROWS = (1, 32, 128)
PROBE_ROUNDS = 5


def probe_seconds(rounds: int = PROBE_ROUNDS) -> float:
    """Median seconds of one round of the probe workload (float32 linears at ``PROBE_ROWS`` rows over
    ``PROBE_SHAPES``), at torch's current thread count."""
    weights = [torch.full(shape, 0.01) for shape in PROBE_SHAPES]
    inputs = {(rows, w.shape[1]): torch.full((rows, w.shape[1]), 0.5) for w in weights for rows in PROBE_ROWS}

    def one_round() -> float:
        started = time.perf_counter()
        for w in weights:
            for rows in PROBE_ROWS:
                for _ in range(8):
                    torch.nn.functional.linear(inputs[(rows, w.shape[1])], w)
        return time.perf_counter() - started

    one_round()  # warm-up
    return statistics.median(one_round() for _ in range(rounds))


def stage_units(budget: Any) -> dict[str, float]:
    """Each stage's work in a budget, in units that its time grows with (tokens decoded or trained, points
    evaluated, tokens speculated); stages of fixed work count 1."""
    traced = budget.trace_prompts * budget.trace_tokens
    validated = budget.val_prompts * budget.val_tokens
    speculated = budget.spec_prompts * budget.spec_tokens * budget.spec_repeats
    return {"prompts": 1, "traces": traced, "validation": validated, "train": traced * budget.epochs,
            "init": 1, "pack": traced if budget.gptq else 1, "export": 1, "pack_self": 1,
            "eval_init": validated, "eval_lookup": validated, "eval_self": validated, "eval_trained": validated,
            "speculate": speculated * len(budget.spec_k),
            "speculate_llama_cpp": speculated * len(budget.llama_k) * (2 if budget.llama_full_precision else 1),
            "selfcheck": 1, "audit": 1,
            # MT-bench: the target's first answers, then both turns' points (where the shared data holds it)
            "mt_bench_points": budget.val_prompts * (budget.mt_bench_answer_tokens + 2 * budget.mt_bench_eval_tokens),
            "eval_mt_bench": 2 * budget.val_prompts * budget.mt_bench_eval_tokens}


def stage_kinds(budget: Any) -> dict[str, str]:
    """The stages whose work changes kind with the budget, and its kind there: a GPTQ pack fits every layer on the
    traces (seconds to minutes), a plain one rounds the weights once (about a second)."""
    return {"pack": "gptq" if budget.gptq else "round"}


def reference() -> dict[str, Any] | None:
    """The packaged reference run (None when the package has none)."""
    try:
        return json.loads(REFERENCE_PATH.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


@dataclass
class Plan:
    """What the probe measured here and the seconds each stage should take."""

    machine: dict[str, Any]
    threads: int
    probe_seconds: float
    speed_vs_reference: float | None  # > 1: this machine runs the probe faster than the reference machine did
    expected_seconds: dict[str, float]
    reference_machine: str | None
    # stages still to run that the reference run did not time, or timed doing work of another kind
    unexpected: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.expected_seconds.values())

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "threads": self.threads, "probe_seconds": round(self.probe_seconds, 5),
                "speed_vs_reference": None if self.speed_vs_reference is None else round(self.speed_vs_reference, 3),
                "expected_seconds": {k: round(v, 1) for k, v in self.expected_seconds.items()},
                "expected_total_seconds": round(self.total, 1), "reference_machine": self.reference_machine,
                "unexpected": list(self.unexpected)}

    def lines(self) -> list[str]:
        if not self.expected_seconds:
            return [f"this machine: {describe(self.machine)}, {self.threads} thread(s); no reference run to scale "
                    "from, so no expected times"]
        head = (f"this machine: {describe(self.machine)}, {self.threads} thread(s); it runs the probe "
                f"{self.speed_vs_reference:.2f}x as fast as the reference ({self.reference_machine}); expected "
                f"wall time {self.total / 60:.1f} min for the stages still to run:")
        return ([head] + [f"  {stage:<20} {seconds:7.0f} s" for stage, seconds in self.expected_seconds.items()]
                + ([f"  not in the reference run (or another kind of work there), so not expected: "
                    f"{', '.join(self.unexpected)}"]
                   if self.unexpected else []))


def plan(budget: Any, stages: list[str], threads: int | None = None) -> Plan:
    """Probe this machine and expect each of ``stages`` (those still to run) from the reference run."""
    threads = threads or torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = probe_seconds()
    finally:
        torch.set_num_threads(previous)
    ref = reference()
    here = machine()
    if ref is None:
        return Plan(here, threads, seconds, None, {}, None)
    speed = ref["probe_seconds"] / seconds
    units, ref_units = stage_units(budget), ref["units"]
    # a reference recorded before it named its kinds: those of its budget
    kinds, ref_kinds = stage_kinds(budget), ref.get("kinds") or stage_kinds(BUDGETS[ref["budget"]])
    expected = {stage: ref["stage_seconds"][stage] * units[stage] / ref_units[stage] / speed
                for stage in stages if stage in ref["stage_seconds"] and stage in units and ref_units.get(stage)
                and kinds.get(stage) == ref_kinds.get(stage)}
    return Plan(here, threads, seconds, speed, expected, describe(ref["machine"]),
                tuple(stage for stage in stages if stage not in expected))
