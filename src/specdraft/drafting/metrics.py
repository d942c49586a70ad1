"""Acceptance metrics for greedy drafts: counts first, ratios at the end.

A draft of k tokens is scored against the target's next k greedy tokens: the accepted length is the
longest common prefix. Two means are reported and named apart, because the field mixes them up:
``mean_accepted_pooled`` averages over evaluation points, ``mean_accepted_per_prompt`` first averages
within each prompt, then over prompts. Both are also given per category (the evaluation record's) and per
context-length bucket (``CONTEXT_BUCKETS``), where drafters differ most: lookup where the answer repeats a long
context, a draft model where the answer is new text.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

# Context-length buckets, in tokens of the evaluation point's context: (label, lower bound inclusive), ascending.
# Declared once; the eval record and report, and the demo's summary, read their labels from here.
CONTEXT_BUCKETS: tuple[tuple[str, int], ...] = (("<256", 0), ("256-1K", 256), ("1K-4K", 1024), (">=4K", 4096))


def context_bucket(tokens: int) -> str:
    """The label of the ``CONTEXT_BUCKETS`` bucket a context of ``tokens`` tokens falls in."""
    label = CONTEXT_BUCKETS[0][0]
    for name, lower in CONTEXT_BUCKETS:
        if tokens >= lower:
            label = name
    return label


def group_summary(lengths: Sequence[int], prompts: Sequence[str]) -> dict[str, float | int]:
    """Counts and means of one group of points (a category, a bucket): ``lengths`` their accepted lengths,
    ``prompts`` their prompt ids."""
    per_prompt: dict[str, list[int]] = defaultdict(list)
    for a, pid in zip(lengths, prompts):
        per_prompt[pid].append(a)
    means = [sum(v) / len(v) for v in per_prompt.values()]
    return {"points": len(lengths), "prompts": len(per_prompt), "accepted_total": sum(lengths),
            "mean_accepted": sum(lengths) / len(lengths) if lengths else 0.0,
            "mean_accepted_per_prompt": sum(means) / len(means) if means else 0.0}


# Prompts a paired difference needs before its bootstrap interval says anything: resampling fewer gives a handful of
# distinct means, and one prompt's points only its own
MIN_INTERVAL_PROMPTS = 4


def paired_difference(differences: Sequence[int | float], prompts: Sequence[str], resamples: int = 2000,
                      seed: int = 0) -> dict[str, Any]:
    """The mean of per-point ``differences`` (one drafter's accepted length minus another's at the same points) and
    its 90% bootstrap interval over prompts: a prompt's points are resampled together, as the points of one answer
    are not independent. ``below`` / ``above``: from ``MIN_INTERVAL_PROMPTS`` prompts, the whole interval is under /
    over zero (with fewer, neither is claimed)."""
    if len(differences) != len(prompts) or not differences:
        raise ValueError(f"paired_difference: {len(differences)} differences for {len(prompts)} prompt ids")
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for d, pid in zip(differences, prompts):
        sums[pid][0] += d
        sums[pid][1] += 1
    per_prompt = list(sums.values())
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        pick = [per_prompt[rng.randrange(len(per_prompt))] for _ in per_prompt]
        draws.append(sum(d for d, _ in pick) / sum(n for _, n in pick))
    draws.sort()
    low, high = draws[int(0.05 * resamples)], draws[int(0.95 * resamples)]
    enough = len(per_prompt) >= MIN_INTERVAL_PROMPTS
    return {"prompts": len(per_prompt), "difference": sum(differences) / len(differences),
            "interval_90": [low, high], "below": enough and high < 0, "above": enough and low > 0}


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
    """Accumulates accepted lengths of k-token drafts; per position, per category, per context-length bucket
    (when the context's length is given) and per prompt."""

    k: int = 16
    points: int = 0
    accepted_total: int = 0
    histogram: list[int] = field(default_factory=list)  # histogram[a] = points with accepted length a
    by_category: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    by_prompt: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    # each category's prompt ids, in step with by_category, and each bucket's (accepted length, prompt id): the
    # per-group per-prompt means
    by_category_prompt: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    by_bucket: dict[str, list[tuple[int, str]]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * (self.k + 1)

    def add(self, draft: Sequence[int], target: Sequence[int], *, prompt_id: str = "", category: str = "",
            context_tokens: int | None = None) -> int:
        if len(target) < self.k:
            raise ValueError(f"target has {len(target)} tokens, need k={self.k}")
        a = accepted_length(list(draft)[: self.k], list(target)[: self.k])
        self.points += 1
        self.accepted_total += a
        self.histogram[a] += 1
        self.by_category[category].append(a)
        self.by_category_prompt[category].append(prompt_id)
        self.by_prompt[prompt_id].append(a)
        if context_tokens is not None:
            self.by_bucket[context_bucket(context_tokens)].append((a, prompt_id))
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

    def per_category(self) -> dict[str, dict[str, float | int]]:
        """Per category (sorted): points, prompts, accepted total, pooled and per-prompt means."""
        return {c: group_summary(v, self.by_category_prompt[c]) for c, v in sorted(self.by_category.items()) if v}

    def per_context_length(self) -> dict[str, dict[str, float | int]]:
        """Per ``CONTEXT_BUCKETS`` bucket holding a point (in the buckets' order), as ``per_category``; empty where
        no context length was given."""
        return {label: group_summary([a for a, _ in self.by_bucket[label]], [p for _, p in self.by_bucket[label]])
                for label, _ in CONTEXT_BUCKETS if self.by_bucket.get(label)}

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
            "per_context_length": self.per_context_length(),
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
