"""What machine this is, as every figure needs to say: the CPU (``lscpu``'s model name, family, model), the
instruction-set class its kernels can use, cores and memory; and the AVX2 emulation when it is on.

The class decides which compute format is fastest (``quant.compute_choice``): ``amx`` (Intel AMX tiles),
``avx512-bf16`` (AVX-512 with bf16 dot products: AMD Zen 4, Intel since Cooper Lake), ``avx512``, ``avx2``.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# torch / oneDNN / MKL told to use AVX2 kernels on a wider CPU (the brief's emulation of an AVX2-only machine)
AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line); empty where there is none."""
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_class(flags: set[str]) -> str:
    """``amx``, ``avx512-bf16``, ``avx512``, ``avx2`` or ``other``: the widest matrix/vector units the CPU lists."""
    if "amx_tile" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags else "other"


def avx2_emulated() -> bool:
    """Whether this process runs under the AVX2 emulation (every variable of ``AVX2_EMULATION`` set as it says)."""
    return all(os.environ.get(k, "").lower() == v.lower() for k, v in AVX2_EMULATION.items())


def machine() -> dict[str, Any]:
    """The record every benchmark and the demo's machine probe keep: CPU, class, cores, memory, emulation."""
    cpuinfo = _read("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "cpu family", "model") and key not in fields:
            fields[key] = value.strip()
    flags = cpu_flags(cpuinfo)
    native = cpu_class(flags)
    return {"cpu": fields.get("model name", platform.processor()), "cpu_family": fields.get("cpu family"),
            "cpu_model": fields.get("model"), "cpu_class": "avx2" if avx2_emulated() else native,
            "cpu_class_native": native, "avx2_emulation": avx2_emulated(),
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gb": _memory_gb(), "platform": platform.platform()}


def describe(record: dict[str, Any]) -> str:
    """One line: 'AMD EPYC (family 25, model 1), avx2, 2 CPUs' (+ 'AVX2 emulated on avx512-bf16')."""
    text = (f"{record['cpu']} (family {record['cpu_family']}, model {record['cpu_model']}), {record['cpu_class']}, "
            f"{record['cpus']} CPUs")
    return text + (f", AVX2 emulated on {record['cpu_class_native']}" if record.get("avx2_emulation") else "")


def _memory_gb() -> float | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
