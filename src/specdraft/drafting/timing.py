"""Speculative decoding timed against plain greedy, side by side in one run (the ``speculate`` stage and the
benchmarks): every (drafter, k) on every prompt, in an order rotated per prompt so that machine noise spreads
evenly, each output checked against plain greedy. Under sampling the same runs are timed against plain sampling
in the same loop; outputs then differ by design (speculative sampling is lossless in distribution:
tests/drafting/test_speculative_sampling.py)."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tqdm import tqdm

from specdraft.drafting.base import Drafter, NoDraft
from specdraft.drafting.prediction import predict_speedups
from specdraft.drafting.speculative import SpecGeneration, first_mismatch, speculative_generate
from specdraft.model.sampling import GREEDY, SamplingParams
from specdraft.model.targets import TargetModel, as_target

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """A prompt as the target's token ids."""

    id: str
    ids: list[int]


@dataclass
class SpeculationTotals:
    tokens: int = 0
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (at 1 thread: immune to other processes' load)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    mismatches: int = 0
    runs: int = 0
    lookup_steps: int | None = None  # hybrid drafters: steps prompt lookup answered (no draft forward)

    def add(self, gen, wall: float, cpu: float) -> None:
        self.runs += 1
        self.tokens += len(gen.tokens)
        self.seconds += wall
        self.cpu_seconds += cpu
        if isinstance(gen, SpecGeneration):
            self.steps += gen.steps
            self.drafted += gen.drafted
            self.accepted += gen.accepted
            self.draft_seconds += gen.draft_seconds

    def rates(self) -> dict[str, float]:
        return {"wall": self.tokens / self.seconds if self.seconds else 0.0,
                "cpu": self.tokens / self.cpu_seconds if self.cpu_seconds else 0.0}

    def summary(self, baseline: "SpeculationTotals", clock: str) -> dict[str, Any]:
        mine, base = self.rates(), baseline.rates()
        speed = {c: mine[c] / base[c] if base[c] else 0.0 for c in mine}
        return {
            "tokens": self.tokens, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
            "tokens_per_s": mine[clock], "speedup": speed[clock],
            "tokens_per_s_wall": mine["wall"], "speedup_wall": speed["wall"],
            "tokens_per_s_cpu": mine["cpu"], "speedup_cpu": speed["cpu"],
            "verify_steps": self.steps,
            "accepted_per_step": self.accepted / self.steps if self.steps else 0.0,
            # the prefill gives each run its first token; every other token came out of a verify step
            "tokens_per_step": (self.tokens - self.runs) / self.steps if self.steps else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            **({"lookup_step_share": self.lookup_steps / self.steps if self.steps else 0.0}
               if self.lookup_steps is not None else {}),
            "draft_time_share": self.draft_seconds / self.seconds if self.seconds else 0.0,
            "mismatches": self.mismatches,
            "equal_to_plain_greedy": (self.runs - self.mismatches) / self.runs if self.runs else 0.0,
        }


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - w0, time.process_time() - c0


def run_speculation_bench(target, drafters: Sequence[tuple[str, Drafter]], prompts: Sequence[Prompt],
                          ks: Sequence[int], max_new_tokens: int, warmup: bool = True,
                          progress: bool = False, clock: str = "wall", repeats: int = 1,
                          predict: bool = False, sampling: SamplingParams = GREEDY, seed: int = 0) -> dict[str, Any]:
    """Time plain greedy and every (drafter, k) on every prompt; check each output against greedy.

    ``target``: a ``TargetModel`` of any engine, or a transformers model; ``drafters``: (name, drafter), the name
    keying its rows. Per prompt: the target's plain greedy (``TargetModel.greedy``; ``greedy_decode`` at batch 1
    in torch) gives the reference tokens (timed too); then the baseline (the speculative loop with no drafts: one
    target forward per token) and every speculative run, in an order rotated from prompt to prompt so that
    machine noise spreads evenly.
    With ``repeats`` > 1 the whole pass over the prompts runs that many times (rotated differently each
    time): each (drafter, k) then also reports its speed-up in every pass against the baseline of the same
    pass (``speedup_repeats``), their median and range -- how much of a difference is the machine's noise.
    Both clocks are recorded; ``clock`` picks the one behind ``tokens_per_s``, ``speedup`` and best k.
    An output that differs from the reference is an error with an ``exact`` target; with another (llama.cpp)
    it is counted, with where it parts (``equal_to_plain_greedy`` per drafter and k).
    ``predict``: afterwards, each speed-up predicted from the target's measured costs and a replay of each
    drafter (``drafting.prediction``), beside the measured one (``predicted_speedup`` per drafter and k).
    ``sampling`` at temperature > 0: every run samples (drafts from each drafter's distribution), the baseline is
    plain sampling in the same loop, nothing is compared with greedy and nothing predicted (the prediction models
    greedy acceptance); each run's generator is seeded from ``seed``, the pass and the prompt.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    sweep = Sweep(as_target(target), drafters, ks, max_new_tokens, repeats, sampling, seed)
    if warmup and prompts:
        sweep.warm_up(prompts[0].ids)
    order = [(r, i, p) for r in range(repeats) for i, p in enumerate(prompts)]
    for rep, i, prompt in tqdm(order, desc="speculate", unit="prompt") if progress else order:
        sweep.run_prompt(rep, i, prompt, len(prompts))
    results = {name: drafter_results(sweep, name, ks, clock) for name, _ in drafters}
    prediction = None
    if predict and not sweep.sampled and prompts:
        prediction = predict_speedups(sweep.target, drafters, [p.ids for p in prompts],
                                      [sweep.references[i][0].tokens for i in range(len(prompts))], ks,
                                      max_new_tokens)
        add_prediction(results, prediction)
    return sweep.report(clock, results, prediction)


class Sweep:
    """One timing run: the runs (the baseline, then every drafter at every k), and what they measured so far --
    totals over the whole run and per pass, one row per prompt and pass, the reference outputs, mismatches."""

    def __init__(self, target: TargetModel, drafters: Sequence[tuple[str, Drafter]], ks: Sequence[int],
                 max_new_tokens: int, repeats: int, sampling: SamplingParams, seed: int):
        self.target, self.max_new_tokens, self.sampling, self.seed = target, max_new_tokens, sampling, seed
        self.sampled = not sampling.greedy
        self.eos = set(target.eos_ids)
        self.runs = [("baseline", NoDraft(), 1)] + [(name, drafter, k) for name, drafter in drafters for k in ks]
        self.totals = {(name, k): SpeculationTotals() for name, _, k in self.runs}
        self.per_pass = [{(name, k): SpeculationTotals() for name, _, k in self.runs} for _ in range(repeats)]
        self.reference = SpeculationTotals()  # the target's plain greedy decoding
        self.references: dict[int, tuple[Any, float]] = {}  # prompt index -> (its greedy output, seconds)
        self.rows: list[dict[str, Any]] = []
        self.mismatches: list[dict[str, Any]] = []

    def generate(self, drafter: Drafter, ids: list[int], max_new: int, k: int, run_seed: int) -> SpecGeneration:
        if not self.sampled:
            return speculative_generate(self.target, drafter, ids, max_new, k, self.eos)
        return speculative_generate(self.target, drafter, ids, max_new, k, self.eos, self.sampling,
                                    torch.Generator().manual_seed(run_seed))

    def warm_up(self, ids: list[int]) -> None:
        """One short untimed run of every configuration."""
        self.target.greedy(ids, min(8, self.max_new_tokens))
        for _, drafter, k in self.runs:
            self.generate(drafter, ids, min(8, self.max_new_tokens), k, self.seed)

    def run_prompt(self, rep: int, i: int, prompt: Prompt, prompts: int) -> None:
        """Every run on one prompt in pass ``rep``, in an order rotated per prompt and pass."""
        ref = None if self.sampled else self._greedy_reference(i, prompt)
        run_seed = self.seed + rep * prompts + i  # the same for every drafter of this prompt and pass
        row = self._row(prompt, i, run_seed)
        if len(self.per_pass) > 1:
            row["repeat"] = rep
        shift = (i + rep) % len(self.runs)
        for name, drafter, k in self.runs[shift:] + self.runs[:shift]:
            looked_up = drafter.lookup_used
            gen, wall, cpu = timed(lambda: self.generate(drafter, prompt.ids, self.max_new_tokens, k, run_seed))
            for tot in (self.totals[(name, k)], self.per_pass[rep][(name, k)]):
                tot.add(gen, wall, cpu)
                if looked_up is not None:
                    tot.lookup_steps = (tot.lookup_steps or 0) + drafter.lookup_used - looked_up
            if ref is not None:
                self._check(name, k, prompt, gen, ref)
            key = "baseline" if name == "baseline" else f"{name}/k={k}"
            row["runs"][key] = {"seconds": wall, "cpu_seconds": cpu, "steps": gen.steps, "accepted": gen.accepted,
                                "drafted": gen.drafted, **({"new_tokens": len(gen.tokens)} if self.sampled else {})}
        self.rows.append(row)

    def _greedy_reference(self, i: int, prompt: Prompt):
        """The target's plain greedy output for prompt ``i``, decoded (and timed) once over the passes."""
        if i not in self.references:
            ref, wall, cpu = timed(lambda: self.target.greedy(prompt.ids, self.max_new_tokens))
            self.reference.add(ref, wall, cpu)
            self.references[i] = (ref, wall)
        return self.references[i][0]

    def _row(self, prompt: Prompt, i: int, run_seed: int) -> dict[str, Any]:
        if self.sampled:
            return {"id": prompt.id, "prompt_tokens": len(prompt.ids), "seed": run_seed, "runs": {}}
        ref, ref_wall = self.references[i]
        return {"id": prompt.id, "prompt_tokens": len(prompt.ids), "new_tokens": len(ref.tokens),
                "finish_reason": ref.finish_reason, "greedy_decode_seconds": ref_wall, "runs": {}}

    def _check(self, name: str, k: int, prompt: Prompt, gen: SpecGeneration, ref) -> None:
        """A greedy run against the reference: a mismatch is counted, listed and logged (an error on an exact
        engine)."""
        bad = first_mismatch(gen.tokens, ref.tokens)
        if bad is None and gen.finish_reason == ref.finish_reason:
            return
        self.totals[(name, k)].mismatches += 1
        self.mismatches.append({"prompt": prompt.id, "drafter": name, "k": k, "first_mismatch": bad,
                                "greedy_tokens": len(ref.tokens), "speculative_tokens": len(gen.tokens)})
        (log.error if self.target.exact else log.info)(
            "%s prompt %s drafter %s k=%d: first differing token at %s",
            "MISMATCH" if self.target.exact else "differs from plain greedy:", prompt.id, name, k, bad)

    def report(self, clock: str, results: dict[str, Any], prediction: dict[str, Any] | None) -> dict[str, Any]:
        base = self.totals[("baseline", 1)]
        base_rates, ref_rates, sampling = base.rates(), self.reference.rates(), self.sampling
        return {
            "clock": clock,
            "repeats": len(self.per_pass),
            "sampling": ({"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                          "seed": self.seed} if self.sampled else None),
            "baseline": {"what": f"plain {'sampling' if self.sampled else 'greedy'} in the same loop (no drafts: one "
                                 "target forward per token), alternated with the speculative runs",
                         "tokens": base.tokens, "seconds": base.seconds, "cpu_seconds": base.cpu_seconds,
                         "tokens_per_s": base_rates[clock], "tokens_per_s_wall": base_rates["wall"],
                         "tokens_per_s_cpu": base_rates["cpu"], "mismatches": base.mismatches},
            "greedy_decode": None if self.sampled else {
                "what": "the target's plain greedy decoding at batch 1 (torch: specdraft.model.decode.greedy_decode): "
                        "the reference tokens",
                "tokens": self.reference.tokens, "seconds": self.reference.seconds, "tokens_per_s": ref_rates[clock],
                "tokens_per_s_wall": ref_rates["wall"], "tokens_per_s_cpu": ref_rates["cpu"]},
            "drafters": results,
            "engine": self.target.engine,
            "exact_engine": self.target.exact,
            "mismatches": self.mismatches,
            # sampled outputs are not compared with anything (lossless in distribution, not token for token)
            "lossless": None if self.sampled else not self.mismatches,
            "prediction": prediction,
            "per_prompt": self.rows,
        }


def drafter_results(sweep: Sweep, name: str, ks: Sequence[int], clock: str) -> dict[str, Any]:
    """One drafter's summary per k against the baseline (and, over several passes, its speed-up in each), and its
    best k."""
    per_k = {str(k): sweep.totals[(name, k)].summary(sweep.totals[("baseline", 1)], clock) for k in ks}
    if len(sweep.per_pass) > 1:
        for k in ks:
            passes = [p[(name, k)].summary(p[("baseline", 1)], clock)["speedup"] for p in sweep.per_pass]
            per_k[str(k)].update(speedup_repeats=passes, speedup_median=statistics.median(passes),
                                 speedup_range=[min(passes), max(passes)])
    best_k = max(ks, key=lambda k: per_k[str(k)]["tokens_per_s"])
    return {"per_k": per_k, "best_k": best_k, "best_tokens_per_s": per_k[str(best_k)]["tokens_per_s"],
            "best_speedup": per_k[str(best_k)]["speedup"]}


def add_prediction(results: dict[str, Any], prediction: dict[str, Any]) -> None:
    """Each predicted speed-up beside the measured one (wall clock), in both the prediction and the results."""
    for name, predicted_rows in prediction["drafters"].items():
        for k, predicted in predicted_rows.items():
            measured = results[name]["per_k"][k]["speedup_wall"]
            predicted["measured_speedup"] = measured
            predicted["predicted_over_measured"] = predicted["predicted_speedup"] / measured if measured else None
            results[name]["per_k"][k]["predicted_speedup"] = predicted["predicted_speedup"]
