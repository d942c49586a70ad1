"""Provenance helpers: hashes, atomic writes, versions and run metadata shared by every stage."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

TRACKED_PACKAGES = (
    "specdraft", "torch", "transformers", "tokenizers", "safetensors", "gguf", "accelerate",
    "huggingface_hub", "datasets", "numpy", "pydantic", "fastapi", "uvicorn",
)


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """One digest over several files, in the given order (names excluded, contents only)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(bytes.fromhex(sha256_file(path)))
    return digest.hexdigest()


def _current_umask() -> int:
    umask = os.umask(0)  # the only way to read it is to set it
    os.umask(umask)
    return umask


def make_shareable_dir(path: str | os.PathLike) -> None:
    """mkdtemp creates 0700; a directory that becomes an artifact gets the umask's mode like mkdir's."""
    os.chmod(path, 0o777 & ~_current_umask())


def make_shareable_file(path: str | os.PathLike) -> None:
    """mkstemp creates 0600; a file that becomes an artifact gets the umask's mode like open()'s."""
    os.chmod(path, 0o666 & ~_current_umask())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file in the same folder, fsync, then rename: readers never see a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        make_shareable_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from a file: every record and sidecar here is one. Invalid JSON, bytes that are not UTF-8
    or another JSON value raise ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, line) for each non-blank line of a UTF-8 text file such as a JSONL input; a line that is not
    UTF-8 raises ValueError naming the file and the line (the codec's own error names neither)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if line.strip():
                yield lineno, line


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
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
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
