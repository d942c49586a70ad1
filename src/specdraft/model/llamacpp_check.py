"""llama.cpp built for what this CPU runs, and checked before anything uses it in process.

A native build (``-DGGML_NATIVE=ON``, i.e. ``-march=native``) turns on every instruction set the CPU *lists*. A
virtual machine can list Intel AMX (``amx_tile``) without letting a process execute tile instructions; ggml's AMX
kernels then die with SIGILL on the first matmul, killing the Python process that loaded them (nothing in process
can catch that). So:

- ``build_flags()``: before building llama-cpp-python, a small C probe, run in a child process, requests the AMX
  tile permission, configures and loads one tile; where the CPU lists AMX but the probe dies, the build leaves AMX
  out (``-mno-amx-*``), and keeps it where it runs.
- ``smoke()``: after the build, and once per process before specdraft uses the engine (``engine_problem``), a
  child process decodes a few tokens of the embedded target through llama-cpp-python. Dying by a signal is an
  error that names the CPU, the build flags and what to set -- never a dead process.

``python -m specdraft.model.llamacpp_check build-flags`` prints the CMAKE_ARGS the Makefile builds with;
``... smoke`` exits 1 with that message when the engine does not run here.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specdraft.core.machine import cpu_flags, describe, machine

NATIVE = "-DGGML_NATIVE=ON"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
SMOKE_TIMEOUT_S = 300
# Request the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), configure tile 0 as one
# row of 64 bytes (palette 1), load it and release: the instructions ggml's AMX kernels start with
AMX_PROBE = r"""
#include <stdio.h>
#include <unistd.h>
#include <sys/syscall.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("permission refused"); return 3; }
    static unsigned char config[64], rows[64];
    config[0] = 1; config[16] = 64; config[48] = 1;
    __asm__ volatile("ldtilecfg %0" :: "m"(config));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" :: "r"(rows), "r"((long)64));
    __asm__ volatile("tilerelease");
    puts("ok");
    return 0;
}
"""
SMOKE_CODE = """
import llama_cpp
from specdraft.model.specs import embedded_gguf_path
llm = llama_cpp.Llama(model_path=str(embedded_gguf_path("smollm2-135m-instruct")), n_ctx=64, n_threads=1,
                      verbose=False)
tokens = llm.tokenize(b"Hello, how are")
out = [t for _, t in zip(range(4), llm.generate(tokens, temp=0.0))]
print("decoded", len(out), "tokens")
"""


@dataclass(frozen=True)
class Outcome:
    """What a child process did: ok, or how it failed (its exit code or the signal that killed it) and its output."""

    ok: bool
    detail: str


def run_child(argv: Sequence[str], timeout: float = SMOKE_TIMEOUT_S) -> Outcome:
    """Run ``argv``; a death by signal is named (SIGILL: an instruction this CPU does not run)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(False, f"no answer within {timeout:.0f}s")
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    if proc.returncode < 0:
        return Outcome(False, f"killed by {signal.Signals(-proc.returncode).name}" + (f" ({tail})" if tail else ""))
    if proc.returncode:
        return Outcome(False, f"exit code {proc.returncode}" + (f": {tail}" if tail else ""))
    return Outcome(True, tail)


def amx_runs() -> Outcome | None:
    """Whether this process may execute AMX tile instructions (the probe, compiled and run in a child); None when
    the CPU does not list amx_tile (nothing to probe) or there is no C compiler to probe with."""
    if "amx_tile" not in cpu_flags():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "amx_probe.c", Path(tmp) / "amx_probe"
        source.write_text(AMX_PROBE)
        built = subprocess.run([compiler, "-O0", "-mamx-tile", str(source), "-o", str(binary)], capture_output=True,
                               text=True)
        if built.returncode:
            return Outcome(False, f"the probe does not compile ({built.stderr.strip()[-200:]})")
        return run_child([str(binary)], timeout=30)


def build_flags(environ: dict[str, str] | None = None) -> str:
    """CMAKE_ARGS for llama-cpp-python: the user's own when set, else a native build without AMX where the CPU lists
    AMX but cannot run it."""
    environ = os.environ if environ is None else environ
    if environ.get("CMAKE_ARGS"):
        return environ["CMAKE_ARGS"]
    amx = amx_runs()
    if amx is not None and not amx.ok:
        return f'{NATIVE} -DCMAKE_C_FLAGS="{NO_AMX}" -DCMAKE_CXX_FLAGS="{NO_AMX}"'
    return NATIVE


def smoke(code: str = SMOKE_CODE, timeout: float = SMOKE_TIMEOUT_S) -> Outcome:
    """A few greedy tokens of the embedded target through llama-cpp-python, in a child process."""
    return run_child([sys.executable, "-c", code], timeout)


def failure_message(outcome: Outcome) -> str:
    """What a user needs when the engine does not run: the CPU, its flags that matter, the build, what to do."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))
    amx = amx_runs()
    return (f"llama.cpp (llama-cpp-python) does not run on this CPU: decoding a few tokens of the embedded target "
            f"{outcome.detail}. CPU: {describe(machine())}; flags {' '.join(flags) or 'none of note'}"
            + (f"; the AMX probe: {'runs' if amx.ok else amx.detail}" if amx is not None else "")
            + f". Build flags now: {build_flags()}. Rebuild it for what this CPU runs: "
            f"`rm -f .venv/.installed-llama && make install-llama` (or set CMAKE_ARGS, e.g. "
            f"CMAKE_ARGS='{NATIVE} -DCMAKE_C_FLAGS=\"{NO_AMX}\" -DCMAKE_CXX_FLAGS=\"{NO_AMX}\"', and pip install "
            "--no-cache-dir --force-reinstall llama-cpp-python).")


@functools.lru_cache(maxsize=1)
def engine_problem() -> str | None:
    """Why the llama.cpp engine cannot be used in this process (it dies in a child), None when it runs: checked
    once per process, before specdraft loads it in process."""
    outcome = smoke()
    return None if outcome.ok else failure_message(outcome)


def main(argv: Sequence[str] | None = None) -> int:
    command = (list(sys.argv[1:]) if argv is None else list(argv)) or ["smoke"]
    if command[0] == "build-flags":
        print(build_flags())
        return 0
    if command[0] == "smoke":
        outcome = smoke()
        if outcome.ok:
            print(f"llama.cpp runs here: {outcome.detail}")
            return 0
        print(failure_message(outcome), file=sys.stderr)
        return 1
    print("usage: python -m specdraft.model.llamacpp_check [build-flags | smoke]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
