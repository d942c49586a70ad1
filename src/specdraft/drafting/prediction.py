"""A speed-up predicted from measured costs, before speculative decoding runs: what each drafter can give in an
engine, and whether any drafter can pay there at all.

The model of one speculative step at draft length k: the drafter proposes d <= k tokens (draft seconds c_d), the
target verifies d + 1 tokens in one pass (c_v(d + 1)) and keeps the accepted ones plus its own. Plain greedy
pays one one-token pass (c_1) per token. So

    speed-up(k) = E_k * c_1 / (c_v(k + 1) + c_d(k)),    E_k = 1 + a_1 + ... + a_k

where a_i is the acceptance at position i (the share of steps whose first i drafted tokens are all kept). The
costs c_1 and c_v(n) come from a probe of the target alone (``measure_target_costs``: median seconds of a pass
over n tokens); E_k and c_d(k) from a replay of each drafter over the target's plain greedy output
(``replay_drafter``: the drafts the speculative loop would ask for, timed, with no target in the loop). The
prediction sums these over the prompts' steps (a step that drafted fewer tokens pays for the pass it ran) and
the prefill of each prompt, which both sides pay.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from specdraft.drafting.base import Drafter
from specdraft.drafting.metrics import accepted_length
from specdraft.model.targets import TargetModel


@dataclass
class TargetCosts:
    """Median seconds of the target's passes, measured after a real prompt."""

    pass_seconds: dict[int, float]  # n tokens -> one pass over them (1: a plain decoding step)
    prefill_seconds: dict[int, float] = field(default_factory=dict)  # prompt length -> its prefill

    @property
    def step(self) -> float:
        return self.pass_seconds[1]

    def verify(self, n: int) -> float:
        """A pass over n tokens; beyond the measured sizes, the largest measured, scaled linearly."""
        if n in self.pass_seconds:
            return self.pass_seconds[n]
        largest = max(self.pass_seconds)
        return self.pass_seconds[largest] * n / largest

    def as_json(self) -> dict[str, Any]:
        return {"step_seconds": self.step,
                "pass_seconds": {str(n): s for n, s in sorted(self.pass_seconds.items())},
                "tokens_per_s_by_pass": {str(n): n / s for n, s in sorted(self.pass_seconds.items())}}


