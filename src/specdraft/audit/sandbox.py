"""The serve link's sandbox: `specdraft serve` started under ``sandbox_main.py`` (outgoing sockets blocked, every
file open, bind and spawn recorded), one POST /draft, then the recorded events read back and every opened path
classified as model dir, Python code, system, the server's own temp files, or other (a finding).
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import httpx

import specdraft
from specdraft.core.io import sha256_file
from specdraft.server.process import ServerProcess

# Launched by path: it must install its hook before anything of specdraft is imported.
SANDBOX_PATH = Path(__file__).with_name("sandbox_main.py")

# What an import reads inside the Python roots: code, and package metadata (importlib.metadata, entry points).
PYTHON_CODE = re.compile(r"\.(py|pyc|pyd|pth|typed)$|\.so(\.\d+)*$")
PYTHON_METADATA_DIR = re.compile(r"/[^/]+\.(dist|egg)-info(/|$)")


@dataclass
class SandboxResult:
    url: str | None = None
    error: str | None = None
    draft_ids: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    loaded: tuple[int, int] | None = None
    opens: dict[str, bool] = field(default_factory=dict)  # path -> opened for writing at least once
    network: list[dict] = field(default_factory=list)
    binds: list[str] = field(default_factory=list)
    spawned: list[dict] = field(default_factory=list)
    python_roots: list[str] = field(default_factory=list)
    sandbox_dir: str | None = None  # the server's own working dir
    created: set[str] = field(default_factory=set)  # files the server created itself
    absent: set[str] = field(default_factory=set)  # paths that did not exist at any of their opens
    returncode: int | None = None
    seconds: float = 0.0
    log_tail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "error": self.error, "draft_ids": self.draft_ids, "loaded": self.loaded,
                "files_opened": len(self.opens), "network": self.network, "binds": self.binds,
                "spawned": self.spawned, "returncode": self.returncode, "seconds": round(self.seconds, 2)}


def sandbox_command(events: Path) -> list[str]:
    """The launcher that runs a Python module (the arguments that follow) under the sandbox, recording to
    ``events``; run it in a fresh working directory, which becomes the sandbox's own dir."""
    return [sys.executable, str(SANDBOX_PATH), str(events), "--"]


def read_sandbox_events(path: Path, result: SandboxResult) -> None:
    if not path.is_file():
        return
    existed: set[str] = set()  # paths some open found on disk
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        kind = e.get("event")
        if kind == "start":
            result.python_roots = list(e.get("python_roots") or [])
            result.sandbox_dir = e.get("sandbox_dir")
        elif kind == "open":
            p = e["path"]
            result.opens[p] = result.opens.get(p, False) or bool(e.get("write"))
            if e.get("created"):
                result.created.add(p)
            if e.get("missing"):
                result.absent.add(p)
            else:
                existed.add(p)
        elif kind == "bind":
            result.binds.append(str(e.get("address")))
            if e.get("blocked"):
                result.network.append(e)
        elif kind in ("connect", "getaddrinfo", "gethostbyname", "gethostbyaddr", "sendto", "urllib"):
            result.network.append(e)
        elif kind == "spawn":
            result.spawned.append(e)
    result.absent -= existed


def run_server_sandboxed(model_dir: Path, log_path: Path, events: Path, context: list[int],
                         timeout_s: float = 120.0, num_tokens: int = 4) -> SandboxResult:
    """`specdraft serve --model-dir DIR --port 0` in the sandbox: wait for it, POST one /draft, stop it."""
    started = time.monotonic()
    deadline = started + timeout_s
    result = SandboxResult()
    events.parent.mkdir(parents=True, exist_ok=True)
    events.unlink(missing_ok=True)
    sandbox_dir = Path(tempfile.mkdtemp(prefix="specdraft-audit-sandbox-"))
    try:
        server = ServerProcess(model_dir, log_path, ["--host", "127.0.0.1", "--threads", "1"],
                               launcher=sandbox_command(events), cwd=sandbox_dir,
                               # no .pyc writes: a stale bytecode cache is not the server writing files
                               env={"PYTHONDONTWRITEBYTECODE": "1"})
        try:
            ready, what = server.wait_ready(timeout_s)
            result.url = server.url
            if ready:
                _post_draft(result, context, num_tokens, deadline)
            else:
                result.error = what
        finally:
            result.returncode = server.stop(timeout=15.0)
        result.loaded = server.loaded()
        result.log_tail = "\n".join(server.log_text().splitlines()[-20:])
    finally:
        shutil.rmtree(sandbox_dir, ignore_errors=True)
    result.seconds = time.monotonic() - started
    read_sandbox_events(events, result)
    return result


