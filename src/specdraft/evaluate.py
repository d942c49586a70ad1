"""`specdraft eval`: how many of a drafter's k tokens the target would accept, on held-out points.

Every validation point holds a context and the target's next 16 greedy tokens. The drafter proposes k
tokens for the context; the accepted length is the longest prefix of the draft equal to the target's
tokens (greedy verification, ``specdraft.metrics.accepted_length``). ``evaluate_drafter`` is the one
metric path: the CLI, the training loop and the benchmarks all call it.

Drafters: ``HTTPDrafter`` (the draft server, concurrent requests), an in-process model (a packed QD04
dir via ``specdraft.pack.load_packed_model`` or a plain HF checkpoint dir via ``ModelDrafter``), or the
model-free ``LookupDrafter``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import Field, model_validator

from .config import StageConfig
from .metrics import AcceptanceStats
from .provenance import atomic_write_json, atomic_write_text, run_metadata, sha256_file, stage_log, text_lines

log = logging.getLogger("specdraft.evaluate")

MEANS_NOTE = ("mean_accepted_pooled = mean over all evaluation points (each point counts once); "
              "mean_accepted_per_prompt = mean over prompts of each prompt's own mean (each prompt counts "
              "once, however many points it has). Papers often report one under the name of the other.")


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
    compute: Literal["float32", "bfloat16", "int4"] = Field(
        "float32", description="in-process drafter's linear layers: float32 (QD04 dequantised), bfloat16, or "
                               "int4 (the QD04 codes, as the server runs them)")
    plots: bool = Field(True, description="write PNG plots")
    threads: int | None = Field(None, ge=1, description="torch CPU threads for an in-process drafter (None: "
                                                        "torch's default)")
    hybrid_min_ngram: int | None = Field(
        None, ge=1, le=4, description="with --server or --model-dir: prompt lookup first wherever the context's "
                                      "last N (or more, up to 4) tokens occurred before, the model only elsewhere "
                                      "(drafters.HybridDrafter; reported as its own drafter)")

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
        return self


# ------------------------------------------------------------------------------------------ points

@dataclass
class ValidationPoint:
    id: str
    category: str
    offset: int
    context_ids: list[int]
    target_ids: list[int]


class ValidationFileError(ValueError):
    """A validation file that cannot be used; the message names the file, line and field."""


def _int_list(value: Any, where: str, field: str, min_len: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValidationFileError(f"{where}: field {field!r} must be a list of ints")
    if len(value) < min_len:
        raise ValidationFileError(f"{where}: field {field!r} has {len(value)} ids, need at least {min_len}")
    if any(x < 0 for x in value):
        raise ValidationFileError(f"{where}: field {field!r} holds a negative token id")
    return value


def parse_point(obj: Mapping[str, Any], k: int, where: str = "point") -> ValidationPoint:
    if not isinstance(obj, Mapping):
        raise ValidationFileError(f"{where}: expected a JSON object")
    for field in ("id", "context_ids", "target_ids"):
        if field not in obj:
            raise ValidationFileError(f"{where}: missing field {field!r}")
    offset = obj.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValidationFileError(f"{where}: field 'offset' must be an integer >= 0, got {offset!r}")
    return ValidationPoint(id=str(obj["id"]), category=str(obj.get("category") or "all"), offset=offset,
                           context_ids=_int_list(obj["context_ids"], where, "context_ids", 1),
                           target_ids=_int_list(obj["target_ids"], where, "target_ids", k))


def load_validation(path: str | os.PathLike, k: int = 16, limit: int | None = None) -> list[ValidationPoint]:
    path = Path(path)
    if not path.is_file():
        raise ValidationFileError(f"{path}: no such file")
    points: list[ValidationPoint] = []
    for lineno, line in text_lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValidationFileError(f"{path}:{lineno}: not JSON ({e.msg})") from e
        points.append(parse_point(obj, k, f"{path}:{lineno}"))
        if limit and len(points) >= limit:
            break
    if not points:
        raise ValidationFileError(f"{path}: no evaluation points")
    return points


# ----------------------------------------------------------------------------------------- drafters

class DrafterError(RuntimeError):
    """A drafter that failed or answered something unusable."""


class HTTPDrafter:
    """Drafts from the draft server: one ``POST /draft`` per context, ``concurrency`` requests in flight.

    Keeps each request's latency (seconds); ``take_latencies()`` returns and clears them.
    """

    def __init__(self, url: str, concurrency: int = 8, timeout: float = 120.0, name: str | None = None):
        import httpx

        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self.name = name or self.url
        self._named = name is not None
        self._client = httpx.Client(base_url=self.url, timeout=timeout,
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="http-drafter")
        self._latencies: list[float] = []
        self._lock = threading.Lock()

    def draft_one(self, context: Sequence[int], num_tokens: int) -> list[int]:
        import httpx

        body = {"token_ids": [int(t) for t in context], "num_tokens": int(num_tokens)}
        started = time.perf_counter()
        try:
            response = self._client.post("/draft", json=body)
        except httpx.HTTPError as e:
            raise DrafterError(f"{self.url}/draft: request failed ({e.__class__.__name__}: {e})") from e
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise DrafterError(f"{self.url}/draft answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            answer = response.json()
        except ValueError as e:
            raise DrafterError(f"{self.url}/draft answered non-JSON: {response.text[:200]!r}") from e
        ids = answer.get("draft_ids") if isinstance(answer, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DrafterError(f"{self.url}/draft: 'draft_ids' is not a list of ints: {str(answer)[:200]}")
        with self._lock:
            self._latencies.append(elapsed)
            if not self._named and isinstance(answer.get("model"), str):
                self.name, self._named = answer["model"], True
        return ids

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        if len(contexts) == 1:
            return [self.draft_one(contexts[0], num_tokens)]
        return list(self._pool.map(lambda c: self.draft_one(c, num_tokens), contexts))

    def take_latencies(self) -> list[float]:
        with self._lock:
            out, self._latencies = self._latencies, []
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_draft_model(model_dir: str | os.PathLike, compute: str = "float32"):
    """A draft model in process: a packed QD04 dir (draft.qd4, via ``specdraft.pack.load_packed_model``)
    or a plain HF checkpoint dir. ``compute`` "bfloat16" / "int4" swaps the linear layers the way the
    server does (``specdraft.server.engine.apply_compute``; int4 runs the QD04 codes themselves).

    Returns (model, source) where source records what was loaded (path, format, weight sha256, compute).
    """
    import torch

    model_dir = Path(model_dir)
    group_size, quantized = None, None
    if (model_dir / "draft.qd4").is_file():
        from . import qd4
        from .pack import load_packed_model

        model, info = load_packed_model(model_dir, dtype=torch.float32)
        info = info.to_json() if hasattr(info, "to_json") else dict(info)
        source = {"path": str(model_dir), "format": "qd4", "weights_sha256": sha256_file(model_dir / "draft.qd4"),
                  "load_info": {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))}}
        group_size = info.get("group_size")
        if compute == "int4":
            quantized = qd4.load_qd4_quantized(model_dir / "draft.qd4", verify=False)  # verified by the loader
    else:
        from .models import describe_source, load_model

        source = {**describe_source(model_dir), "format": "hf"}
        model = load_model(model_dir, dtype=torch.float32)
    source["compute"] = compute
    if compute != "float32":
        from .server.engine import apply_compute

        kwargs = {"group_size": group_size} if group_size else {}
        summary = apply_compute(model, compute, quantized, **kwargs)
        source["compute_summary"] = {k: v for k, v in summary.items() if isinstance(v, (str, int, float, bool))}
    return model.eval(), source


def build_drafter(config: EvalConfig):
    """(drafter, source description) for the one drafter the config names."""
    from .drafters import HybridDrafter, LookupDrafter, ModelDrafter

    if config.lookup:
        return LookupDrafter(), {"kind": "lookup"}
    if config.server:
        drafter, source = (HTTPDrafter(config.server, config.concurrency, config.timeout_s),
                           {"kind": "http", "url": config.server})
    else:
        model, source = load_draft_model(config.model_dir, config.compute)
        name = f"{source['format']}:{Path(config.model_dir).name}"
        drafter, source = (ModelDrafter(model, name=name, max_batch_size=config.batch_size),
                           {"kind": "in-process", **source})
    if config.hybrid_min_ngram is not None:
        drafter = HybridDrafter(drafter, min_ngram=config.hybrid_min_ngram)
        source = {"kind": "hybrid", "min_ngram": config.hybrid_min_ngram, "model": source}
    return drafter, source


# ------------------------------------------------------------------------------------------- metric

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


def evaluate_drafter(drafter, points: Sequence[ValidationPoint | Mapping[str, Any]], k: int = 16, *,
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
        from tqdm import tqdm
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


# ------------------------------------------------------------------------------------------ reports

def report_markdown(report: Mapping[str, Any], title: str = "Draft acceptance") -> str:
    k = report["k"]
    lines = [f"# {title}: {report['drafter']}", "",
             f"{report['points']} evaluation points from {report['prompts']} prompts, k = {k}.", "",
             "| metric | value |", "|---|---|",
             f"| mean accepted length, pooled over points (of {k}) | {report['mean_accepted_pooled']:.3f} |",
             f"| mean accepted length, per-prompt mean (of {k}) | {report['mean_accepted_per_prompt']:.3f} |",
             f"| tokens per verify step (1 + pooled mean) | {report['tokens_per_verify_step']:.3f} |",
             f"| P(all {k} accepted) | {report['cumulative_acceptance'][-1]:.3f} |"]
    hybrid = report.get("hybrid")
    if hybrid:
        lines.append(f"| points drafted by prompt lookup (last {hybrid['min_ngram']}+ tokens seen before) / by "
                     f"the model | {hybrid['lookup_points']} / {hybrid['model_points']} |")
    lat = report.get("latency") or {}
    if lat.get("calls"):
        lines += [f"| latency p50 per {lat['unit']} | {lat['p50_ms']:.1f} ms |",
                  f"| latency p99 per {lat['unit']} | {lat['p99_ms']:.1f} ms |"]
    lines += ["", f"_{report['means_note']}_", "",
              "## Per position", "",
              "| position | cumulative P(1..i accepted) | conditional P(i \\| < i) |", "|---|---|---|"]
    support = report.get("conditional_support") or [1] * k
    for i, (cum, cond, n) in enumerate(zip(report["cumulative_acceptance"], report["conditional_acceptance"],
                                           support), 1):
        lines.append(f"| {i} | {cum:.3f} | {f'{cond:.3f} (n={n})' if n else '— (no point got here)'} |")
    lines += ["", "## Accepted length histogram", "", "| accepted | points |", "|---|---|"]
    lines += [f"| {a} | {n} |" for a, n in enumerate(report["histogram"])]
    lines += ["", "## Per category", "", "| category | points | mean accepted |", "|---|---|---|"]
    for cat, row in report["per_category"].items():
        lines.append(f"| {cat} | {row['points']} | {row['mean_accepted']:.3f} |")
    plots = report.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_plots(report: Mapping[str, Any], out: Path) -> list[str]:
    from . import plots

    name = report["drafter"]
    files = [
        plots.plot_acceptance_per_position(report["cumulative_acceptance"], report["conditional_acceptance"],
                                           out / "acceptance_per_position.png",
                                           f"acceptance per position: {name}",
                                           support=report.get("conditional_support")),
        plots.plot_histogram(report["histogram"], out / "accepted_length_histogram.png",
                             f"accepted length (of {report['k']}): {name}"),
        plots.plot_bars({c: r["mean_accepted"] for c, r in report["per_category"].items()},
                        out / "acceptance_per_category.png", ylabel=f"mean accepted length (of {report['k']})",
                        title=f"per category: {name}",
                        annotate={c: f"{r['mean_accepted']:.2f} (n={r['points']})"
                                  for c, r in report["per_category"].items()}),
    ]
    return [p.name for p in files]


def run_eval(config: EvalConfig) -> int:
    import torch

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    with stage_log(out / "eval.log"):
        points = load_validation(config.validation, config.k, config.limit)
        log.info("%d points from %s", len(points), config.validation)
        drafter, source = build_drafter(config)
        try:
            model = getattr(drafter, "model", None)
            if model is not None:
                vocab = model.config.vocab_size
                for p in points:
                    if max(p.context_ids) >= vocab:
                        raise ValidationFileError(f"{config.validation}: point {p.id!r} (offset {p.offset}) has "
                                                  f"token id {max(p.context_ids)} >= draft vocab size {vocab}")
            with torch.inference_mode():  # scoped: a library must not switch autograd off globally
                report = evaluate_drafter(drafter, points, config.k,
                                          batch_size=(4 * config.concurrency if config.server
                                                      else config.batch_size),
                                          progress=True)
        finally:
            if hasattr(drafter, "close"):
                drafter.close()
        report["drafter_source"] = source
        if hasattr(drafter, "lookup_used"):
            report["hybrid"] = {"min_ngram": drafter.min_ngram, "lookup_points": drafter.lookup_used,
                                "model_points": drafter.model_used}
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
        print(f"{report['drafter']}: mean accepted (of {config.k}) pooled {report['mean_accepted_pooled']:.3f}, "
              f"per-prompt {report['mean_accepted_per_prompt']:.3f}; report in {out}")
    return 0


__all__ = ["EvalConfig", "HTTPDrafter", "ValidationPoint", "evaluate_drafter", "load_validation",
           "load_draft_model", "run_eval"]
