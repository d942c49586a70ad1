"""Files: hashes, atomic writes, readers of JSON and JSONL that name the file and line on bad input, the one
JSONL writer, and safetensors headers. No torch: every layer above uses these.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

COMMIT_RE = re.compile(r"[0-9a-f]{40}")  # a pinned git / hub revision
SHA256_RE = re.compile(r"[0-9a-f]{64}")


class RecordFileError(ValueError):
    """A records file (JSONL input or a stage's resumable output) that cannot be used; the message names the
    file, the line and the reason."""


# ------------------------------------------------------------------------------------------------ hashes

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


# ------------------------------------------------------------------------------------------ atomic writes

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


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """A temp path in ``path``'s folder to write the file at; on a clean exit it is fsynced, given the umask's mode
    and renamed onto ``path`` (readers never see a torn file), on an error removed. The one atomic file write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        make_shareable_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A temp folder beside ``path`` to build a directory artifact in; on a clean exit it replaces ``path`` (an
    older one is removed first), on an error it is removed. The one atomic directory write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    make_shareable_dir(tmp)  # mkdtemp makes it 0700; it becomes the artifact
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``atomic_file``)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


# ------------------------------------------------------------------------------------------------ reading

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


# -------------------------------------------------------------------------------------------------- JSONL

# json.dumps leaves these raw, and str.splitlines() breaks lines on them: escaped, a row stays one line for
# every reader
_LINE_BREAKS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def jsonl_line(obj: Any) -> str:
    """The one JSONL writer: compact JSON, UTF-8 kept, line-breaking characters escaped (no newline added)."""
    line = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (json.loads accepts "\ud83d"): escaped, the row stays writable
        line = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    for ch, esc in _LINE_BREAKS.items():
        line = line.replace(ch, esc)
    return line


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSONL file this project wrote (torn last line already
    cut by ``repair_jsonl``); a line that is not JSON raises RecordFileError naming the file and line."""
    try:
        for lineno, line in text_lines(path):
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordFileError(f"{path}:{lineno}: not valid JSON ({e.msg}); the file is damaged beyond a "
                                      "torn last line: move it away and rerun") from None
    except RecordFileError:
        raise
    except ValueError as e:  # text_lines: a line that is not UTF-8
        raise RecordFileError(f"{e}; the file is damaged: move it away and rerun") from None


def repair_jsonl(path: Path) -> int:
    """Cut a torn last line (a write killed half-way) so the file ends with a newline; returns the bytes cut."""
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        pos = size
        chunk = 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        cut = size - keep
        if cut:
            f.truncate(keep)
    if cut:
        log.warning("%s: discarded a torn last line (%d bytes) left by an interrupted run", path, cut)
    return cut


def drop_last_group(path: Path, key: str = "id") -> str | None:
    """Truncate the lines of the last ``key`` value: a group written by one flush may be cut short by a kill
    (validation writes all points of a prompt together). Returns the key dropped."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    last_key, group_start, offset = None, 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():  # blank lines are skipped, as read_jsonl skips them
                offset += len(raw)
                continue
            try:
                k = json.loads(raw)[key]
            except (ValueError, KeyError, TypeError):  # ValueError: not JSON, or not UTF-8
                raise RecordFileError(f"{path}:{lineno}: not a JSON object with {key!r}; the file is damaged beyond "
                                  "a torn last line: move it away and rerun") from None
            if k != last_key:
                last_key, group_start = k, offset
            offset += len(raw)
    with open(path, "r+b") as f:
        f.truncate(group_start)
    return last_key


# ------------------------------------------------------------------------------------------- safetensors

def safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON), no tensor data read;
    ValueError naming the file when the header cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: {len(head)} bytes: shorter than the 8-byte header length")
        header_len = int.from_bytes(head, "little")
        size = path.stat().st_size
        if header_len > size - 8:
            raise ValueError(f"{path}: truncated: the header claims {header_len:,} bytes, {size - 8:,} follow its "
                             "length")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return header


def safetensors_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """Tensor name -> shape, from the header alone."""
    return {k: list(v["shape"]) for k, v in safetensors_header(path).items() if k != "__metadata__"}


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be loaded as it is (None when its header is sound and the file is exactly
    as long as the header says): read from the header alone, so a truncated download or copy is refused before
    transformers builds a model around it."""
    try:
        header = safetensors_header(path)
    except ValueError as e:
        return str(e).removeprefix(f"{path}: ")
    offsets = [entry.get("data_offsets") if isinstance(entry, dict) else None
               for name, entry in header.items() if name != "__metadata__"]
    if not all(isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o) for o in offsets):
        return "a tensor's data_offsets are not two integers"
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    expected = 8 + header_len + max((end for _, end in offsets), default=0)
    if size < expected:
        return f"truncated: {size:,} bytes, the header's tensors need {expected:,}"
    if size > expected:
        return f"{size - expected:,} bytes after the last tensor (expected {expected:,} bytes in all)"
    return None
