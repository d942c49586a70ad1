"""The one way to run `specdraft serve` as a child process: selfcheck, the audit's sandbox, the demo, the
benchmarks and the tests all start, wait for and stop the server here.

The server binds port 0 and logs ``listening on URL``; ``wait_ready`` reads that line from the log file, then
polls ``/health`` until it answers 200 (or says the load failed). ``stop`` sends SIGTERM -- the server answers
what it has in flight and exits -- and SIGKILL after ``timeout``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import httpx

LISTENING = re.compile(r"listening on (http://\S+)")
LOADED_QD4 = re.compile(r"loaded qd4 missing=(\d+) unexpected=(\d+)")
PYTHON_MODULE = (sys.executable, "-m")  # how a module is run; the audit's sandbox puts its own launcher first


class ServerProcess:
    """`specdraft serve --model-dir DIR --port 0 [ARGS]` with its output in ``log_path``.

    ``launcher``: the command that runs a Python module (default ``python -m``); ``cwd`` / ``env``: the child's
    working dir and extra environment variables.
    """

    def __init__(self, model_dir: str | os.PathLike, log_path: str | os.PathLike, extra_args: Sequence[str] = (),
                 *, launcher: Sequence[str] = PYTHON_MODULE, cwd: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.argv = [*launcher, "specdraft.cli", "serve", "--model-dir", str(model_dir), "--port", "0", *extra_args]
        self.url: str | None = None
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log_file:  # the child keeps its own handle
            self.proc = subprocess.Popen(self.argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                         start_new_session=True)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 8) -> str:
        return " | ".join(self.log_text().strip().splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> tuple[bool, str]:
        """(ready, what happened): the 'listening on URL' line, then /health == 200, within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.url is None and (m := LISTENING.search(self.log_text())):
                    self.url = m.group(1).rstrip("/")
                if self.url is not None:
                    try:
                        r = client.get(self.url + "/health")
                        if r.status_code == 200:
                            return True, f"{self.url} healthy after {time.monotonic() - self.started:.1f}s"
                        if r.status_code == 503 and r.json().get("status") == "failed":
                            return False, f"/health says failed: {r.json().get('detail')}"
                    except (httpx.HTTPError, ValueError):
                        pass
                if self.proc.poll() is not None:
                    return False, f"server exited with code {self.proc.returncode}: {self.log_tail()}"
                time.sleep(0.2)
        return False, f"not healthy within {timeout:.0f}s: {self.log_tail()}"

    def loaded(self) -> tuple[int, int] | None:
        """(missing, unexpected) from the strict loader's log line, None when the log has none."""
        m = LOADED_QD4.search(self.log_text())
        return (int(m.group(1)), int(m.group(2))) if m else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; the exit code, None when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