def measure_target_costs(target: TargetModel, prompt: Sequence[int], sizes: Sequence[int],
                         repeats: int = 5) -> TargetCosts:
    """Median seconds of a pass over n tokens (every n in ``sizes`` and 1), fed after ``prompt``; the sizes
    alternate within each repeat so that drifting machine speed spreads over all of them."""
    prompt = list(prompt)
    sizes = sorted(set(sizes) | {1})
    filler = (prompt * (max(sizes) // len(prompt) + 1))[:max(sizes)]  # real token ids, any will do
    target.prefill(prompt)
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first round warms caches and is dropped
        for n in sizes if rep % 2 else sizes[::-1]:
            t0 = time.perf_counter()
            target.verify(filler[:n], len(prompt))
            elapsed = time.perf_counter() - t0
            target.truncate(len(prompt))
            if rep:
                seconds[n].append(elapsed)
    return TargetCosts({n: statistics.median(s) for n, s in seconds.items()})


def measure_prefill(target: TargetModel, prompts: Sequence[Sequence[int]], costs: TargetCosts) -> None:
    """Each distinct prompt length's prefill seconds, into ``costs`` (one timed prefill each, after a warm one)."""
    target.prefill(list(prompts[0]))
    for prompt in prompts:
        t0 = time.perf_counter()
        target.prefill(list(prompt))
        costs.prefill_seconds[len(prompt)] = time.perf_counter() - t0


@dataclass
class Replay:
    """What a drafter proposes in the speculative loop over one reference output, and what it costs."""

    drafted: list[int] = field(default_factory=list)  # per step: tokens proposed
    accepted: list[int] = field(default_factory=list)  # per step: of them, accepted
    draft_seconds: list[float] = field(default_factory=list)


def replay_drafter(drafter: Drafter, prompt: Sequence[int], reference: Sequence[int], k: int,
                   max_new_tokens: int) -> Replay:
    """Run the drafter as ``speculative_generate`` would at draft length k, with the target's tokens taken from
    ``reference`` (its plain greedy output: what a lossless loop produces) instead of verify passes."""
    prompt, reference = list(prompt), list(reference)
    replay = Replay()
    drafter.reset()
    tokens = reference[:1]
    while len(tokens) < len(reference):
        kk = min(k, max_new_tokens - len(tokens) - 1)
        t0 = time.perf_counter()
        draft = drafter.draft_one(prompt + tokens, kk)[:kk] if kk > 0 else []
        replay.draft_seconds.append(time.perf_counter() - t0)
        n = accepted_length(draft, reference[len(tokens):])
        replay.drafted.append(len(draft))
        replay.accepted.append(n)
        tokens = reference[:len(tokens) + n + 1]
    return replay


def acceptance_per_position(replays: Sequence[Replay], k: int) -> list[float]:
    """a_i for i = 1..k: the share of steps that drafted at least i tokens whose first i were all accepted."""
    out = []
    for i in range(1, k + 1):
        eligible = [(d, a) for r in replays for d, a in zip(r.drafted, r.accepted) if d >= i]
        out.append(sum(a >= i for _, a in eligible) / len(eligible) if eligible else 0.0)
    return out


def predict(costs: TargetCosts, prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
            replays: Sequence[Replay], k: int) -> dict[str, Any]:
    """The predicted speed-up at draft length k, from the target's costs and the drafter's replays (one per
    prompt), with the terms of the formula."""
    plain = spec = draft = 0.0
    steps = drafted = accepted = 0
    for prompt, reference, replay in zip(prompts, references, replays):
        prefill = costs.prefill_seconds.get(len(prompt), 0.0)
        plain += prefill + (len(reference) - 1) * costs.step
        spec += prefill + sum(costs.verify(d + 1) for d in replay.drafted) + sum(replay.draft_seconds)
        draft += sum(replay.draft_seconds)
        steps += len(replay.drafted)
        drafted += sum(replay.drafted)
        accepted += sum(replay.accepted)
    return {"predicted_speedup": plain / spec if spec else 0.0,
            "tokens_per_step": 1 + accepted / steps if steps else 0.0,
            "drafted_per_step": drafted / steps if steps else 0.0,
            "draft_seconds_per_step": draft / steps if steps else 0.0,
            "draft_cost_per_token_vs_target_step": draft / drafted / costs.step if drafted else 0.0,
            "acceptance_per_position": acceptance_per_position(replays, k)}


def ceiling(costs: TargetCosts, k: int, draft_cost_per_token: float = 0.0) -> float:
    """The speed-up at k if every drafted token were accepted: (k + 1) c_1 / (c_v(k + 1) + k d)."""
    return (k + 1) * costs.step / (costs.verify(k + 1) + k * draft_cost_per_token * costs.step)


def verdict(costs: TargetCosts, ks: Sequence[int], per_drafter: dict[str, dict[str, dict[str, Any]]],
            engine: str) -> list[str]:
    """Plain sentences: what a free, perfect drafter could reach here, and for each drafter whether its draft
    cost leaves it any room to pay."""
    best_k = max(ks, key=lambda k: ceiling(costs, k))
    lines = [f"{engine}: a pass over k + 1 tokens costs " + ", ".join(
        f"{costs.verify(k + 1) / costs.step:.2f}x a one-token step (k = {k})" for k in ks)
        + f". A drafter that cost nothing and were always right would reach at most "
        f"{ceiling(costs, best_k):.2f}x (k = {best_k})."]
    for name, rows in per_drafter.items():
        d = statistics.median([r["draft_cost_per_token_vs_target_step"] for r in rows.values()
                               if r["draft_cost_per_token_vs_target_step"]] or [0.0])
        best = max(ceiling(costs, k, d) for k in ks)
        predicted = max(r["predicted_speedup"] for r in rows.values())
        if best <= 1.0:
            lines.append(f"{name}: a drafted token costs {d:.2f}x a target step, so even with every token "
                         f"accepted it cannot pay here (at most {best:.2f}x).")
        else:
            lines.append(f"{name}: a drafted token costs {d:.2f}x a target step; with every token accepted it "
                         f"would reach {best:.2f}x; at its acceptance the best predicted is {predicted:.2f}x"
                         + (" (it does not pay)." if predicted <= 1.0 else "."))
    return lines


def predict_speedups(target: TargetModel, drafters: Sequence[tuple[str, Drafter]],
                     prompts: Sequence[Sequence[int]], references: Sequence[Sequence[int]], ks: Sequence[int],
                     max_new_tokens: int, repeats: int = 5) -> dict[str, Any]:
    """Measure the target's costs, replay every (name, drafter) at every k, and predict each speed-up."""
    middle = sorted(prompts, key=len)[len(prompts) // 2]
    costs = measure_target_costs(target, middle, [k + 1 for k in ks] + list(range(1, max(ks) + 2)), repeats)
    measure_prefill(target, prompts, costs)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, drafter in drafters:
        out[name] = {}
        for k in ks:
            replays = [replay_drafter(drafter, p, r, k, max_new_tokens) for p, r in zip(prompts, references)]
            out[name][str(k)] = predict(costs, prompts, references, replays, k)
    return {"engine": target.engine, "costs": costs.as_json(), "drafters": out,
            "verdict": verdict(costs, ks, out, target.engine)}
