"""Acceptance metrics for greedy drafts: counts first, ratios at the end.

A draft of k tokens is scored against the target's next k greedy tokens: the accepted length is the
longest common prefix. Two means are reported and named apart, because the field mixes them up:
``mean_accepted_pooled`` averages over evaluation points, ``mean_accepted_per_prompt`` first averages
within each prompt, then over prompts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence


def accepted_length(draft: Sequence[int], target: Sequence[int]) -> int:
    """Longest prefix of ``draft`` equal to ``target`` (greedy verification)."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


@dataclass
class AcceptanceStats:
    """Accumulates accepted lengths of k-token drafts; per position, per category and per prompt."""

    k: int = 16
    points: int = 0
    accepted_total: int = 0
    histogram: list[int] = field(default_factory=list)  # histogram[a] = points with accepted length a
    by_category: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    by_prompt: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * (self.k + 1)

    def add(self, draft: Sequence[int], target: Sequence[int], *, prompt_id: str = "", category: str = "") -> int:
        if len(target) < self.k:
            raise ValueError(f"target has {len(target)} tokens, need k={self.k}")
        a = accepted_length(list(draft)[: self.k], list(target)[: self.k])
        self.points += 1
        self.accepted_total += a
        self.histogram[a] += 1
        self.by_category[category].append(a)
        self.by_prompt[prompt_id].append(a)
        return a

    # -- ratios, computed at the end
    @property
    def mean_accepted_pooled(self) -> float:
        return self.accepted_total / self.points if self.points else 0.0

    @property
    def mean_accepted_per_prompt(self) -> float:
        means = [sum(v) / len(v) for v in self.by_prompt.values() if v]
        return sum(means) / len(means) if means else 0.0

    def reached(self) -> list[int]:
        """reached[i] = points whose accepted length is > i (position i+1 was accepted)."""
        out, running = [0] * self.k, 0
        for a in range(self.k, 0, -1):
            running += self.histogram[a]
            out[a - 1] = running
        return out

    def cumulative_acceptance(self) -> list[float]:
        """P(the first i+1 draft tokens are all accepted), for i = 0..k-1."""
        return [r / self.points if self.points else 0.0 for r in self.reached()]

    def conditional_acceptance(self) -> list[float]:
        """P(token i accepted | tokens 0..i-1 accepted)."""
        reached = self.reached()
        prev = [self.points] + reached[:-1]
        return [r / p if p else 0.0 for r, p in zip(reached, prev)]

    def per_category(self) -> dict[str, dict[str, float]]:
        return {c: {"points": len(v), "mean_accepted": sum(v) / len(v)}
                for c, v in sorted(self.by_category.items()) if v}

    def summary(self) -> dict:
        return {
            "k": self.k,
            "points": self.points,
            "prompts": len(self.by_prompt),
            "accepted_total": self.accepted_total,
            "mean_accepted_pooled": self.mean_accepted_pooled,
            "mean_accepted_per_prompt": self.mean_accepted_per_prompt,
            "histogram": list(self.histogram),
            "cumulative_acceptance": self.cumulative_acceptance(),
            "conditional_acceptance": self.conditional_acceptance(),
            "per_category": self.per_category(),
        }


# ------------------------------------------------------------------------------ acceptance at temperature

def expected_accepted_length(alphas: Sequence[float]) -> float:
    """sum_k prod_{i<=k} alpha_i: the expected accepted length of one speculative step when token i is kept with
    probability alpha_i once tokens 1..i-1 were (speculative sampling keeps it with sum_x min(p_i(x), q_i(x)))."""
    total, reach = 0.0, 1.0
    for a in alphas:
        reach *= a
        total += reach
    return total


@dataclass
class ExpectedAcceptanceStats:
    """Accumulates per-position acceptance probabilities alpha_1..alpha_k of evaluation points; sums first,
    ratios at the end. With 0/1 alphas (greedy) every figure equals ``AcceptanceStats``'."""

    k: int = 16
    points: int = 0
    expected_total: float = 0.0
    reach_sums: list[float] = field(default_factory=list)  # sum over points of P(tokens 1..i all kept)
    alpha_sums: list[float] = field(default_factory=list)  # sum over points of alpha_i
    by_prompt: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self):
        self.reach_sums = self.reach_sums or [0.0] * self.k
        self.alpha_sums = self.alpha_sums or [0.0] * self.k

    def add(self, alphas: Sequence[float], *, prompt_id: str = "") -> float:
        if len(alphas) != self.k:
            raise ValueError(f"got {len(alphas)} acceptance probabilities, need k={self.k}")
        reach = 1.0
        for i, a in enumerate(alphas):
            reach *= a
            self.reach_sums[i] += reach
            self.alpha_sums[i] += a
        expected = expected_accepted_length(alphas)
        self.points += 1
        self.expected_total += expected
        self.by_prompt[prompt_id].append(expected)
        return expected

    def summary(self) -> dict:
        n = self.points
        cumulative = [r / n if n else 0.0 for r in self.reach_sums]
        previous = [float(n)] + self.reach_sums[:-1]
        means = [sum(v) / len(v) for v in self.by_prompt.values() if v]
        return {
            "points": n,
            "mean_expected_accepted_pooled": self.expected_total / n if n else 0.0,
            "mean_expected_accepted_per_prompt": sum(means) / len(means) if means else 0.0,
            "expected_cumulative_acceptance": cumulative,
            # P(token i kept | tokens < i kept), pooled: the ratio of consecutive reach sums (0 where none reach)
            "expected_conditional_acceptance": [r / p if p else 0.0 for r, p in zip(self.reach_sums, previous)],
            "mean_alpha": [a / n if n else 0.0 for a in self.alpha_sums],
        }
