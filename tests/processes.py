"""Killing a child process part-way through a resumable job, for the resume tests."""

import subprocess
import sys
import time
from pathlib import Path


def kill_once_written(code: str, args: list[str], out: Path, lines: int, timeout_s: float) -> int:
    """Run ``python -c code *args``, SIGKILL it once ``out`` holds ``lines`` lines, and return the lines it left;
    fails the test when the run ended on its own first (the kill would prove nothing)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if out.is_file() and out.read_bytes().count(b"\n") >= lines:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert proc.returncode == -9, "the run ended before it could be killed"
    return out.read_bytes().count(b"\n")
