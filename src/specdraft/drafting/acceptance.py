"""How many of a drafter's k tokens the target would accept, on held-out evaluation points: the one metric path
(the eval stage, the training loop's held-out check and the benchmarks all call ``evaluate_drafter``).

Every point holds a context and the target's next 16 greedy tokens; the accepted length is the longest prefix
of the draft equal to them (greedy verification, ``drafting.metrics.accepted_length``).

At temperature (``evaluate_at_temperatures``): the expected accepted length of speculative sampling, computed
from the target's and the drafter's distributions, without sampling noise.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Sequence

import torch
from tqdm import tqdm

from specdraft.core.records import ValidationPoint, parse_point
from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError
from specdraft.drafting.batched import path_logits
from specdraft.drafting.hybrid_rule import guided_accepted
from specdraft.drafting.metrics import AcceptanceStats, ExpectedAcceptanceStats
from specdraft.model.sampling import GREEDY, SamplingParams, warp_probs

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

    Returns counts and the ratios computed from them (``AcceptanceStats.summary()``: overall, per category and per
    context-length bucket) plus the drafter's name, per-point accepted lengths and call latency. ``points`` may be
    ``ValidationPoint`` objects or validation.jsonl dicts. Drafts shorter than k (lookup) are fine: missing tokens
    count as rejected.
    """
    pts = _parse_points(points, k)
    if batch_size is None:
        batch_size = 4 * drafter.concurrency
    stats = AcceptanceStats(k=k)
    accepted: list[int] = []
    drafted: list[list[int]] = []
    call_seconds: list[float] = []
    drafter.take_latencies()  # drop latencies of earlier, unrelated calls
    bar = None
    if progress:
        bar = tqdm(total=len(pts), desc=f"eval {drafter.name}", unit="pt")
    started = time.perf_counter()
    for start in range(0, len(pts), batch_size):
        chunk = pts[start:start + batch_size]
        t0 = time.perf_counter()
        drafts = drafter.draft([p.context_ids for p in chunk], k)
        call_seconds.append(time.perf_counter() - t0)
        if len(drafts) != len(chunk):
            raise DrafterError(f"drafter returned {len(drafts)} drafts for {len(chunk)} contexts")
        for point, draft in zip(chunk, drafts):
            drafted.append([int(t) for t in list(draft)[:k]])
            accepted.append(stats.add(list(draft)[:k], point.target_ids[:k], prompt_id=point.id,
                                      category=point.category, context_tokens=len(point.context_ids)))
        if bar:
            bar.update(len(chunk))
    wall = time.perf_counter() - started
    if bar:
        bar.close()
    per_request = drafter.take_latencies()
    latency = (latency_summary(per_request, "request (one context)") if per_request
               else latency_summary(call_seconds, f"call (up to {batch_size} contexts)"))
    report = {
        "drafter": drafter.name,
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
        "per_point": [{"id": p.id, "offset": p.offset, "category": p.category, "context_tokens": len(p.context_ids),
                       "accepted": a, "draft": d} for p, a, d in zip(pts, accepted, drafted)],
    }
    return report


def _parse_points(points: Sequence[ValidationPoint | Mapping[str, Any]], k: int) -> list[ValidationPoint]:
    pts = [p if isinstance(p, ValidationPoint) else parse_point(p, k, f"point {i}") for i, p in enumerate(points)]
    if not pts:
        raise ValueError("no evaluation points")
    return pts


TEMPERATURE_NOTE = (
    "Expected accepted length of speculative sampling, from distributions (no sampling noise): at position i, "
    "alpha_i = sum_x min(p_i(x), q_i(x)) (the chance the target keeps a token drawn from the draft's q_i, its "
    "distribution p_i warped the same way), and the expected accepted length is sum_k prod_(i<=k) alpha_i. "
    "Approximation: p_i and q_i are taken along the point's reference continuation (the target's greedy tokens, "
    "teacher-forced), not along the tokens a sampled run would have kept. At temperature 0, p_i is the one-hot of "
    "the reference token and q_i the one-hot of the drafter's greedy draft at the point (as it decodes it), so the "
    "figures equal greedy acceptance exactly. A drafter that does not sample (prompt lookup) offers its k-token "
    "draft at the point, q one-hot, at every temperature; no proposal: alpha = 0.")


def temperature_key(temperature: float) -> str:
    """A temperature as the reports key it: "0.0", "0.7", "1.0"."""
    return str(float(temperature))


def acceptance_probabilities(p: torch.Tensor | Sequence[int], q: DraftDistributions) -> list[float]:
    """alpha_i = sum_x min(p_i(x), q_i(x)) per position. ``p``: [n, V] probabilities, or the reference token ids
    (p one-hot: alpha_i = q_i(reference token))."""
    support, probs = q.support.cpu(), q.probs.float().cpu()
    if isinstance(p, torch.Tensor):
        p = p.float().cpu()
        if support.numel() and int(support.max()) >= p.shape[-1]:  # draft ids past the target's vocab: p = 0
            p = torch.nn.functional.pad(p, (0, int(support.max()) + 1 - p.shape[-1]))
        p_on_support = p.gather(1, support)
    else:
        p_on_support = (support == torch.tensor([int(t) for t in p])[: len(support), None]).float()
    return torch.minimum(p_on_support, probs).sum(-1).tolist()