def _post_draft(result: SandboxResult, context: list[int], num_tokens: int, deadline: float) -> None:
    t = time.monotonic()
    try:
        with httpx.Client(trust_env=False) as client:
            r = client.post(result.url + "/draft", json={"token_ids": context, "num_tokens": num_tokens},
                            timeout=max(1.0, deadline - time.monotonic()))
        body = r.json()
        if r.status_code != 200 or len(body.get("draft_ids", [])) != num_tokens:
            result.error = f"POST /draft answered {r.status_code}: {str(body)[:200]}"
        else:
            result.draft_ids = body["draft_ids"]
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"POST /draft failed: {type(e).__name__}: {e}"
    result.draft_seconds = time.monotonic() - t


def allowed_roots(model_dir: Path, python_roots: Iterable[str], denied: Iterable[str | os.PathLike] = (),
                  own_dirs: Iterable[str | os.PathLike | None] = (), created: Iterable[str] = (),
                  absent: Iterable[str] = ()) -> dict[str, list[str]]:
    """Where the server may read: the model dir; code, package metadata and the installed wheels' own data files
    (unchanged since the install) of the Python installation (and of specdraft's own package dir, which an
    editable install keeps outside it); /proc, /sys, /dev but /dev/shm;
    its own sandbox dir (``own_dirs``) and the files it created itself (``created``). No other temp file: a
    table left in /tmp is data the model dir does not declare. ``absent`` (paths no open found on disk: import
    probes) are harmless inside the Python roots. ``denied`` (the run dir) is never allowed outside the model
    dir, even when it lies in a temp dir."""
    path_entries = {os.path.realpath(p) for p in python_roots if p}
    python = path_entries | {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                           sys.base_exec_prefix)}
    python.add(os.path.realpath(Path(specdraft.__file__).parent))
    return {"model_dir": [os.path.realpath(model_dir)], "denied": sorted(os.path.realpath(d) for d in denied),
            "python": sorted(python), "python_path": sorted(path_entries),
            "system": ["/proc", "/sys", "/dev"], "not_system": ["/dev/shm"],
            "temp": sorted(os.path.realpath(d) for d in own_dirs if d), "created": sorted(created),
            "absent": sorted(absent)}


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _python_file(path: str, absent: bool) -> bool:
    """A file an import may read: code or package metadata; or a probe of a path that did not exist."""
    return absent or bool(PYTHON_CODE.search(path) or PYTHON_METADATA_DIR.search(path))


@functools.lru_cache(maxsize=4)
def _recorded_files(search_path: tuple[str, ...]) -> dict[str, str]:
    """Real path -> recorded sha256 of every file an installed distribution's RECORD lists with a hash."""
    files: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=list(search_path)):
        for f in dist.files or ():
            if f.hash is not None and f.hash.mode == "sha256":
                files[os.path.realpath(f.locate())] = f.hash.value
    return files


def _installed_data_file(path: str, python_roots: list[str]) -> bool:
    """A data file an installed wheel ships (a package's own JSON, say): listed in its distribution's RECORD and
    still byte for byte what the RECORD hashes. A file planted beside a package is in no RECORD; one edited
    after the install no longer matches its hash; both stay findings."""
    real = os.path.realpath(path)
    recorded = _recorded_files(tuple(sorted({*python_roots, *sys.path})))
    if real not in recorded:
        return False
    try:
        digest = bytes.fromhex(sha256_file(real))
    except OSError:
        return False
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == recorded[real]  # RECORD's form of a sha256


def classify_path(path: str, roots: dict[str, list[str]]) -> str:
    """model_dir | python | system | temp (the server's own) | other (a finding)."""
    real = os.path.realpath(path)
    forms = (path, real)

    def within(kind: str) -> bool:
        return any(under(p, r) for r in roots.get(kind, ()) for p in forms)
    if within("model_dir"):
        return "model_dir"
    if within("denied"):
        return "other"
    if path in roots.get("created", ()) or within("temp"):
        return "temp"
    if within("system") and not within("not_system"):
        return "system"
    if within("python"):
        absent = path in roots.get("absent", ())
        if all(_python_file(p, absent) for p in forms) or _installed_data_file(path, roots.get("python_path", [])):
            return "python"
        return "other"
    return "other"


def classify_opens(opens: Iterable[str], roots: dict[str, list[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {k: set() for k in ("model_dir", "python", "system", "temp", "other")}
    for p in opens:
        out[classify_path(p, roots)].add(p)
    return out
