"""What every benchmark shares: the machine record, timing, and the JSON result that BENCHMARKS.md is built from.

A result is ``bench/results/<name>.<cpu class>.json``: the benchmark's name, the command that reproduces it, the
date, the machine (``specdraft.core.machine``: CPU from /proc/cpuinfo as ``lscpu`` shows it, its class, the AVX2
emulation when on, torch's kernel capability) and the figures. One file per benchmark and CPU class holds the
current figures; git keeps the earlier ones. A benchmark with its own ``--out`` writes the same record there too
(``write_result(..., copy_to=)``), with the git sha and package versions that a file in a run directory carries.

Timing: ``timed`` (repeated calls of one function, the warm-up untimed), ``stopwatch`` (one block, wall and CPU
seconds), ``forward_seconds`` (one model forward on a KV cache, as the speculative loop runs it); ``median`` and
``percentile`` summarise them. Memory: ``rss_mb`` (a process's resident memory now) and ``RssSampler`` (sampled in
a thread while a block runs).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from prometheus_client.parser import text_string_to_metric_families

from specdraft.core.io import atomic_write_json
from specdraft.core.machine import machine
from specdraft.core.provenance import git_sha, package_versions
from specdraft.drafting.acceptance import percentile as interpolated_percentile
from specdraft.drafting.cached import CachedDraftModel
from specdraft.model.forward import crop_cache, extend

RESULTS = Path(__file__).resolve().parent / "results"


def machine_record() -> dict[str, Any]:
    return {**machine(), "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads()}


def command() -> str:
    """How this run was started, to reproduce it (the script path relative to the repository)."""
    argv = list(sys.argv)
    try:
        argv[0] = str(Path(argv[0]).resolve().relative_to(RESULTS.parents[1]))
    except ValueError:
        pass
    return ".venv/bin/python " + shlex.join(argv)


def result_record(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """What a result file holds: the benchmark's name, the command, the date, the machine and ``figures``."""
    return {"bench": name, "command": command(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": machine_record(), "figures": figures}


def result_path(name: str, machine_info: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """``<out_dir>/<name>.<cpu class>.json`` (``-emulated`` after the class under the AVX2 emulation)."""
    emulated = "-emulated" if machine_info["avx2_emulation"] else ""
    return out_dir / f"{name}.{machine_info['cpu_class']}{emulated}.json"


def write_result(name: str, figures: dict[str, Any], out_dir: Path = RESULTS,
                 copy_to: str | Path | None = None) -> Path:
    """``figures`` with the machine, date and command, as ``<out_dir>/<name>.<cpu class>.json``; with ``copy_to``
    (a benchmark's ``--out``) the same record there too, with the code's git sha and package versions."""
    record = result_record(name, figures)
    path = result_path(name, record["machine"], out_dir)
    atomic_write_json(path, record)
    if copy_to is not None:
        atomic_write_json(copy_to, {**record, "git_sha": git_sha(), "versions": package_versions()})
    return path


def save_result(name: str, figures: dict[str, Any], out: str | Path | None = None) -> Path:
    """``write_result`` with its copy at ``out`` (a benchmark's ``--out``), saying where they went."""
    path = write_result(name, figures, copy_to=out)
    print(f"wrote {path}" + (f" and {out}" if out is not None else ""), flush=True)
    return path


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line, its module docstring (how to run it, what it measures) as the help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_out_argument(parser: argparse.ArgumentParser, default: str | None = None, beside: str = "") -> None:
    """``--out``: a JSON file that gets the result record too (required where there is no default)."""
    parser.add_argument("--out", type=Path, required=default is None, default=default and Path(default),
                        help="JSON file that gets the result too (besides bench/results/NAME.CPU_CLASS.json)" + beside
                        + (f" (default: {default})" if default else ""))


def log_to_console() -> None:
    """INFO lines with time and logger on stderr; httpx's line per request left out."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


# ------------------------------------------------------------------------------------------------------- timing

def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
          reset: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, by ``clock`` (``time.process_time``:
    this process's CPU time); ``reset``, untimed, after every call, the warm-up ones included."""
    for _ in range(warmup):
        fn()
        if reset is not None:
            reset()
    out = []
    for _ in range(repeats):
        started = clock()
        fn()
        out.append(clock() - started)
        if reset is not None:
            reset()
    return out


@dataclass
class Lap:
    """What ``stopwatch`` measured: wall seconds and this process's CPU seconds."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Lap]:
    """Times the ``with`` block: ``lap.wall`` (``time.perf_counter``) and ``lap.cpu`` (``time.process_time``), set
    when the block ends."""
    lap = Lap()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield lap
    finally:
        lap.wall, lap.cpu = time.perf_counter() - wall, time.process_time() - cpu


def forward_seconds(model, n: int, context: int, repeats: int, clock: str = "cpu", forward: str = "model") -> float:
    """Median seconds of one forward of ``n`` tokens on a KV cache of ``context`` tokens (``clock`` "cpu": this
    process's CPU time, or "wall"): the model's own forward (``forward`` "model"), or a decode step as the
    speculative draft runs it (``CachedDraftModel``: "lean" = specdraft.lean, "compiled" = its torch.compile'd
    steps). The cache is cropped back to ``context`` after every forward."""
    drafter = CachedDraftModel(model, lean=forward != "model", compile=forward == "compiled")
    cache = drafter.cache
    keep = 1 if n == 1 else 0  # a decode step keeps the last logits; a verify pass needs all

    def run() -> None:
        if forward != "model":
            drafter.feed([5] * n, context)
        else:
            extend(model, [5] * n, cache, context, logits_to_keep=keep)

    with torch.inference_mode():
        extend(model, list(range(100, 100 + context)), cache, 0, logits_to_keep=1)
        # two warm-up forwards: they compile, where compiled (a fresh cache, then one that crop left as views)
        return median(timed(run, repeats, warmup=2, clock=time.process_time if clock == "cpu" else time.perf_counter,
                            reset=lambda: crop_cache(cache, context)))


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 to 100) by linear interpolation (``specdraft.drafting.acceptance.percentile``);
    None without values, as a result's JSON has no NaN."""
    return interpolated_percentile(values, q) if len(values) else None


# ------------------------------------------------------------------------------------------------------- a server

def metric_values(metrics_text: str) -> dict[str, float]:
    """A ``/metrics`` page's unlabelled samples by name, read with prometheus_client's own parser."""
    return {s.name: s.value for fam in text_string_to_metric_families(metrics_text) for s in fam.samples
            if not s.labels}


# ------------------------------------------------------------------------------------------------------- memory

def rss_mb(pid: int | None = None) -> float | None:
    """The resident memory of a process (this one by default) in MiB, from /proc; None once it has gone."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return None


class RssSampler:
    """A process's resident memory (this one's by default) while a ``with`` block runs, sampled every ``every``
    seconds in a thread: ``samples``, (seconds since the block began, MiB), the first on entry and the last on exit;
    sampling ends early when the process does."""

    def __init__(self, pid: int | None = None, every: float = 1.0):
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self.started = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()

    def elapsed(self) -> float:
        """Seconds since the block began: where ``since`` starts a later window."""
        return time.monotonic() - self.started

    def since(self, seconds: float) -> list[float]:
        """The MiB sampled from ``seconds`` after the block began on."""
        return [mb for t, mb in self.samples if t >= seconds]

    @property
    def peak_mb(self) -> float | None:
        return max((mb for _, mb in self.samples), default=None)

    def _sample(self) -> bool:
        mb = rss_mb(self.pid)
        if mb is not None:
            self.samples.append((self.elapsed(), mb))
        return mb is not None

    def _run(self) -> None:
        while not self._stop.wait(self.every) and self._sample():
            pass
