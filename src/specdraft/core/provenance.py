"""What every artifact records about the code that made it (versions, git sha, argv), and a stage's log file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

TRACKED_PACKAGES = (
    "specdraft", "torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate",
    "huggingface_hub", "datasets", "numpy", "pydantic", "fastapi", "uvicorn",
)


def package_versions(names: Iterable[str] = TRACKED_PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_sha(cwd: str | os.PathLike | None = None) -> str | None:
    """The commit of the specdraft source tree (None outside a git checkout); '+dirty' when modified."""
    cwd = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata() -> dict[str, Any]:
    """What every artifact's JSON records about the code that made it."""
    return {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_sha": git_sha(),
        "versions": package_versions(),
        "argv": sys.argv,
    }


def setup_file_logging(log_path: str | os.PathLike, name: str = "specdraft") -> logging.Handler:
    """Attach a file handler for one stage run; the caller removes it when the stage ends."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:  # the file keeps INFO whatever the console shows
        logger.setLevel(logging.INFO)
    return handler


class stage_log:
    """Context manager: log a stage to RUN_DIR/NAME.log for its duration."""

    def __init__(self, log_path: str | os.PathLike, name: str = "specdraft"):
        self.log_path, self.name = log_path, name

    def __enter__(self) -> logging.Logger:
        self.handler = setup_file_logging(self.log_path, self.name)
        return logging.getLogger(self.name)

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.name).removeHandler(self.handler)
        self.handler.close()
