"""How many of a drafter's k tokens the target would accept, on held-out evaluation points: the one metric path
(the eval stage, the training loop's held-out check and the benchmarks all call ``evaluate_drafter``).

Every point holds a context and the target's next 16 greedy tokens; the accepted length is the longest prefix
of the draft equal to them (greedy verification, ``drafting.metrics.accepted_length``).
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

from tqdm import tqdm

from specdraft.core.records import ValidationPoint, parse_point
from specdraft.drafting.base import Drafter, DrafterError
from specdraft.drafting.metrics import AcceptanceStats

MEANS_NOTE = ("mean_accepted_pooled = mean over all evaluation points (each point counts once); "
              "mean_accepted_per_prompt = mean over prompts of each prompt's own mean (each prompt counts "
              "once, however many points it has). Papers often report one under the name of the other.")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(seconds: Sequence[float], unit: str) -> dict[str, Any]:
    ms = [s * 1000.0 for s in seconds]
    return {"unit": unit, "calls": len(ms),
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "mean_ms": sum(ms) / len(ms) if ms else math.nan}


def evaluate_drafter(drafter: Drafter, points: Sequence[ValidationPoint | Mapping[str, Any]], k: int = 16, *,
                     batch_size: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Ask ``drafter`` for k tokens at every point and score them against the target's tokens.

    Returns counts and the ratios computed from them (``AcceptanceStats.summary()``) plus the drafter's
    name, per-point accepted lengths and call latency. ``points`` may be ``ValidationPoint`` objects or
    validation.jsonl dicts. Drafts shorter than k (lookup) are fine: missing tokens count as rejected.
    """
    pts = [p if isinstance(p, ValidationPoint) else parse_point(p, k, f"point {i}") for i, p in enumerate(points)]
    if not pts:
        raise ValueError("no evaluation points")
    if batch_size is None:
        batch_size = 4 * getattr(drafter, "concurrency", 4)
    stats = AcceptanceStats(k=k)
    accepted: list[int] = []
    call_seconds: list[float] = []
    take = getattr(drafter, "take_latencies", None)
    if take:
        take()  # drop latencies of earlier, unrelated calls
    bar = None
    if progress:
        bar = tqdm(total=len(pts), desc=f"eval {getattr(drafter, 'name', 'drafter')}", unit="pt")
    started = time.perf_counter()
    for start in range(0, len(pts), batch_size):
        chunk = pts[start:start + batch_size]
        t0 = time.perf_counter()
        drafts = drafter.draft([p.context_ids for p in chunk], k)
        call_seconds.append(time.perf_counter() - t0)
        if len(drafts) != len(chunk):
            raise DrafterError(f"drafter returned {len(drafts)} drafts for {len(chunk)} contexts")
        for point, draft in zip(chunk, drafts):
            accepted.append(stats.add(list(draft)[:k], point.target_ids[:k], prompt_id=point.id,
                                      category=point.category))
        if bar:
            bar.update(len(chunk))
    wall = time.perf_counter() - started
    if bar:
        bar.close()
    per_request = take() if take else []
    latency = (latency_summary(per_request, "request (one context)") if per_request
               else latency_summary(call_seconds, f"call (up to {batch_size} contexts)"))
    report = {
        "drafter": getattr(drafter, "name", type(drafter).__name__),
        **stats.summary(),
        "means_note": MEANS_NOTE,
        # reached[i] = points with the first i+1 tokens accepted; conditional_support[i] = points that
        # reached position i+1 (the conditional's denominator; 0 = undefined, shown as a gap)
        "reached": stats.reached(),
        "conditional_support": [stats.points] + stats.reached()[:-1],
        "tokens_per_verify_step": 1.0 + stats.mean_accepted_pooled,
        "latency": latency,
        "wall_seconds": wall,
        "points_per_second": len(pts) / wall if wall > 0 else math.nan,
        "per_point": [{"id": p.id, "offset": p.offset, "category": p.category, "accepted": a}
                      for p, a in zip(pts, accepted)],
    }
    return report
