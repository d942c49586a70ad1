"""What every link of the audit shares: the run's paths, the findings so far and how one is added (each cites
the file and field it rests on), the artifacts each read once (JSON, JSONL, sha256), and the target's tokenizer
and model, loaded once for the checks that decode or re-score with them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM

from specdraft.audit.config import AuditConfig
from specdraft.core.io import sha256_file
from specdraft.model.loader import WEIGHT_FILE
from specdraft.model.specs import load_tokenizer, weight_files

log = logging.getLogger(__name__)

STATUSES = ("pass", "fail", "warn", "skip")
SECTIONS = ("data", "traces", "training", "pack", "export", "serve")


@dataclass
class Finding:
    section: str
    check: str
    status: str  # pass | fail | warn | skip
    message: str
    cites: list[dict[str, str]] = field(default_factory=list)  # [{"file", "field"}]
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"section": self.section, "check": self.check, "status": self.status, "message": self.message,
                "cites": self.cites, "details": self.details}


def short(sha: Any) -> str:
    return f"{sha[:12]}…" if isinstance(sha, str) and len(sha) > 12 else repr(sha)


def listed(items: list[str], limit: int) -> list[str]:
    return items[:limit] + ([f"... and {len(items) - limit} more"] if len(items) > limit else [])


def lookup(d: Any, dotted: str) -> Any:
    """d['a']['b'] for 'a.b' (None when any step is missing)."""
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


class AuditContext:
    """One audit run's state: each link reads artifacts through it (once) and adds its findings to it."""

    def __init__(self, cfg: AuditConfig):
        self.cfg = cfg
        self.paths = cfg.run_paths()
        self.run_dir = self.paths.run_dir.resolve()
        self.findings: list[Finding] = []
        self.facts: dict[str, Any] = {}
        self.section = "data"
        self._json_cache: dict[Path, Any] = {}
        self._reported_missing: set[Path] = set()
        self._tokenizer_cache: dict[str, Any] = {}
        self._rescorer: Any = None  # the target model, loaded once for the greedy/labels re-scoring checks
        self._sha_cache: dict[Path, str] = {}

    # ------------------------------------------------------------------------------ finding helpers

    def rel(self, path: str | os.PathLike) -> str:
        p = Path(path)
        try:
            return p.resolve().relative_to(self.run_dir).as_posix()
        except (ValueError, OSError):
            return str(p)

    def cite(self, path: str | os.PathLike, fld: str = "") -> dict[str, str]:
        return {"file": self.rel(path), "field": fld}

    def add(self, check: str, status: str, message: str, cites: Iterable[dict[str, str]] = (),
            details: Iterable[str] = ()) -> Finding:
        assert status in STATUSES, status
        f = Finding(self.section, check, status, message, list(cites), listed(list(details), self.cfg.max_listed))
        self.findings.append(f)
        (log.warning if status == "fail" else log.info)("%s %s [%s] %s", status.upper(), self.section, check, message)
        return f

    def check_equal(self, check: str, actual: Any, expected: Any, what: str, cites: list[dict[str, str]],
                    fmt: Callable[[Any], str] = str) -> bool:
        ok = actual == expected and actual is not None
        if ok:
            self.add(check, "pass", f"{what}: {fmt(actual)}", cites)
        else:
            self.add(check, "fail", f"{what} differ: {fmt(actual)} != {fmt(expected)}", cites)
        return ok

    def check_same_target(self, check: str, record: Path, target: dict, what: str) -> bool:
        """That ``record``'s ``target`` (spec, weights sha256) is the traces' target: every stage must distil the
        one model the traces came from."""
        traces = (self.traces_summary or {}).get("target") or {}
        return self.check_equal(check, (target.get("spec"), target.get("weights_sha256")),
                                (traces.get("spec"), traces.get("weights_sha256")),
                                f"{what} and the traces' target (spec, weights sha256)",
                                [self.cite(record, "target.spec"), self.cite(record, "target.weights_sha256"),
                                 self.cite(self.paths.traces_summary, "target.spec"),
                                 self.cite(self.paths.traces_summary, "target.weights_sha256")],
                                lambda x: f"{x[0]} {short(x[1])}")

    def guard(self, check: str, fn: Callable[[], Any]) -> Any:
        """Run one check; an unexpected error becomes a failed finding instead of ending the audit."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the audit reports, it does not crash
            log.exception("audit check %s failed with an error", check)
            self.add(check, "fail", f"the check itself failed: {type(e).__name__}: {e}")
            return None

    def run_checks(self, record: dict, checks: Sequence[tuple[str, Callable[[AuditContext, dict], Any]]]) -> None:
        """A link's checks of one record, in order, each guarded: one that errs never hides the others."""
        for check, fn in checks:
            self.guard(check, lambda fn=fn: fn(self, record))

    def require(self, path: Path, what: str) -> bool:
        """True when the file (or dir) exists; else one failed 'missing' finding per path."""
        if path.exists():
            return True
        if path not in self._reported_missing:
            self._reported_missing.add(path)
            self.add("file present", "fail", f"missing: {self.rel(path)} ({what})", [self.cite(path)])
        return False

    def expect(self, items: Iterable[tuple[Path, str]]) -> None:
        """The files a section rests on: each missing one is a named failure (reported once)."""
        for path, what in items:
            self.require(path, what)

    # ------------------------------------------------------------------------------ artifact loading

    def sha(self, path: Path) -> str:
        key = path.resolve()
        if key not in self._sha_cache:
            self._sha_cache[key] = sha256_file(path)
        return self._sha_cache[key]

    def weights_sha(self, model_dir: str | os.PathLike) -> str | None:
        """``weights_sha256`` of a model dir with each file hashed once per audit (a target can be gigabytes)."""
        files = weight_files(model_dir)
        if not files:
            return None
        if len(files) == 1:
            return self.sha(files[0])
        return hashlib.sha256(b"".join(bytes.fromhex(self.sha(f)) for f in files)).hexdigest()

    def json(self, path: Path) -> dict | None:
        """A JSON object file, parsed once; None when missing (``expect`` reports that) or unreadable."""
        if path in self._json_cache:
            return self._json_cache[path]
        data = None
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except (OSError, ValueError) as e:
                self.add("file readable", "fail", f"{self.rel(path)} is not a valid JSON object: {e}",
                         [self.cite(path)])
                data = None
        self._json_cache[path] = data
        return data

    def jsonl(self, path: Path) -> list[dict] | None:
        """A JSONL file's rows (each with its ``_line``), parsed once; None when missing."""
        if path in self._json_cache:
            return self._json_cache[path]
        if not path.is_file():
            self._json_cache[path] = None
            return None
        rows: list[dict] = []
        bad: list[str] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    bad.append(f"line {lineno}: {e}")
                    continue
                obj["_line"] = lineno
                rows.append(obj)
        if bad:
            self.add("file readable", "fail", f"{self.rel(path)}: {len(bad)} lines are not JSON objects",
                     [self.cite(path)], bad)
        self._json_cache[path] = rows
        return rows

    @property
    def prompts(self) -> list[dict] | None:
        return self.jsonl(self.paths.prompts)

    @property
    def traces(self) -> list[dict] | None:
        return self.jsonl(self.paths.traces)

    @property
    def stats(self) -> dict | None:
        return self.json(self.paths.prompts_stats)

    @property
    def traces_summary(self) -> dict | None:
        return self.json(self.paths.traces_summary)

    @property
    def validation_summary(self) -> dict | None:
        return self.json(self.paths.validation_summary)

    @property
    def train_meta(self) -> dict | None:
        return self.json(self.paths.train_meta)

    def labels_file(self) -> Path | None:
        """The labels.jsonl the draft was trained on (train_meta.json `labels`): the run's own copy when it has
        one (a moved run dir), else the path training recorded; None when training used no labels."""
        rec = (self.train_meta or {}).get("labels")
        if not rec:
            return None
        path = self.paths.labels
        return path if path.is_file() else Path(rec.get("path") or "")

    def weight_path(self, arch: dict | None) -> Path:
        """The packed model dir's weight file, as architecture.json names it."""
        return self.paths.model_dir / str((arch or {}).get("weight_file") or WEIGHT_FILE)

    # ------------------------------------------------------------------------------ the target, loaded once

    def target_dir(self) -> Path | None:
        """The target model's local dir recorded by the traces stage, when it is still on this machine."""
        path = lookup(self.traces_summary or {}, "target.path")
        if path and Path(path, "config.json").is_file():
            return Path(path)
        return None

    def rescoring_model(self, weights_sha256: str | None) -> tuple[Any, str | None, str | None]:
        """(target model, None, None) when the traces' target is on this machine with these weights and small
        enough to run here (loaded once per audit), else (None, why not, the summary field it rests on)."""
        target = self.target_dir()
        if target is None:
            return None, "the target model is not on this machine", "target.path"
        if self.weights_sha(target) != weights_sha256:
            return None, f"{target} no longer holds the recorded weights", "target.weights_sha256"

        device = "cuda" if torch.cuda.is_available() else "cpu"
        gb = sum(f.stat().st_size for f in weight_files(target)) / 1e9
        if device == "cpu" and gb > self.cfg.greedy_check_max_gb:
            return (None, f"the target's weights are {gb:.1f} GB, more than --greedy-check-max-gb "
                          f"{self.cfg.greedy_check_max_gb} on CPU", "target.path")
        if self._rescorer is None:
            self._rescorer = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
        return self._rescorer, None, None

    def release_rescoring_model(self) -> None:
        self._rescorer = None

    def tokenizer(self) -> tuple[Any, Path, bool] | None:
        """(tokenizer, its dir, is the target's own) -- the target's when present, else the draft's (training
        checks the vocabularies are equal), for decoding completions."""
        candidates = [(self.target_dir(), True), (self.paths.checkpoint, False), (self.paths.model_dir, False)]
        for path, is_target in candidates:
            if path is None or not Path(path, "tokenizer_config.json").is_file():
                continue
            key = str(path)
            if key not in self._tokenizer_cache:
                self._tokenizer_cache[key] = load_tokenizer(path)
            return self._tokenizer_cache[key], Path(path), is_target
        return None
