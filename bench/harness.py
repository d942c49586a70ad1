"""What every benchmark shares: the machine record, timing, and the JSON result that BENCHMARKS.md is built from.

A result is ``bench/results/<name>.<cpu class>.json``: the benchmark's name, the command that reproduces it, the
date, the machine (``specdraft.core.machine``: CPU from /proc/cpuinfo as ``lscpu`` shows it, its class, the AVX2
emulation when on, torch's kernel capability) and the figures. One file per benchmark and CPU class holds the
current figures; git keeps the earlier ones.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from specdraft.core.io import atomic_write_json
from specdraft.core.machine import machine

RESULTS = Path(__file__).resolve().parent / "results"


def machine_record() -> dict[str, Any]:
    import torch

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


def write_result(name: str, figures: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    """``figures`` with the machine, date and command, as ``<out_dir>/<name>.<cpu class>.json``."""
    record = machine_record()
    path = out_dir / f"{name}.{record['cpu_class']}{'-emulated' if record['avx2_emulation'] else ''}.json"
    atomic_write_json(path, {"bench": name, "command": command(),
                             "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": record,
                             "figures": figures})
    return path


def timed(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)