def evaluate_at_temperatures(drafter: Drafter, target, points: Sequence[ValidationPoint | Mapping[str, Any]],
                             temperatures: Sequence[float], k: int = 16, *, top_p: float = 1.0, top_k: int = 0,
                             greedy_drafts: Sequence[Sequence[int]] | None = None,
                             progress: bool = False) -> dict[str, Any]:
    """Acceptance under sampling at each temperature (``TEMPERATURE_NOTE``): per position and pooled.

    ``target``: the transformers model whose greedy continuations the points hold (p at every temperature); None
    when every temperature is 0. ``drafter.path_probs`` gives q. ``greedy_drafts`` (one per point, e.g.
    ``evaluate_drafter``'s ``per_point`` drafts): temperature 0 scores those instead of drafting again, so it is
    greedy acceptance by construction. Points on one token path (a prompt's points at several offsets) share one
    target forward, and one draft forward where the drafter's paths are teacher-forced.
    """
    pts = _parse_points(points, k)
    if greedy_drafts is not None and len(greedy_drafts) != len(pts):
        raise ValueError(f"{len(greedy_drafts)} greedy drafts for {len(pts)} points")
    settings = [SamplingParams(temperature=t, top_p=top_p, top_k=top_k) for t in temperatures]
    sampled = [params for params in settings if not params.greedy]
    if target is None and sampled:
        raise ValueError("acceptance at temperature > 0 needs the target's distributions: give the target")
    stats = {t: ExpectedAcceptanceStats(k=k) for t in temperatures}
    rows: dict[int, dict[str, Any]] = {}
    groups = shared_paths(pts, k)
    bar = tqdm(total=len(pts), desc=f"eval {drafter.name} at temperature", unit="pt") if progress else None
    for path, start, members in groups:
        logits = path_logits(target, path[:start], path[start:]) if sampled else None
        shared_q = (drafter.path_probs(path[:start], path[start:], sampled)
                    if sampled and drafter.teacher_forced_paths else None)
        for i in members:
            point = pts[i]
            reference, at = point.target_ids[:k], len(point.context_ids) - start
            if shared_q is not None:
                sampled_q = [q.rows(at, at + k) for q in shared_q]
            elif sampled:
                sampled_q = drafter.path_probs(point.context_ids, reference, sampled)
            else:
                sampled_q = []
            if greedy_drafts is not None:
                greedy_q = DraftDistributions.one_hot(list(greedy_drafts[i])[:k], k)
            elif len(sampled) < len(settings):
                greedy_q = drafter.path_probs(point.context_ids, reference, [GREEDY])[0]
            next_sampled = iter(sampled_q)
            row: dict[str, Any] = {"id": point.id, "offset": point.offset}
            for t, params in zip(temperatures, settings):
                if params.greedy:
                    alphas = acceptance_probabilities(reference, greedy_q)
                else:
                    alphas = acceptance_probabilities(warp_probs(logits[at:at + k], params), next(next_sampled))
                row[temperature_key(t)] = stats[t].add(alphas, prompt_id=point.id)
            rows[i] = row
            if bar:
                bar.update(1)
    if bar:
        bar.close()
    return {"what": TEMPERATURE_NOTE, "drafter": drafter.name, "k": k, "top_p": top_p, "top_k": top_k,
            "temperatures": {temperature_key(t): {"temperature": t, **stats[t].summary()} for t in temperatures},
            "per_point": [rows[i] for i in range(len(pts))]}


def shared_paths(points: Sequence[ValidationPoint], k: int) -> list[tuple[list[int], int, list[int]]]:
    """Points grouped by the token path they lie on: (path, start, member indices), where every member's
    context + first k reference tokens is a prefix of ``path`` and ``start`` is the shortest member context."""
    order = sorted(range(len(points)), key=lambda i: -(len(points[i].context_ids) + len(points[i].target_ids[:k])))
    groups: list[tuple[list[int], int, list[int]]] = []
    for i in order:
        sequence = list(points[i].context_ids) + list(points[i].target_ids[:k])
        for g, (path, start, members) in enumerate(groups):
            if path[:len(sequence)] == sequence:
                members.append(i)
                groups[g] = (path, min(start, len(points[i].context_ids)), members)
                break
        else:
            groups.append((sequence, len(points[i].context_ids), [i]))
    return groups


def guided_acceptance(drafter: Drafter, points: Sequence[ValidationPoint],
                      guides: Sequence[Sequence[Sequence[int]]], ratios: Sequence[float],
                      k: int = 16) -> list[dict[float, int]]:
    """Per point, the accepted length of the drafter's greedy draft guided by that point's guides (none: not
    scored) at each of ``ratios`` (``hybrid_rule.guided_accepted``), from its plain distributions along the
    point's reference tokens: one teacher-forced forward per token path (``shared_paths``). A prediction of what
    guided decoding drafts: a near-tie may round the other way in a decode step, as ``model_path_probs`` says of
    greedy drafts."""
    if not drafter.teacher_forced_paths:
        raise DrafterError(f"{drafter.name}: its distributions along a path are not teacher-forced")
    plain = SamplingParams(temperature=1.0)
    out: list[dict[float, int]] = [{} for _ in points]
    for path, start, members in shared_paths(points, k):
        wanted = [i for i in members if guides[i]]
        if not wanted:
            continue
        probs = drafter.path_probs(path[:start], path[start:], [plain])[0].probs
        for i in wanted:
            at, reference = len(points[i].context_ids) - start, points[i].target_ids[:k]
            rows = probs[at:at + len(reference)]
            out[i] = {r: guided_accepted(rows, reference, guides[i], r) for r in ratios}
    return out
