"""Small PNG helpers for reports (matplotlib's Agg canvas; no pyplot state, safe in threads and tests).

Each function takes plain numbers (what the report JSON holds) and writes one PNG.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specdraft.core.io import atomic_write_bytes


def _figure(width: float = 6.4, height: float = 4.0):
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def plot_acceptance_per_position(cumulative: Sequence[float], conditional: Sequence[float],
                                 path: str | os.PathLike, title: str = "acceptance per draft position",
                                 support: Sequence[int] | None = None) -> Path:
    """Cumulative P(first i tokens accepted) and conditional P(token i | tokens < i), positions 1..k.

    ``support[i]``: points that reached position i+1; where it is 0 the conditional is undefined and
    left out of the line (a gap, not a misleading 0).
    """
    fig = _figure()
    ax = fig.add_subplot()
    positions = list(range(1, len(cumulative) + 1))
    cond = [c if support is None or n else float("nan") for c, n in zip(conditional, support or conditional)]
    ax.plot(positions, list(cumulative), marker="o", label="cumulative  P(tokens 1..i accepted)")
    ax.plot(positions, cond, marker="s", label="conditional  P(token i | tokens < i)")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(positions)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def plot_histogram(histogram: Sequence[int], path: str | os.PathLike,
                   title: str = "accepted length histogram") -> Path:
    """Points per accepted length 0..k."""
    fig = _figure()
    ax = fig.add_subplot()
    lengths = list(range(len(histogram)))
    ax.bar(lengths, list(histogram), color="tab:blue")
    ax.set_xlabel("accepted length")
    ax.set_ylabel("evaluation points")
    ax.set_xticks(lengths)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)


def plot_bars(values: Mapping[str, float], path: str | os.PathLike, *, ylabel: str, title: str,
              annotate: Mapping[str, str] | None = None) -> Path:
    """One bar per key (e.g. mean accepted length per category)."""
    names = list(values)
    fig = _figure(max(6.4, 0.6 * len(names) + 2))
    ax = fig.add_subplot()
    bars = ax.bar(range(len(names)), [values[n] for n in names], color="tab:green")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30 if len(names) > 4 else 0, ha="right" if len(names) > 4 else "center")
    for bar, name in zip(bars, names):
        label = (annotate or {}).get(name)
        if label:
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    return _save(fig, path)


def _line_figure(series: Mapping[str, Mapping[int, float]]):
    """(figure, axes, every x) with one marked line per series over its integer x values."""
    fig = _figure()
    ax = fig.add_subplot()
    all_x: set[int] = set()
    for name, points in series.items():
        xs = sorted(points)
        all_x.update(xs)
        ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
    return fig, ax, sorted(all_x)


def _finish_lines(fig, ax, path: str | os.PathLike, *, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def plot_throughput_by_k(series: Mapping[str, Mapping[int, float]], baseline: float, path: str | os.PathLike,
                         title: str = "speculative decoding throughput", ylabel: str = "tokens/s") -> Path:
    """tokens/s per k, one line per drafter, and the plain greedy baseline as a horizontal line."""
    fig, ax, all_k = _line_figure(series)
    ax.axhline(baseline, color="gray", linestyle="--", label=f"plain greedy ({baseline:.1f} tok/s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_k)
    ax.set_xticklabels([str(k) for k in all_k])
    return _finish_lines(fig, ax, path, xlabel="draft tokens per step k", ylabel=ylabel, title=title)


def plot_lines(series: Mapping[str, Mapping[int, float]], path: str | os.PathLike, *, xlabel: str, ylabel: str,
               title: str) -> Path:
    """One line per series over integer x values."""
    fig, ax, _ = _line_figure(series)
    return _finish_lines(fig, ax, path, xlabel=xlabel, ylabel=ylabel, title=title)
