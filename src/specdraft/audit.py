"""`specdraft audit RUN_DIR`: prove where every artifact of a run came from, or name the link that breaks.

The audit reads a run directory (layout below; each path can be overridden), re-derives what it can
(hashes, counts, token ids, tensor names and shapes, n-gram overlap, greedy argmax) and compares it with
what each stage recorded. Every finding cites the file and the field it rests on. It writes
``RUN_DIR/audit/audit.md`` and ``audit.json`` and exits 1 when any finding fails (warnings do not).

    RUN_DIR/prompts/     prompts.jsonl, prompts.stats.json, data_manifest.json     (specdraft prompts)
    RUN_DIR/traces/      traces.jsonl, traces.summary.json                         (specdraft traces)
    RUN_DIR/labels/      labels.jsonl, labels.summary.json (only if trained on)    (specdraft label)
    RUN_DIR/validation/  validation.jsonl, validation.summary.json                 (specdraft validation)
    RUN_DIR/draft/       HF checkpoint + train_meta.json                           (specdraft train)
    RUN_DIR/model/       config, generation config, tokenizer, draft.qd4,
                         architecture.json, pack_recipe.json                       (specdraft pack)

Sections: data (manifest pins, splits, sources, 13-gram contamination of prompts, completions *and* the
labelled reference answers trained on against the evaluation prompts), traces (declared target, greedy,
counts, hashes, ids), training (init model, tensor names/shapes, traces hash, teacher-forced labels
re-scored), pack (weight file bytes/sha256 against architecture.json and the recipe, recipe source against
the checkpoint), serve (model dir contents, strict load, and -- optional -- the server run in a sandbox that
blocks and records outgoing connections and records every file it opens; it may read only the model dir,
Python code and package metadata, and its own temp files).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import Field

from .config import StageConfig
from .provenance import atomic_write_json, atomic_write_text, run_metadata, sha256_file, stage_log

log = logging.getLogger("specdraft.audit")

STATUSES = ("pass", "fail", "warn", "skip")
SECTIONS = ("data", "traces", "training", "pack", "serve")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "do_sample", "sampling", "min_p", "typical_p")
# The files a packed model dir may hold (pack.py writes pack.log there too: its own log, never read).
MODEL_DIR_BASE_FILES = ("config.json", "generation_config.json", "architecture.json", "pack_recipe.json")
MODEL_DIR_LOGS = ("pack.log",)
LISTENING = re.compile(r"listening on (http://\S+)")
LOADED_QD4 = re.compile(r"loaded qd4 missing=(\d+) unexpected=(\d+)")
CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
               "max_position_embeddings")


class AuditConfig(StageConfig):
    """Check every link of a run: data -> traces -> training -> pack -> serve."""

    run_dir: str = Field(..., description="run directory (prompts/, traces/, validation/, draft/, model/)",
                         json_schema_extra={"positional": True})
    prompts: str | None = Field(None, description="prompts.jsonl (unset: RUN_DIR/prompts/prompts.jsonl); "
                                                  "prompts.stats.json and data_manifest.json are read beside it")
    traces: str | None = Field(None, description="traces.jsonl (unset: RUN_DIR/traces/traces.jsonl); "
                                                 "traces.summary.json is read beside it")
    validation: str | None = Field(None, description="validation.jsonl (unset: RUN_DIR/validation/"
                                                     "validation.jsonl); validation.summary.json beside it")
    checkpoint: str | None = Field(None, description="training output dir with train_meta.json "
                                                     "(unset: RUN_DIR/draft)")
    model_dir: str | None = Field(None, description="packed model dir (unset: RUN_DIR/model)")
    eval_set: list[str] = Field(default=[], description="evaluation prompt file (repeatable) for the contamination "
                                                        "check (none given: the eval sets recorded in "
                                                        "prompts.stats.json and validation.summary.json)")
    out: str | None = Field(None, description="where audit.md / audit.json go (unset: RUN_DIR/audit)")
    ngram: int | None = Field(None, ge=1, description="n of the word n-gram contamination check (unset: the "
                                                      "prompts stage's, else 13)")
    greedy_check: int = Field(4, ge=0, description="traces re-scored with the target (teacher-forced argmax must "
                                                   "equal every completion token); 0 turns it off")
    greedy_check_max_gb: float = Field(4.0, gt=0, description="skip the greedy re-score on CPU when the target's "
                                                              "weight files exceed this many GB (on a GPU it runs)")
    serve_check: bool = Field(True, description="start the server in a sandbox (no outgoing sockets, every file "
                                                "open recorded), send one /draft, stop it")
    serve_timeout_s: float = Field(120.0, gt=0, description="bound on the whole sandboxed server check")
    max_listed: int = Field(20, ge=1, description="offenders listed per finding")


# ------------------------------------------------------------------------------------------- findings

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


@dataclass
class AuditReport:
    run_dir: Path
    findings: list[Finding]
    out_dir: Path
    facts: dict[str, Any]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail"]

    @property
    def passed(self) -> bool:
        return not self.failed

    def counts(self, section: str | None = None) -> dict[str, int]:
        c = Counter(f.status for f in self.findings if section is None or f.section == section)
        return {s: c.get(s, 0) for s in STATUSES}

    def by_check(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]


@dataclass
class RunPaths:
    run_dir: Path
    prompts: Path
    traces: Path
    validation: Path
    checkpoint: Path
    model_dir: Path
    out: Path

    @property
    def prompts_stats(self) -> Path:
        return self.prompts.with_name(self.prompts.stem + ".stats.json")

    @property
    def manifest(self) -> Path:
        return self.prompts.parent / "data_manifest.json"

    @property
    def traces_summary(self) -> Path:
        return self.traces.with_name(self.traces.stem + ".summary.json")

    @property
    def validation_summary(self) -> Path:
        return self.validation.with_name(self.validation.stem + ".summary.json")

    @property
    def train_meta(self) -> Path:
        return self.checkpoint / "train_meta.json"

    @classmethod
    def from_config(cls, cfg: AuditConfig) -> "RunPaths":
        # Absolute paths: the sandboxed server runs in another working directory.
        run = Path(cfg.run_dir).resolve()

        def given(value, default: Path) -> Path:
            return Path(value).resolve() if value else default
        return cls(run_dir=run,
                   prompts=given(cfg.prompts, run / "prompts" / "prompts.jsonl"),
                   traces=given(cfg.traces, run / "traces" / "traces.jsonl"),
                   validation=given(cfg.validation, run / "validation" / "validation.jsonl"),
                   checkpoint=given(cfg.checkpoint, run / "draft"),
                   model_dir=given(cfg.model_dir, run / "model"),
                   out=given(cfg.out, run / "audit"))


def _spread(rows: list[dict], n: int) -> list[dict]:
    """Up to n rows spread evenly over the list (first and last included), each once."""
    picks = [rows[round(i * (len(rows) - 1) / max(1, n - 1))] for i in range(min(n, len(rows)))]
    return list({id(r): r for r in picks}.values())


def _argmax_mismatches(model, rows: list[dict], expected_key: str, file_label: str) -> tuple[int, int, list[str]]:
    """Teacher-forced argmax of ``model`` over prompt_ids + completion_ids against ``row[expected_key]``:
    (tokens that differ, tokens compared, one line per row with a difference)."""
    import torch

    device = next(model.parameters()).device
    mismatched, total, bad = 0, 0, []
    with torch.inference_mode():
        for t in rows:
            prompt, completion, expected = list(t["prompt_ids"]), list(t["completion_ids"]), list(t[expected_key])
            ids = torch.tensor([prompt + completion], device=device)
            preds = model(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            miss = sum(int(a != b) for a, b in zip(preds, expected))
            total += len(expected)
            mismatched += miss
            if miss:
                first = next(j for j, (a, b) in enumerate(zip(preds, expected)) if a != b)
                bad.append(f"{t.get('id')!r} ({file_label} line {t['_line']}): {miss} of {len(expected)} tokens "
                           f"differ from the target's argmax, first at completion position {first}")
    return mismatched, total, bad


def _short(sha: Any) -> str:
    return f"{sha[:12]}…" if isinstance(sha, str) and len(sha) > 12 else repr(sha)


def _bytes(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _listed(items: list[str], limit: int) -> list[str]:
    return items[:limit] + ([f"... and {len(items) - limit} more"] if len(items) > limit else [])


def _corpus_stats(stats: dict | None, name: str) -> dict:
    """prompts.stats.json's record of one corpus (corpus names may contain dots)."""
    rec = ((stats or {}).get("corpora") or {}).get(name)
    return rec if isinstance(rec, dict) else {}


def _get(d: Any, dotted: str) -> Any:
    """d['a']['b'] for 'a.b' (None when any step is missing)."""
    cur = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


# ------------------------------------------------------------------------------------------------ audit

class Audit:
    """One audit run: loads each artifact once, adds findings section by section."""

    def __init__(self, cfg: AuditConfig):
        self.cfg = cfg
        self.paths = RunPaths.from_config(cfg)
        self.run_dir = self.paths.run_dir.resolve()
        self.findings: list[Finding] = []
        self.facts: dict[str, Any] = {}
        self._json_cache: dict[Path, Any] = {}
        self._reported_missing: set[Path] = set()
        self._tokenizer_cache: dict[str, Any] = {}
        self._rescorer: Any = None  # the target model, loaded once for the greedy/labels re-scoring checks
        self._sha_cache: dict[Path, str] = {}
        self._manifest_names: set[str] | None = None
        self.section = "data"

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
        f = Finding(self.section, check, status, message, list(cites), _listed(list(details), self.cfg.max_listed))
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

    def guard(self, check: str, fn: Callable[[], Any]) -> Any:
        """Run one check; an unexpected error becomes a failed finding instead of ending the audit."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the audit reports, it does not crash
            log.exception("audit check %s failed with an error", check)
            self.add(check, "fail", f"the check itself failed: {type(e).__name__}: {e}")
            return None

    # ------------------------------------------------------------------------------ artifact loading

    def sha(self, path: Path) -> str:
        key = path.resolve()
        if key not in self._sha_cache:
            self._sha_cache[key] = sha256_file(path)
        return self._sha_cache[key]

    def weights_sha(self, model_dir: str | os.PathLike) -> str | None:
        """``models.weights_sha256`` with each file hashed once per audit (a target can be gigabytes)."""
        import hashlib

        from .models import weight_files
        files = weight_files(model_dir)
        if not files:
            return None
        if len(files) == 1:
            return self.sha(files[0])
        return hashlib.sha256(b"".join(bytes.fromhex(self.sha(f)) for f in files)).hexdigest()

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

    def target_dir(self) -> Path | None:
        """The target model's local dir recorded by the traces stage, when it is still on this machine."""
        path = _get(self.traces_summary or {}, "target.path")
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
        import torch
        from transformers import AutoModelForCausalLM

        from .models import weight_files
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gb = sum(f.stat().st_size for f in weight_files(target)) / 1e9
        if device == "cpu" and gb > self.cfg.greedy_check_max_gb:
            return (None, f"the target's weights are {gb:.1f} GB, more than --greedy-check-max-gb "
                          f"{self.cfg.greedy_check_max_gb} on CPU", "target.path")
        if self._rescorer is None:
            self._rescorer = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(device).eval()
        return self._rescorer, None, None

    def tokenizer(self) -> tuple[Any, Path, bool] | None:
        """(tokenizer, its dir, is the target's own) -- the target's when present, else the draft's (training
        checks the vocabularies are equal), for decoding completions."""
        from .models import load_tokenizer
        candidates = [(self.target_dir(), True), (self.paths.checkpoint, False), (self.paths.model_dir, False)]
        for path, is_target in candidates:
            if path is None or not Path(path, "tokenizer_config.json").is_file():
                continue
            key = str(path)
            if key not in self._tokenizer_cache:
                self._tokenizer_cache[key] = load_tokenizer(path)
            return self._tokenizer_cache[key], Path(path), is_target
        return None

    # =========================================================================================== data

    def audit_data(self) -> None:
        self.section = "data"
        p = self.paths
        self.expect([(p.prompts, "training prompts, written by specdraft prompts"),
                     (p.prompts_stats, "written by specdraft prompts"),
                     (p.manifest, "copy of the data manifest, written by specdraft prompts")])
        manifest = self.guard("manifest", self._data_manifest)
        self.guard("prompts", lambda: self._data_prompts(manifest))
        eval_sets = self.guard("eval sets", self._data_eval_sets) or []
        if manifest is not None:
            self.guard("no eval split", lambda: self._data_no_eval_split(manifest, eval_sets))
        self.guard("contamination", lambda: self._data_contamination(eval_sets))

    def _data_manifest(self):
        from .data import ManifestError, load_manifest
        from .data.manifest import COMMIT_RE as MCOMMIT, default_manifest_dict

        p, stats = self.paths.manifest, self.stats
        if not p.is_file():
            return None
        try:
            loaded = load_manifest(p, check_files=False)
        except ManifestError as e:
            self.add("manifest valid", "fail", str(e), [self.cite(p)])
            try:  # the sources check can still use the declared names
                corpora = json.loads(p.read_text(encoding="utf-8")).get("corpora") or []
                self._manifest_names = {str(c.get("name")) for c in corpora if isinstance(c, dict)}
            except (OSError, ValueError, AttributeError):
                pass
            return None
        m = loaded.manifest
        self.add("manifest valid", "pass",
                 f"schema v{m.schema_version}, {len(m.corpora)} corpora ({', '.join(c.name for c in m.corpora)})",
                 [self.cite(p, "corpora")])
        if stats is not None:
            self.check_equal("manifest sha256", loaded.sha256, _get(stats, "provenance.manifest.sha256"),
                             "the manifest copy and the one prompts.jsonl was built from (sha256)",
                             [self.cite(p), self.cite(self.paths.prompts_stats, "provenance.manifest.sha256")],
                             _short)
            prov = _get(stats, "provenance.manifest") or {}
            original = prov.get("resolved_path")
            if prov.get("builtin_default"):
                same = (json.dumps(default_manifest_dict(), indent=2) + "\n").encode() == loaded.raw
                self.add("manifest source", "pass" if same else "warn",
                         "built-in default manifest" + ("" if same else " (the copy differs from today's built-in "
                                                                         "default: the code changed since)"),
                         [self.cite(self.paths.prompts_stats, "provenance.manifest.builtin_default")])
            elif original and Path(original).is_file():
                same = Path(original).read_bytes() == loaded.raw
                self.add("manifest source", "pass" if same else "warn",
                         f"{original} " + ("is unchanged" if same else "has changed since the run (the copy is what "
                                                                        "was used)"),
                         [self.cite(self.paths.prompts_stats, "provenance.manifest.resolved_path")])
            else:
                self.add("manifest source", "warn", f"the original manifest {original!r} is not on this machine; "
                                                    "the copy is audited",
                         [self.cite(self.paths.prompts_stats, "provenance.manifest.resolved_path")])
        for flag in ("uses_eval_splits", "eval_examples_used_as_targets"):
            value = getattr(m, flag)
            self.add("manifest declarations", "pass" if value is False else "fail", f"{flag} = {value}",
                     [self.cite(p, flag)])
        for i, c in enumerate(m.corpora):
            self._data_corpus_pin(p, i, c, loaded, MCOMMIT)
        return loaded

    def _corpus_file(self, name: str, declared: str | None, loaded) -> Path | None:
        """Where the corpus file was read from: prompts.stats.json's record first, then the manifest's path
        relative to the original manifest, then relative to the copy."""
        stats = self.stats or {}
        for rec in _get(stats, "provenance.files") or []:
            if rec.get("corpus") == name and rec.get("resolved_path"):
                return Path(rec["resolved_path"])
        resolved = _corpus_stats(stats, name).get("resolved_path")
        if resolved:
            return Path(resolved)
        if declared:
            original = _get(stats, "provenance.manifest.resolved_path")
            base = Path(original).parent if original else self.paths.manifest.parent
            return (base / declared).resolve()
        return loaded.resolved.get(name)

    def _data_corpus_pin(self, mpath: Path, i: int, c, loaded, commit_re) -> None:
        where = f"corpora[{i}]"
        if c.kind == "hf_dataset":
            ok = bool(commit_re.fullmatch(c.revision or ""))
            self.add("corpus pinned", "pass" if ok else "fail",
                     f"{c.name}: hub dataset {c.repo_id} pinned to revision {c.revision}" if ok else
                     f"{c.name}: hub dataset {c.repo_id} revision {c.revision!r} is not a 40-hex commit",
                     [self.cite(mpath, f"{where}.revision")])
            return
        path = self._corpus_file(c.name, c.path, loaded)
        if c.kind == "templates" and path is None:
            from .data import templates_asset
            path = templates_asset()
        recorded = c.sha256
        recorded_field = f"{where}.sha256"
        cite_file = mpath
        if recorded is None:  # templates: the manifest pins no hash; the stats recorded it
            recorded = _corpus_stats(self.stats, c.name).get("sha256")
            recorded_field, cite_file = f"corpora.{c.name}.sha256", self.paths.prompts_stats
        cites = [self.cite(cite_file, recorded_field)]
        if recorded is None:
            self.add("corpus pinned", "fail", f"{c.name}: no sha256 declared or recorded for {c.kind} corpus", cites)
            return
        if path is None or not path.is_file():
            self.add("corpus pinned", "fail", f"{c.name}: file {path} is not on this machine; cannot check its "
                                              f"sha256 {_short(recorded)}", cites)
            return
        actual = self.sha(path)
        if actual == recorded:
            self.add("corpus pinned", "pass", f"{c.name}: {path.name} sha256 {_short(actual)} still matches", cites)
        else:
            self.add("corpus pinned", "fail", f"{c.name}: {path} has sha256 {_short(actual)}, declared "
                                              f"{_short(recorded)} (the file changed)", cites)

    def _data_no_eval_split(self, loaded, eval_sets: list[dict]) -> None:
        from .data import is_eval_split

        eval_shas = {e["sha256"]: e["path"] for e in eval_sets if e.get("sha256")}
        for i, c in enumerate(loaded.corpora):
            cites = [self.cite(self.paths.manifest, f"corpora[{i}].split")]
            if c.split is not None and is_eval_split(c.split):
                self.add("no eval split", "fail", f"{c.name}: split {c.split!r} is an evaluation split", cites)
                continue
            path = self._corpus_file(c.name, c.path, loaded) if c.kind != "hf_dataset" else None
            if path is not None and path.is_file() and self.sha(path) in eval_shas:
                self.add("no eval split", "fail", f"{c.name}: {path} is byte-identical to the evaluation set "
                                                  f"{eval_shas[self.sha(path)]}",
                         [self.cite(self.paths.manifest, f"corpora[{i}].path")])
                continue
            if path is not None and c.kind == "local_file" and is_eval_split(path.stem):
                self.add("no eval split", "warn", f"{c.name}: the file name {path.name} looks like an evaluation "
                                                  "split", [self.cite(self.paths.manifest, f"corpora[{i}].path")])
                continue
            what = f"split {c.split!r}" if c.split else ("a local file" if c.kind == "local_file" else c.kind)
            self.add("no eval split", "pass", f"{c.name}: {what}, not an evaluation split", cites)

    def _data_prompts(self, loaded) -> None:
        p, stats, rows = self.paths.prompts, self.stats, self.prompts
        if rows is None:
            return
        self.facts["prompts"] = len(rows)
        if stats is not None:
            self.check_equal("prompts sha256", self.sha(p), stats.get("prompts_sha256"),
                             "prompts.jsonl and prompts.stats.json (sha256)",
                             [self.cite(p), self.cite(self.paths.prompts_stats, "prompts_sha256")], _short)
            self.check_equal("prompts count", len(rows), stats.get("total"), "prompts in prompts.jsonl and recorded",
                             [self.cite(p), self.cite(self.paths.prompts_stats, "total")])
        bad_rows = [f"line {r['_line']}" for r in rows if not all(isinstance(r.get(k), str) for k in ("id", "prompt"))]
        ids = Counter(str(r.get("id")) for r in rows)
        dupes = sorted(i for i, n in ids.items() if n > 1)
        if bad_rows or dupes:
            self.add("prompts format", "fail", f"{len(bad_rows)} rows without string id/prompt, {len(dupes)} "
                                               "repeated ids", [self.cite(p, "id")],
                     bad_rows + [f"repeated id {d!r}" for d in dupes])
        else:
            self.add("prompts format", "pass", f"{len(rows)} rows with unique ids", [self.cite(p, "id")])
        declared = {c.name for c in loaded.corpora} if loaded is not None else self._manifest_names
        if declared is None:
            self.add("prompt sources declared", "fail", "no readable manifest to compare the sources with",
                     [self.cite(p, "source"), self.cite(self.paths.manifest, "corpora[].name")])
            return
        undeclared = [f"line {r['_line']} id {r.get('id')!r}: source {r.get('source')!r}" for r in rows
                      if r.get("source") not in declared]
        if undeclared:
            self.add("prompt sources declared", "fail",
                     f"{len(undeclared)} prompts have a source that is not a corpus of data_manifest.json",
                     [self.cite(p, "source"), self.cite(self.paths.manifest, "corpora[].name")], undeclared)
        else:
            per = Counter(r["source"] for r in rows)
            self.add("prompt sources declared", "pass",
                     "every source is a declared corpus: " + ", ".join(f"{k} {v}" for k, v in per.items()),
                     [self.cite(p, "source"), self.cite(self.paths.manifest, "corpora[].name")])
            if stats is not None:
                kept = {name: _corpus_stats(stats, name).get("kept") for name in declared}
                wrong = [f"{n}: {per.get(n, 0)} in prompts.jsonl, {kept[n]} recorded" for n in sorted(declared)
                         if kept[n] is not None and kept[n] != per.get(n, 0)]
                self.add("prompt counts per corpus", "fail" if wrong else "pass",
                         "per-corpus counts differ from prompts.stats.json" if wrong else
                         "per-corpus counts equal prompts.stats.json",
                         [self.cite(self.paths.prompts_stats, "corpora.*.kept")], wrong)

    def _data_eval_sets(self) -> list[dict]:
        """The evaluation prompt files: --eval-set, else the prompts stage's plus the validation stage's."""
        sets: list[dict] = []
        if self.cfg.eval_set:
            for path in self.cfg.eval_set:
                sets.append({"path": path, "sha256": None, "cite": self.cite(path), "origin": "--eval-set"})
        else:
            for i, rec in enumerate(_get(self.stats or {}, "contamination.eval_sets") or []):
                path = rec.get("resolved_path") or rec.get("path")
                sets.append({"path": path, "sha256": rec.get("sha256"), "origin": "prompts",
                             "cite": self.cite(self.paths.prompts_stats, f"contamination.eval_sets[{i}]")})
            if self.paths.validation_summary.is_file() and self.validation_summary is not None:
                ev = self.validation_summary.get("eval") or {}
                if ev.get("path"):
                    sets.append({"path": ev["path"], "sha256": ev.get("sha256"), "origin": "validation",
                                 "cite": self.cite(self.paths.validation_summary, "eval")})
        found: list[dict] = []
        seen: set[str] = set()
        for s in sets:
            path = Path(s["path"])
            if not path.is_absolute() and not path.is_file() and (self.run_dir / path).is_file():
                path = self.run_dir / path
            if not path.is_file():
                self.add("eval set present", "fail", f"evaluation set {s['path']} ({s['origin']}) is not on this "
                                                     "machine: cannot check contamination against it", [s["cite"]])
                continue
            actual = self.sha(path)
            if s["sha256"] and actual != s["sha256"]:
                self.add("eval set present", "fail", f"evaluation set {path} has sha256 {_short(actual)}, recorded "
                                                     f"{_short(s['sha256'])}", [s["cite"]])
            else:
                self.add("eval set present", "pass", f"{path} ({s['origin']}, sha256 {_short(actual)})", [s["cite"]])
            if actual not in seen:
                seen.add(actual)
                found.append({"path": str(path), "sha256": actual, "origin": s["origin"], "cite": s["cite"]})
        if not sets:
            self.add("eval set present", "fail", "no evaluation prompt file recorded in prompts.stats.json or "
                                                 "validation.summary.json: pass --eval-set",
                     [self.cite(self.paths.prompts_stats, "contamination.eval_sets")])
        origins = {s["origin"]: s["sha256"] for s in found}
        if "validation" in origins and not self.cfg.eval_set:
            filtered = {s["sha256"] for s in found if s["origin"] == "prompts"}
            ok = origins["validation"] in filtered
            self.add("eval set filtered", "pass" if ok else "warn",
                     "the prompts stage filtered against the validation prompts" if ok else
                     "the prompts stage did not filter against the validation prompts (the overlap check below "
                     "covers them)", [self.cite(self.paths.prompts_stats, "contamination.eval_sets"),
                                      self.cite(self.paths.validation_summary, "eval.sha256")])
        self.facts["eval_sets"] = [{k: v for k, v in s.items() if k != "cite"} for s in found]
        return found

    def _data_contamination(self, eval_sets: list[dict]) -> None:
        from .data import ngram_overlap, read_eval_prompts

        n = self.cfg.ngram or _get(self.stats or {}, "contamination.ngram") or 13
        eval_texts: list[str] = []
        for s in eval_sets:
            eval_texts.extend(read_eval_prompts(s["path"]))
        cites = [s["cite"] for s in eval_sets]
        if not eval_texts:
            self.add("contamination", "fail", f"no evaluation prompts to check the {n}-gram overlap against",
                     [self.cite(self.paths.prompts_stats, "contamination.eval_sets")])
            return
        texts: list[str] = []
        labels: list[str] = []
        for r in self.prompts or []:
            texts.append(str(r.get("prompt", "")))
            labels.append(f"prompt {r.get('id')!r} (prompts.jsonl line {r['_line']})")
        completions = 0
        tok = self.tokenizer() if self.traces else None
        if self.traces and tok is not None:
            rows = [t for t in self.traces if isinstance(t.get("completion_ids"), list)]
            decoded = tok[0].batch_decode([t["completion_ids"] for t in rows], skip_special_tokens=True)
            texts.extend(decoded)
            labels.extend(f"completion of {t.get('id')!r} (traces.jsonl line {t['_line']})" for t in rows)
            completions = len(rows)
        answers, answer_cite = self._labelled_answers(tok)
        texts.extend(text for text, _ in answers)
        labels.extend(label for _, label in answers)
        offending = ngram_overlap(texts, eval_texts, n)
        what = f"{len(self.prompts or [])} prompts + {completions} completions" + (
            f" + {len(answers)} labelled answers" if answer_cite else "")
        cites = [self.cite(self.paths.prompts, "prompt"), self.cite(self.paths.traces, "completion_ids"),
                 *([answer_cite] if answer_cite else []), *cites]
        if offending:
            self.add("contamination", "fail", f"{len(offending)} of {what} share a {n}-gram with the "
                                              f"{len(eval_texts)} evaluation prompts", cites,
                     [f"{labels[i]}: {gram!r}" for i, gram in offending])
        else:
            self.add("contamination", "pass", f"{n}-gram overlap is zero: {what} vs {len(eval_texts)} evaluation "
                                              "prompts", cites)
        if self.traces and tok is None:
            self.add("contamination", "fail", "completions not checked: no tokenizer found (target dir, checkpoint "
                                              "or model dir) to decode them",
                     [self.cite(self.paths.traces, "completion_ids")])
        elif tok is not None:
            self.facts["decode_tokenizer"] = {"path": str(tok[1]), "target": tok[2]}

    def labels_file(self) -> Path | None:
        """The labels.jsonl the draft was trained on (train_meta.json `labels`): the run's own copy when it has
        one (a moved run dir), else the path training recorded; None when training used no labels."""
        rec = (self.train_meta or {}).get("labels")
        if not rec:
            return None
        path = self.paths.run_dir / "labels" / "labels.jsonl"
        return path if path.is_file() else Path(rec.get("path") or "")

    def _labelled_answers(self, tok) -> tuple[list[tuple[str, str]], dict[str, str] | None]:
        """(text, label) of each reference answer the draft was trained on via `specdraft label`, and the
        cite: labels.jsonl's completion_ids decoded, or -- no tokenizer -- prompts.jsonl's `response` of the
        labelled ids. ([], None) when training used no labels."""
        path = self.labels_file()
        if path is None:
            return [], None
        if not path.is_file():
            self.add("contamination", "fail", f"labelled answers not checked: {path} is gone",
                     [self.cite(self.paths.train_meta, "labels.path")])
            return [], None
        rows = [r for r in self.jsonl(path) or [] if isinstance(r.get("completion_ids"), list)]
        if tok is not None:
            decoded = tok[0].batch_decode([r["completion_ids"] for r in rows], skip_special_tokens=True)
            return ([(text, f"response of {r.get('id')!r} ({path.name} line {r['_line']})")
                     for text, r in zip(decoded, rows)], self.cite(path, "completion_ids"))
        ids = {str(r.get("id")) for r in rows}
        return ([(str(r["response"]), f"response of {r.get('id')!r} (prompts.jsonl line {r['_line']})")
                 for r in self.prompts or [] if str(r.get("id")) in ids and isinstance(r.get("response"), str)],
                self.cite(self.paths.prompts, "response"))

    # ========================================================================================= traces

    def audit_traces(self) -> None:
        self.section = "traces"
        p = self.paths
        self.expect([(p.traces, "the target's traces, written by specdraft traces"),
                     (p.traces_summary, "written by specdraft traces"),
                     (p.validation, "evaluation points, written by specdraft validation"),
                     (p.validation_summary, "written by specdraft validation")])
        summary = self.traces_summary
        if summary is None:  # what needs no summary still runs
            self.guard("trace ids", self._traces_ids)
            self.guard("validation", lambda: self._traces_validation({}))
            return
        self.guard("traces summary", lambda: self._traces_summary(summary))
        self.guard("target declared", lambda: self._traces_target(summary))
        self.guard("greedy", lambda: self._traces_greedy(summary))
        self.guard("traces counts", lambda: self._traces_counts(summary))
        self.guard("trace ids", self._traces_ids)
        self.guard("prompt ids", lambda: self._traces_prompt_ids(summary))
        self.guard("finish reasons", lambda: self._traces_finish(summary))
        self.guard("validation", lambda: self._traces_validation(summary))

    def _traces_summary(self, s: dict) -> None:
        sp = self.paths.traces_summary
        ok = s.get("stage") == "traces" and s.get("status") == "complete"
        self.add("traces complete", "pass" if ok else "fail",
                 f"stage {s.get('stage')!r}, status {s.get('status')!r}",
                 [self.cite(sp, "stage"), self.cite(sp, "status")])

    def _describe_check(self, src: dict | None, file: Path, key: str, check: str, role: str) -> None:
        """A model source record (describe_source): names the spec and pins it; re-hash it when it is here."""
        if not isinstance(src, dict) or not src.get("spec"):
            self.add(check, "fail", f"{role}: no model spec recorded", [self.cite(file, key)])
            return
        spec = str(src["spec"])
        cites = [self.cite(file, f"{key}.spec")]
        problems = []
        if not SHA256_RE.fullmatch(str(src.get("weights_sha256") or "")):
            problems.append("no weights_sha256")
        if spec.startswith("hub:"):
            rev = src.get("revision")
            cites.append(self.cite(file, f"{key}.revision"))
            spec_rev = spec.partition("@")[2]
            if not rev:
                problems.append("no revision")
            elif rev != spec_rev:
                problems.append(f"revision {rev!r} is not the spec's {spec_rev!r}")
            elif not COMMIT_RE.fullmatch(rev):
                self.add(check, "warn", f"{role} {spec}: revision {rev!r} is a tag, not a 40-hex commit", cites)
            pin = f"revision {rev}"
        elif spec.startswith("embedded:"):
            cites.append(self.cite(file, f"{key}.gguf_sha256"))
            if not SHA256_RE.fullmatch(str(src.get("gguf_sha256") or "")):
                problems.append("no gguf_sha256")
            pin = f"gguf sha256 {_short(src.get('gguf_sha256'))}"
        else:
            pin = "local weights"
        cites.append(self.cite(file, f"{key}.weights_sha256"))
        if problems:
            self.add(check, "fail", f"{role} {spec}: " + "; ".join(problems), cites)
            return
        self.add(check, "pass", f"{role} {spec} ({pin}, weights sha256 {_short(src['weights_sha256'])})", cites)
        path = src.get("path")
        if path and Path(path).is_dir():
            actual = self.weights_sha(path)
            if actual == src["weights_sha256"]:
                self.add(check + " still on disk", "pass", f"{role}: {path} still has weights sha256 "
                                                           f"{_short(actual)}", [self.cite(file, f"{key}.path")])
            else:
                self.add(check + " still on disk", "fail", f"{role}: {path} now has weights sha256 {_short(actual)}, "
                                                           f"recorded {_short(src['weights_sha256'])}",
                         [self.cite(file, f"{key}.weights_sha256")])
        else:
            self.add(check + " still on disk", "skip",
                     f"{role}: {path!r} is not on this machine; the recorded hashes are audited as they are",
                     [self.cite(file, f"{key}.path")])
        if spec.startswith("embedded:"):
            from .models import ModelSpecError, embedded_gguf_path
            try:
                gguf = embedded_gguf_path(spec.removeprefix("embedded:"))
            except ModelSpecError as e:
                self.add(check + " gguf", "skip", f"{role}: {e}", [self.cite(file, f"{key}.gguf_sha256")])
            else:
                actual = self.sha(gguf)
                self.add(check + " gguf", "pass" if actual == src.get("gguf_sha256") else "fail",
                         f"{role}: installed {gguf.name} sha256 {_short(actual)}, recorded "
                         f"{_short(src.get('gguf_sha256'))}", [self.cite(file, f"{key}.gguf_sha256")])

    def _traces_target(self, s: dict) -> None:
        self._describe_check(s.get("target"), self.paths.traces_summary, "target", "target declared", "target")
        tok = self.tokenizer()
        recorded = _get(s, "resume_key.tokenizer")
        if tok is not None and tok[2] and recorded:
            from .models import tokenizer_fingerprint
            self.check_equal("target tokenizer", tokenizer_fingerprint(tok[0]), recorded,
                             "vocabulary sha256 of the target's tokenizer and the one the traces recorded",
                             [self.cite(self.paths.traces_summary, "resume_key.tokenizer")], _short)

    def _traces_greedy(self, s: dict) -> None:
        sp = self.paths.traces_summary
        config = s.get("config") or {}
        sampling = sorted(k for k in config if any(w in k.lower() for w in SAMPLING_KEYS))
        backend = s.get("backend") or config.get("backend")
        ok = not sampling and backend in ("hf", "vllm")
        self.add("greedy", "pass" if ok else "fail",
                 f"backend {backend!r} decodes greedily only; no sampling settings in the config" if ok else
                 f"backend {backend!r}, sampling settings {sampling}: not the greedy traces stage",
                 [self.cite(sp, "backend"), self.cite(sp, "config")])
        n = self.cfg.greedy_check
        rows = [t for t in self.traces or [] if t.get("completion_ids") and t.get("prompt_ids")]
        if n == 0:
            self.add("greedy re-scored", "skip", "--greedy-check 0", [self.cite(self.paths.traces, "completion_ids")])
            return
        if not rows:
            self.add("greedy re-scored", "skip", "no traces", [self.cite(sp, "target.path")])
            return
        model, why, field = self.rescoring_model(_get(s, "target.weights_sha256"))
        if model is None:
            self.add("greedy re-scored", "skip", why, [self.cite(sp, field)])
            return
        picks = _spread(rows, n)
        mismatched, total, bad = _argmax_mismatches(model, picks, "completion_ids", "traces.jsonl")
        cites = [self.cite(self.paths.traces, "completion_ids"), self.cite(sp, "target.path")]
        if not mismatched:
            self.add("greedy re-scored", "pass", f"{len(picks)} traces re-scored with the target: all {total} "
                                                 "completion tokens are its argmax", cites)
        elif mismatched <= max(1, total // 100):
            self.add("greedy re-scored", "warn", f"{mismatched} of {total} completion tokens differ from the "
                                                 "target's teacher-forced argmax (float near-ties?)", cites, bad)
        else:
            self.add("greedy re-scored", "fail", f"{mismatched} of {total} completion tokens are not the target's "
                                                 "greedy choice", cites, bad)

    def _traces_counts(self, s: dict) -> None:
        sp, tp = self.paths.traces_summary, self.paths.traces
        if self.traces is None:
            return
        self.check_equal("traces sha256", self.sha(tp), s.get("traces_sha256"),
                         "traces.jsonl and traces.summary.json (sha256)",
                         [self.cite(tp), self.cite(sp, "traces_sha256")], _short)
        rows = self.traces
        recount = {"rows": len(rows),
                   "prompt_tokens": sum(len(t.get("prompt_ids") or []) for t in rows),
                   "completion_tokens": sum(len(t.get("completion_ids") or []) for t in rows)}
        reasons = Counter(t.get("finish_reason") for t in rows)
        wrong = [f"{k}: {v} in traces.jsonl, {s.get(k)} recorded" for k, v in recount.items() if s.get(k) != v]
        recorded_reasons = s.get("finish_reasons") or {}
        wrong += [f"finish_reasons.{r}: {reasons.get(r, 0)} in traces.jsonl, {recorded_reasons.get(r)} recorded"
                  for r in set(reasons) | set(recorded_reasons) if reasons.get(r, 0) != recorded_reasons.get(r, 0)]
        self.add("traces counts", "fail" if wrong else "pass",
                 "counts differ from traces.summary.json" if wrong else
                 f"{len(rows)} rows, {recount['prompt_tokens']} prompt + {recount['completion_tokens']} completion "
                 "tokens, finish reasons " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=str)),
                 [self.cite(sp, "rows"), self.cite(sp, "prompt_tokens"), self.cite(sp, "completion_tokens"),
                  self.cite(sp, "finish_reasons")], wrong)
        self.facts["traces"] = recount
        if self.paths.prompts.is_file():
            self.check_equal("traces prompts sha256", self.sha(self.paths.prompts), _get(s, "prompts.sha256"),
                             "prompts.jsonl and the prompts the traces were decoded from (sha256)",
                             [self.cite(self.paths.prompts), self.cite(sp, "prompts.sha256")], _short)

    def _traces_ids(self) -> None:
        tp = self.paths.traces
        if self.traces is None or self.prompts is None:
            self.add("trace ids in prompts", "skip", "traces.jsonl or prompts.jsonl missing", [self.cite(tp, "id")])
            return
        prompts = {str(r.get("id")): r for r in self.prompts}
        ids = Counter(str(t.get("id")) for t in self.traces)
        missing = [f"line {t['_line']}: id {t.get('id')!r}" for t in self.traces if str(t.get("id")) not in prompts]
        dupes = [f"id {i!r} appears {n} times" for i, n in ids.items() if n > 1]
        wrong_source = [f"line {t['_line']}: id {t.get('id')!r} source {t.get('source')!r}, prompts.jsonl says "
                        f"{prompts[str(t.get('id'))].get('source')!r}" for t in self.traces
                        if str(t.get("id")) in prompts and t.get("source") != prompts[str(t.get("id"))].get("source")]
        cites = [self.cite(tp, "id"), self.cite(self.paths.prompts, "id")]
        if missing or dupes:
            self.add("trace ids in prompts", "fail", f"{len(missing)} trace ids are not in prompts.jsonl, "
                                                     f"{len(dupes)} repeated", cites, missing + dupes)
        else:
            self.add("trace ids in prompts", "pass", f"all {len(self.traces)} trace ids are in prompts.jsonl "
                                                     f"({len(prompts) - len(ids)} prompts without a trace)", cites)
        if wrong_source:
            self.add("trace sources", "fail", f"{len(wrong_source)} traces name a different source than their prompt",
                     [self.cite(tp, "source"), self.cite(self.paths.prompts, "source")], wrong_source)

    def _traces_prompt_ids(self, s: dict) -> None:
        tp = self.paths.traces
        tok = self.tokenizer()
        if self.traces is None or self.prompts is None or tok is None or not tok[2]:
            self.add("prompt ids", "skip", "needs traces.jsonl, prompts.jsonl and the target's tokenizer",
                     [self.cite(tp, "prompt_ids")])
            return
        from .traces import encode_prompts
        prompts = {str(r.get("id")): r.get("prompt") for r in self.prompts}
        rows = [t for t in self.traces if str(t.get("id")) in prompts]
        encoded = encode_prompts(tok[0], [prompts[str(t.get("id"))] for t in rows])
        bad = [f"line {t['_line']}: id {t.get('id')!r}" for t, ids in zip(rows, encoded)
               if list(t.get("prompt_ids") or []) != list(ids)]
        cites = [self.cite(tp, "prompt_ids"), self.cite(self.paths.prompts, "prompt"),
                 self.cite(self.paths.traces_summary, "chat_template")]
        if bad:
            self.add("prompt ids", "fail", f"{len(bad)} traces' prompt_ids are not their prompt in the target's "
                                           "chat template", cites, bad)
        else:
            self.add("prompt ids", "pass", f"all {len(rows)} traces' prompt_ids are their prompt.jsonl text in the "
                                           "target's chat template", cites)

    def _eos_ids(self) -> set[int]:
        for d in (self.target_dir(), self.paths.checkpoint, self.paths.model_dir):
            for name in ("generation_config.json", "config.json"):
                f = Path(d, name) if d else None
                if f is not None and f.is_file():
                    eos = json.loads(f.read_text()).get("eos_token_id")
                    if eos is not None:
                        return set(eos) if isinstance(eos, list) else {int(eos)}
        return set()

    def _traces_finish(self, s: dict) -> None:
        if self.traces is None:
            return
        max_new = _get(s, "config.max_new_tokens")
        eos = self._eos_ids()
        bad = []
        for t in self.traces:
            comp, reason = t.get("completion_ids") or [], t.get("finish_reason")
            where = f"line {t['_line']}: id {t.get('id')!r}"
            if reason == "length" and max_new is not None and len(comp) != max_new:
                bad.append(f"{where}: finish_reason length with {len(comp)} tokens (max_new_tokens {max_new})")
            elif reason == "eos" and eos and (not comp or comp[-1] not in eos):
                bad.append(f"{where}: finish_reason eos but the last token is not an EOS id {sorted(eos)}")
            elif reason not in ("eos", "length"):
                bad.append(f"{where}: finish_reason {reason!r}")
            elif max_new is not None and len(comp) > max_new:
                bad.append(f"{where}: {len(comp)} tokens > max_new_tokens {max_new}")
        cites = [self.cite(self.paths.traces, "finish_reason"), self.cite(self.paths.traces_summary,
                                                                          "config.max_new_tokens")]
        self.add("finish reasons", "fail" if bad else "pass",
                 f"{len(bad)} traces end inconsistently with their finish_reason" if bad else
                 f"every trace ends at an EOS {sorted(eos)} or at max_new_tokens={max_new}", cites, bad)

    def _traces_validation(self, s: dict) -> None:
        vp, vs_path = self.paths.validation, self.paths.validation_summary
        vs = self.validation_summary
        if vs is None:
            return
        ok = vs.get("stage") == "validation" and vs.get("status") == "complete"
        self.add("validation complete", "pass" if ok else "fail",
                 f"stage {vs.get('stage')!r}, status {vs.get('status')!r}", [self.cite(vs_path, "status")])
        if vp.is_file():
            self.check_equal("validation sha256", self.sha(vp), vs.get("validation_sha256"),
                             "validation.jsonl and validation.summary.json (sha256)",
                             [self.cite(vp), self.cite(vs_path, "validation_sha256")], _short)
            with open(vp, encoding="utf-8") as f:
                points = sum(1 for line in f if line.strip())
            self.check_equal("validation points", points, vs.get("points"), "evaluation points",
                             [self.cite(vp), self.cite(vs_path, "points")])
        t, v = s.get("target") or {}, vs.get("target") or {}
        self.check_equal("validation target", (v.get("spec"), v.get("weights_sha256")),
                         (t.get("spec"), t.get("weights_sha256")),
                         "the validation stage's target and the traces' target (spec, weights sha256)",
                         [self.cite(vs_path, "target.spec"), self.cite(vs_path, "target.weights_sha256"),
                          self.cite(self.paths.traces_summary, "target.spec"),
                          self.cite(self.paths.traces_summary, "target.weights_sha256")],
                         lambda x: f"{x[0]} {_short(x[1])}")

    # ======================================================================================= training

    def audit_training(self) -> None:
        self.section = "training"
        self.expect([(self.paths.checkpoint, "training checkpoint dir, written by specdraft train"),
                     (self.paths.train_meta, "written by specdraft train")])
        meta = self.train_meta
        if meta is None:
            return
        self.guard("init model", lambda: self._train_init(meta))
        self.guard("train target", lambda: self._train_target(meta))
        self.guard("train traces", lambda: self._train_traces(meta))
        self.guard("train labels", lambda: self._train_labels(meta))
        self.guard("checkpoint weights", lambda: self._train_weights(meta))
        self.guard("tensor shapes", self._train_shapes)
        self.guard("config vs init", lambda: self._train_config_vs_init(meta))

    def _train_init(self, meta: dict) -> None:
        mp = self.paths.train_meta
        init = meta.get("init")
        self._describe_check(init, mp, "init", "init model", "init")
        if isinstance(init, dict) and init.get("init"):
            layers = init.get("truncate_layers")
            self.add("init spec", "pass", f"init {init['init']!r}"
                     + (f", decoder layers {layers}" if layers is not None else ""),
                     [self.cite(mp, "init.init"), self.cite(mp, "init.truncate_layers")])

    def _train_target(self, meta: dict) -> None:
        mp = self.paths.train_meta
        t = meta.get("target") or {}
        s = _get(self.traces_summary or {}, "target") or {}
        if not s:
            self.add("train target", "skip", "no traces summary target to compare with", [self.cite(mp, "target")])
            return
        self.check_equal("train target", (t.get("spec"), t.get("weights_sha256")),
                         (s.get("spec"), s.get("weights_sha256")),
                         "the training target and the traces' target (spec, weights sha256)",
                         [self.cite(mp, "target.spec"), self.cite(mp, "target.weights_sha256"),
                          self.cite(self.paths.traces_summary, "target.spec"),
                          self.cite(self.paths.traces_summary, "target.weights_sha256")],
                         lambda x: f"{x[0]} {_short(x[1])}")

    def _train_traces(self, meta: dict) -> None:
        mp, tp = self.paths.train_meta, self.paths.traces
        rec = meta.get("traces") or {}
        if tp.is_file():
            self.check_equal("train traces sha256", self.sha(tp), rec.get("sha256"),
                             "traces.jsonl and the traces the draft was trained on (sha256)",
                             [self.cite(tp), self.cite(mp, "traces.sha256")], _short)
        if self.traces is not None and rec.get("count") is not None:
            usable = sum(1 for t in self.traces if t.get("completion_ids"))
            self.check_equal("train traces count", rec.get("count"), usable,
                             "traces trained on (recorded) and traces with a completion in traces.jsonl",
                             [self.cite(mp, "traces.count")])
        if rec.get("summary_sha256") and self.paths.traces_summary.is_file():
            same = rec["summary_sha256"] == self.sha(self.paths.traces_summary)
            self.add("train traces summary", "pass" if same else "warn",
                     "traces.summary.json is the one training read" if same else
                     "traces.summary.json was rewritten after training (the traces sha256 above is what counts)",
                     [self.cite(mp, "traces.summary_sha256")])

    def _train_labels(self, meta: dict) -> None:
        """Teacher-forced labels (`specdraft label`), when the draft was trained on them: the file is the one
        trained on, it was labelled by the traces' target from this run's prompts, and its labels are the
        target's argmax (re-scored on a few rows)."""
        mp = self.paths.train_meta
        rec = meta.get("labels")
        if not rec:
            self.add("train labels", "pass", "trained on greedy traces only (no teacher-forced labels)",
                     [self.cite(mp, "labels")])
            return
        path = self.labels_file()
        if not path.is_file():
            self.add("train labels", "fail", f"the labels the draft was trained on are gone ({path})",
                     [self.cite(mp, "labels.path")])
            return
        self.check_equal("train labels sha256", self.sha(path), rec.get("sha256"),
                         "labels.jsonl and the labels the draft was trained on (sha256)",
                         [self.cite(path), self.cite(mp, "labels.sha256")], _short)
        sp = path.with_name(path.stem + ".summary.json")
        summary = self.json(sp)
        if summary is None:
            self.add("labels summary", "fail", f"missing: {self.rel(sp)} (written by specdraft label)", [self.cite(sp)])
            return
        self.check_equal("labels sha256", self.sha(path), summary.get("labels_sha256"),
                         "labels.jsonl and labels.summary.json (sha256)",
                         [self.cite(path), self.cite(sp, "labels_sha256")], _short)
        t, s = summary.get("target") or {}, _get(self.traces_summary or {}, "target") or {}
        self.check_equal("labels target", (t.get("spec"), t.get("weights_sha256")),
                         (s.get("spec"), s.get("weights_sha256")),
                         "the labelling target and the traces' target (spec, weights sha256)",
                         [self.cite(sp, "target.spec"), self.cite(self.paths.traces_summary, "target.spec")],
                         lambda x: f"{x[0]} {_short(x[1])}")
        if self.paths.prompts.is_file():
            same = _get(summary, "prompts.sha256") == self.sha(self.paths.prompts)
            # The answers' own contamination is checked in the data section, whichever file they came from.
            self.add("labels prompts", "pass" if same else "fail",
                     "labelled answers come from this run's prompts.jsonl" if same else
                     "labelled answers come from another prompts file than this run's: its data provenance is "
                     "not the one audited here",
                     [self.cite(sp, "prompts.sha256"), self.cite(self.paths.prompts)])
        rows = [r for r in self.jsonl(path) or [] if r.get("prompt_ids") and r.get("completion_ids")]
        model, why, field = self.rescoring_model(t.get("weights_sha256"))
        if self.cfg.greedy_check == 0 or not rows or model is None:
            self.add("labels re-scored", "skip", "--greedy-check 0" if self.cfg.greedy_check == 0 else
                     "no rows" if not rows else why, [self.cite(sp, field or "target.path")])
            return
        picks = _spread(rows, self.cfg.greedy_check)
        mismatched, total, bad = _argmax_mismatches(model, picks, "target_ids", path.name)
        cites = [self.cite(path, "target_ids"), self.cite(sp, "target.path")]
        if mismatched <= max(0, total // 100):  # float near-ties on another machine, as for traces
            self.add("labels re-scored", "pass" if not mismatched else "warn",
                     f"{len(picks)} labelled rows re-scored with the target: {total - mismatched} of {total} labels "
                     "are its argmax", cites, bad)
        else:
            self.add("labels re-scored", "fail", f"{mismatched} of {total} labels are not the target's argmax",
                     cites, bad)

    def _train_weights(self, meta: dict) -> None:
        mp = self.paths.train_meta
        self.check_equal("checkpoint weights sha256", self.weights_sha(self.paths.checkpoint),
                         meta.get("checkpoint_weights_sha256"),
                         "the checkpoint's weights and train_meta.json (sha256)",
                         [self.cite(self.paths.checkpoint / "model.safetensors"),
                          self.cite(mp, "checkpoint_weights_sha256")], _short)

    def _train_shapes(self) -> None:
        from transformers import AutoConfig

        from . import qd4
        from .models import weight_files
        ck = self.paths.checkpoint
        if not self.require(ck / "config.json", "the checkpoint's config"):
            return
        files = [f for f in weight_files(ck) if f.suffix == ".safetensors"]
        if not files:
            self.add("tensor shapes", "fail", f"{self.rel(ck)} holds no .safetensors weight file",
                     [self.cite(ck, "directory listing")])
            return
        config = AutoConfig.from_pretrained(ck)
        arch = (config.architectures or [type(config).__name__])[0]
        expected = {n: list(t.shape) for n, t in qd4.stored_tensors(qd4.meta_model(config)).items()}
        stored: dict[str, list[int]] = {}
        for f in files:
            stored.update(safetensors_shapes(f))
        problems = [f"{n}: file {stored[n]} vs {arch} {expected[n]}" for n in expected
                    if n in stored and stored[n] != expected[n]]
        problems += [f"{n}: missing from the checkpoint" for n in expected if n not in stored]
        problems += [f"{n}: not a tensor of {arch}" for n in stored if n not in expected]
        cites = [self.cite(files[0], "safetensors header"), self.cite(ck / "config.json", "architectures")]
        if problems:
            self.add("tensor shapes", "fail", f"the checkpoint's tensors are not those of its config ({arch})",
                     cites, problems)
        else:
            self.add("tensor shapes", "pass", f"{len(stored)} tensors with {arch} shapes", cites)
        self.facts["checkpoint"] = {"architecture": arch, "tensors": len(stored)}

    def _train_config_vs_init(self, meta: dict) -> None:
        init = meta.get("init") or {}
        path = init.get("path")
        ck_cfg = self.paths.checkpoint / "config.json"
        if not path or not Path(path, "config.json").is_file() or not ck_cfg.is_file():
            self.add("config vs init", "skip", f"the init model {path!r} is not on this machine",
                     [self.cite(self.paths.train_meta, "init.path")])
            return
        a = json.loads(Path(path, "config.json").read_text())
        b = json.loads(ck_cfg.read_text())
        diffs = [f"{k}: init {a.get(k)!r}, checkpoint {b.get(k)!r}" for k in CONFIG_KEYS if a.get(k) != b.get(k)]
        keep = init.get("truncate_layers")
        layers = (keep if isinstance(keep, int) else len(keep)) if keep is not None else a.get("num_hidden_layers")
        if b.get("num_hidden_layers") != layers:
            diffs.append(f"num_hidden_layers: expected {layers} from the init, checkpoint {b.get('num_hidden_layers')}")
        self.add("config vs init", "fail" if diffs else "pass",
                 "the checkpoint's config is not the init's architecture" if diffs else
                 f"the checkpoint's config is the init's ({b.get('model_type')}, {layers} layers)",
                 [self.cite(ck_cfg), self.cite(self.paths.train_meta, "init.truncate_layers")], diffs)

    # =========================================================================================== pack

    def audit_pack(self) -> None:
        self.section = "pack"
        md = self.paths.model_dir
        self.expect([(md, "packed model dir, written by specdraft pack")])
        if not md.is_dir():
            return
        self.expect([(md / "architecture.json", "written by specdraft pack"),
                     (md / "pack_recipe.json", "written by specdraft pack")])
        arch = self.json(md / "architecture.json")
        recipe = self.json(md / "pack_recipe.json")
        self.guard("weight file", lambda: self._pack_weight(arch, recipe))
        self.guard("recipe source", lambda: self._pack_source(recipe))
        self.guard("calibration", lambda: self._pack_calibration(recipe))
        self.guard("side files", self._pack_side_files)
        self.guard("self-draft", self._pack_self_draft)

    def _weight_path(self, arch: dict | None) -> Path:
        from .pack import WEIGHT_FILE
        return self.paths.model_dir / str((arch or {}).get("weight_file") or WEIGHT_FILE)

    def _pack_weight(self, arch: dict | None, recipe: dict | None) -> None:
        from . import qd4
        md = self.paths.model_dir
        w = self._weight_path(arch)
        if not self.require(w, "the QD04 weight file"):
            return
        size, sha = w.stat().st_size, self.sha(w)
        self.facts["weight_file"] = {"path": str(w), "bytes": size, "sha256": sha}
        ap, rp = md / "architecture.json", md / "pack_recipe.json"
        if arch is not None:
            self.check_equal("weight bytes", size, arch.get("bytes"), f"{w.name} bytes and architecture.json",
                             [self.cite(w), self.cite(ap, "bytes")], _bytes)
            self.check_equal("weight sha256", sha, arch.get("sha256"), f"{w.name} and architecture.json (sha256)",
                             [self.cite(w), self.cite(ap, "sha256")], _short)
        if recipe is not None:
            self.check_equal("weight bytes", size, _get(recipe, "output.bytes"), f"{w.name} bytes and pack_recipe.json",
                             [self.cite(w), self.cite(rp, "output.bytes")], _bytes)
            self.check_equal("weight sha256", sha, _get(recipe, "output.sha256"),
                             f"{w.name} and pack_recipe.json (sha256)", [self.cite(w), self.cite(rp, "output.sha256")],
                             _short)
        try:
            header = qd4.verify_qd4(w)
        except qd4.QD4Error as e:
            self.add("weight file structure", "fail", e.reason, [self.cite(w, "QD04 header + payload sha256")])
            return
        self.add("weight file structure", "pass", f"QD04 v{header.format_version}, {len(header.entries)} tensors, "
                                                  f"q4g tensors by G {header.q4g_group_sizes()}, payload sha256 "
                                                  "verified", [self.cite(w, "header.payload_sha256")])
        if recipe is not None:
            self.check_equal("payload sha256", header.payload_sha256, _get(recipe, "output.payload_sha256"),
                             "the file header's payload sha256 and pack_recipe.json",
                             [self.cite(w, "header.payload_sha256"), self.cite(rp, "output.payload_sha256")], _short)
            if "group_sizes" in recipe:  # recipes before QD04 v2 have no such record
                own = {e.name: e.group_size for e in header.entries
                       if e.group_size is not None and e.group_size != header.group_size}
                self.check_equal("group sizes", own, recipe["group_sizes"],
                                 "tensors the file stores at their own G and pack_recipe.json's group_sizes",
                                 [self.cite(w, "header.tensors[].group_size"), self.cite(rp, "group_sizes")],
                                 lambda d: f"{len(d)} tensors at {sorted(set(d.values()))}" if d else "none")

    def _pack_source(self, recipe: dict | None) -> None:
        if recipe is None:
            return
        rp = self.paths.model_dir / "pack_recipe.json"
        src = _get(recipe, "source.weights_sha256")
        meta = self.train_meta if self.paths.train_meta.is_file() else None
        if meta is not None:
            self.check_equal("recipe source", src, meta.get("checkpoint_weights_sha256"),
                             "the packed checkpoint and the training output (weights sha256)",
                             [self.cite(rp, "source.weights_sha256"),
                              self.cite(self.paths.train_meta, "checkpoint_weights_sha256")], _short)
        if self.paths.checkpoint.is_dir():
            actual = self.weights_sha(self.paths.checkpoint)
            if actual != src or meta is None:
                self.check_equal("recipe source on disk", src, actual,
                                 f"the packed checkpoint and {self.rel(self.paths.checkpoint)} on disk "
                                 "(weights sha256)",
                                 [self.cite(rp, "source.weights_sha256"), self.cite(self.paths.checkpoint)], _short)

    def _pack_self_draft(self) -> None:
        """The demo's reference draft (RUN_DIR/model_self, when there): its weight file is the one its records
        describe, and what it packed is the target's own weights."""
        from . import qd4
        from .pack import WEIGHT_FILE
        md = self.paths.run_dir / "model_self"
        if not md.is_dir():
            return
        ap, rp = md / "architecture.json", md / "pack_recipe.json"
        self.expect([(ap, "written by specdraft pack"), (rp, "written by specdraft pack")])
        arch, recipe = self.json(ap), self.json(rp)
        if arch is None or recipe is None:
            return
        w = md / str(arch.get("weight_file") or WEIGHT_FILE)
        if not self.require(w, "the self-draft's QD04 weight file"):
            return
        sha = self.sha(w)
        for record, path in ((arch, ap), (_get(recipe, "output") or {}, rp)):
            self.check_equal("self-draft weight file", [w.stat().st_size, sha], [record.get("bytes"),
                             record.get("sha256")], f"{self.rel(w)} and {path.name} (bytes, sha256)",
                             [self.cite(w), self.cite(path, "bytes, sha256")], lambda v: f"{v[0]} B {_short(v[1])}")
        try:
            qd4.verify_qd4(w)
        except qd4.QD4Error as e:
            self.add("self-draft weight file", "fail", e.reason, [self.cite(w, "QD04 header + payload sha256")])
        target = self.target_dir()
        if target is not None:
            self.check_equal("self-draft source", _get(recipe, "source.weights_sha256"), self.weights_sha(target),
                             "the self-draft's packed checkpoint and the target that wrote the traces "
                             "(weights sha256)", [self.cite(rp, "source.weights_sha256"), self.cite(target)], _short)

    def _pack_calibration(self, recipe: dict | None) -> None:
        """--fit gptq chose codes from traces: the file it names must still hold the recorded bytes."""
        calibration = (recipe or {}).get("calibration")
        if not calibration:
            return
        rp = self.paths.model_dir / "pack_recipe.json"
        path = Path(str(calibration.get("traces")))
        cites = [self.cite(rp, "calibration.sha256"), self.cite(path)]
        if not path.is_file():  # a moved run dir: its own traces may be the calibration file
            if self.paths.traces.is_file() and self.sha(self.paths.traces) == calibration.get("sha256"):
                self.add("calibration", "pass", f"the gptq calibration traces ({path}, not on disk) are the run's "
                         f"traces {self.rel(self.paths.traces)} (sha256 {_short(calibration.get('sha256'))})",
                         [*cites, self.cite(self.paths.traces)])
            else:
                self.add("calibration", "fail", f"calibration traces {path} are gone (recorded sha256 "
                         f"{_short(calibration.get('sha256'))})", cites)
            return
        self.check_equal("calibration", self.sha(path), calibration.get("sha256"),
                         f"the gptq calibration traces {self.rel(path)} and pack_recipe.json (sha256)", cites, _short)

    def _pack_side_files(self) -> None:
        from .pack import TOKENIZER_FILES
        md, ck = self.paths.model_dir, self.paths.checkpoint
        if not ck.is_dir():
            return
        names = ["config.json"] + [n for n in TOKENIZER_FILES if (ck / n).is_file() or (md / n).is_file()]
        differ = []
        for n in names:
            a, b = md / n, ck / n
            if not a.is_file() or not b.is_file():
                where = "the model dir" if not a.is_file() else "the checkpoint"
                differ.append(f"{n}: missing from {where}")
            elif self.sha(a) != self.sha(b):
                differ.append(f"{n}: differs from the checkpoint's")
        self.add("side files", "fail" if differ else "pass",
                 "config/tokenizer files are not the checkpoint's" if differ else
                 f"config.json and {len(names) - 1} tokenizer files are the checkpoint's, byte for byte",
                 [self.cite(md / "config.json"), self.cite(ck / "config.json")], differ)

    # ========================================================================================== serve

    def audit_serve(self) -> None:
        self.section = "serve"
        md = self.paths.model_dir
        if not md.is_dir():
            self.require(md, "packed model dir, specdraft pack")
            return
        self.guard("model dir contents", self._serve_contents)
        self.guard("strict load", self._serve_load)
        if self.cfg.serve_check:
            self.guard("sandboxed server", self._serve_sandbox)
        else:
            self.add("sandboxed server", "skip", "--no-serve-check", [self.cite(md)])

    def _serve_contents(self) -> None:
        from .pack import TOKENIZER_FILES
        md = self.paths.model_dir
        arch = self.json(md / "architecture.json") or {}
        allowed = set(MODEL_DIR_BASE_FILES) | set(TOKENIZER_FILES) | {self._weight_path(arch).name}
        entries = sorted(md.iterdir(), key=lambda p: p.name)
        stray, logs, present = [], [], []
        for p in entries:
            if p.is_symlink() or not p.is_file():
                stray.append(p.name + ("/" if p.is_dir() else " (not a regular file)"))
            elif p.name in allowed:
                present.append(p.name)
            elif p.name in MODEL_DIR_LOGS:
                logs.append(p.name)
            else:
                stray.append(p.name)
        if stray:
            self.add("model dir contents", "fail", f"{len(stray)} files that are not config, generation config, "
                                                   "tokenizer or weights: " + ", ".join(stray),
                     [self.cite(md, "directory listing")], [f"stray: {s}" for s in stray])
        else:
            self.add("model dir contents", "pass", "only " + ", ".join(present)
                     + (f" (and the pack stage's own {', '.join(logs)})" if logs else ""),
                     [self.cite(md, "directory listing")])

    def _serve_load(self) -> None:
        from .pack import load_packed_model
        from .qd4 import QD4Error
        md = self.paths.model_dir
        try:
            _, info = load_packed_model(md)
        except (QD4Error, OSError, ValueError) as e:
            self.add("strict load", "fail", f"the strict loader refuses the model dir: {e}",
                     [self.cite(md / "draft.qd4", "QD04 header")])
            return
        ok = info.missing == 0 and info.unexpected == 0
        self.add("strict load", "pass" if ok else "fail",
                 f"load_packed_model: missing={info.missing} unexpected={info.unexpected}",
                 [self.cite(md / "draft.qd4", "header tensor names"), self.cite(md / "config.json")],
                 info.unexpected_keys)

    def _draft_context(self) -> list[int]:
        for t in self.traces or []:
            if t.get("prompt_ids"):
                return [int(x) for x in t["prompt_ids"][-64:]]
        return [1, 2, 3]

    def _serve_sandbox(self) -> None:
        md = self.paths.model_dir.resolve()
        out = self.paths.out
        result = run_server_sandboxed(md, out / "serve_check.log", out / "serve_check.events.jsonl",
                                      self._draft_context(), timeout_s=self.cfg.serve_timeout_s)
        self.facts["serve_check"] = result.to_json()
        log_path, events = out / "serve_check.log", out / "serve_check.events.jsonl"
        if result.error:
            self.add("server answers", "fail", f"sandboxed server: {result.error}",
                     [self.cite(log_path, "listening on URL")], result.log_tail.splitlines()[-8:])
        else:
            self.add("server answers", "pass", f"started on {result.url}; POST /draft returned "
                                               f"{len(result.draft_ids)} tokens in {result.draft_seconds:.2f}s",
                     [self.cite(log_path, "listening on URL")])
        load_cite = [self.cite(log_path, "loaded qd4 missing=.. unexpected=.. line")]
        if result.loaded is None:
            self.add("server load", "fail", "the server log has no 'loaded qd4 missing=.. unexpected=..' line",
                     load_cite)
        else:
            ok = result.loaded == (0, 0)
            self.add("server load", "pass" if ok else "fail",
                     f"server log: loaded qd4 missing={result.loaded[0]} unexpected={result.loaded[1]}", load_cite)
        roots = allowed_roots(md, result.python_roots, denied=[self.run_dir], own_dirs=[result.sandbox_dir],
                              created=result.created, absent=result.absent)
        opened = classify_opens(result.opens, roots)
        self.facts["serve_opens"] = {k: sorted(v) for k, v in opened.items()}
        net = result.network
        self.add("no network", "fail" if net else "pass",
                 f"{len(net)} network attempts blocked and recorded" if net else
                 f"no outgoing connection or name lookup (bind only: {', '.join(result.binds) or 'none'})",
                 [self.cite(events, "event=connect|getaddrinfo|gethostbyname|sendto|bind|urllib")],
                 [json.dumps(e) for e in net])
        other = sorted(opened["other"])
        writes = sorted(p for p, w in result.opens.items()
                        if w and classify_path(p, roots) != "temp" and not _under(p, "/dev"))
        self.add("files read", "fail" if other else "pass",
                 f"{len(other)} files opened outside the model dir, Python code/metadata and the server's own "
                 "temp files" if other else
                 f"{len(opened['model_dir'])} files opened in the model dir; the rest are Python code/metadata "
                 f"({len(opened['python'])}), /proc /sys /dev ({len(opened['system'])}) and the server's own "
                 f"sandbox dir or files it created ({len(opened['temp'])})",
                 [self.cite(events, "event=open")], other)
        self.add("files written", "fail" if writes else "pass",
                 f"{len(writes)} files opened for writing" if writes else
                 "no file opened for writing (but /dev and files the server created itself)",
                 [self.cite(events, "event=open write=true")], writes)
        spawned = result.spawned
        self.add("no subprocess", "fail" if spawned else "pass",
                 f"{len(spawned)} processes spawned" if spawned else "no process spawned",
                 [self.cite(events, "event=spawn")], [json.dumps(e) for e in spawned])

    # ========================================================================================== report

    def run(self) -> AuditReport:
        for section, fn in (("data", self.audit_data), ("traces", self.audit_traces),
                            ("training", self.audit_training), ("pack", self.audit_pack), ("serve", self.audit_serve)):
            self.section = section
            t = time.time()
            self.guard(section, fn)
            if section == "training":
                self._rescorer = None  # traces and training were its only users; free it before serving
            self.facts.setdefault("seconds", {})[section] = round(time.time() - t, 2)
        return AuditReport(self.run_dir, self.findings, self.paths.out, self.facts)


def safetensors_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """Tensor name -> shape from a .safetensors header (8-byte little-endian length + JSON), no data read."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 256 << 20:
            raise ValueError(f"{path}: safetensors header of {n} bytes is not plausible")
        header = json.loads(f.read(n))
    return {k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"}


# ------------------------------------------------------------------------------------- server sandbox

SANDBOX_SCRIPT = textwrap.dedent('''\
    """specdraft audit sandbox: run a module with outgoing sockets blocked and every open recorded.

    usage: python sandbox.py EVENTS.jsonl -- MODULE ARG...
    One JSON object per line goes to EVENTS.jsonl: {"event": "open", "path", "write", "created", "missing"},
    {"event": "connect"|"getaddrinfo"|"sendto"|"bind", ...}, {"event": "spawn", ...}, and first {"event": "start",
    "python_roots", "sandbox_dir"}.
    """
    import ipaddress
    import json
    import os
    import runpy
    import site
    import socket
    import sys
    import sysconfig

    events_path = sys.argv[1]
    sep = sys.argv.index("--")
    module, args = sys.argv[sep + 1], sys.argv[sep + 2:]
    fd = os.open(events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    seen = set()
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


    def emit(rec):
        line = json.dumps(rec, sort_keys=True, default=repr)
        if line not in seen:
            seen.add(line)
            os.write(fd, (line + "\\n").encode())


    def loopback(host):
        if host in (None, "", "localhost", "ip6-localhost", "ip6-loopback"):
            return True
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False


    def literal(host):
        if isinstance(host, bytes):
            host = host.decode(errors="replace")
        try:
            ipaddress.ip_address(str(host).split("%")[0])
            return True
        except ValueError:
            return False


    def address(addr):
        if isinstance(addr, tuple) and addr:
            return addr[0], list(addr)
        return None, repr(addr)


    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.update(p for p in sysconfig.get_paths().values() if p)
    roots.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    roots.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    emit({"event": "start", "pid": os.getpid(), "cwd": os.getcwd(), "python_roots": sorted(r for r in roots if r),
          "sandbox_dir": os.path.dirname(os.path.abspath(__file__)), "module": module, "args": args})


    def hook(event, hargs):
        if event == "open":
            path, mode, flags = (tuple(hargs) + (None, None, None))[:3]
            if path is None or isinstance(path, int):
                return
            try:
                p = os.path.abspath(os.fsdecode(path))
            except (TypeError, ValueError):
                p = repr(path)
            write = bool(isinstance(mode, str) and any(c in mode for c in "wax+")) or \\
                bool(isinstance(flags, int) and flags & WRITE_FLAGS)
            # The hook runs before the open: a file absent now and opened for writing is one the server creates
            # (its own scratch file, not data it found); absent and opened for reading, a probe that reads nothing.
            exists = os.path.exists(p)
            emit({"event": "open", "path": p, "write": write, "created": write and not exists,
                  "missing": not write and not exists})
        elif event == "socket.connect":
            sock, addr = hargs
            host, rendered = address(addr)
            emit({"event": "connect", "family": str(getattr(sock, "family", "")), "address": rendered,
                  "blocked": True})
            raise PermissionError(f"specdraft audit sandbox: outgoing connection to {rendered} blocked")
        elif event in ("socket.sendto", "socket.sendmsg"):
            sock, addr = hargs[0], hargs[1] if len(hargs) > 1 else None
            host, rendered = address(addr)
            if addr is not None and not loopback(host):
                emit({"event": "sendto", "address": rendered, "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: datagram to {rendered} blocked")
        elif event == "socket.getaddrinfo":
            host = hargs[0]
            if not loopback(host) and not literal(host):  # a literal address needs no lookup: connect decides
                emit({"event": "getaddrinfo", "host": repr(host), "port": repr(hargs[1]), "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: name lookup of {host!r} blocked")
        elif event == "socket.gethostbyname" or event == "socket.gethostbyaddr":
            host = hargs[0] if hargs else None
            if not loopback(host):
                emit({"event": event.split(".")[1], "host": repr(host), "blocked": True})
                raise PermissionError(f"specdraft audit sandbox: name lookup of {host!r} blocked")
        elif event == "socket.bind":
            sock, addr = hargs
            host, rendered = address(addr)
            ok = loopback(host) or getattr(sock, "family", None) == getattr(socket, "AF_UNIX", None)
            emit({"event": "bind", "address": rendered, "blocked": not ok})
            if not ok:
                raise PermissionError(f"specdraft audit sandbox: bind to {rendered} blocked (loopback only)")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile"):
            emit({"event": "spawn", "via": event, "args": repr(hargs)[:300], "blocked": True})
            raise PermissionError(f"specdraft audit sandbox: {event} blocked")
        elif event == "urllib.Request":
            emit({"event": "urllib", "url": repr(hargs[0])[:300], "blocked": True})
            raise PermissionError("specdraft audit sandbox: urllib request blocked")


    sys.addaudithook(hook)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
''')


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


def start_sandboxed(module: str, args: list[str], events: Path, log_path: Path, cwd: Path | None = None,
                    env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m MODULE ARGS`` under the sandbox (sockets blocked, opens recorded to ``events``)."""
    sandbox_dir = Path(tempfile.mkdtemp(prefix="specdraft-audit-sandbox-"))
    script = sandbox_dir / "sandbox.py"
    script.write_text(SANDBOX_SCRIPT, encoding="utf-8")
    events.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    events.unlink(missing_ok=True)
    log_file = open(log_path, "wb")
    try:
        proc = subprocess.Popen([sys.executable, str(script), str(events), "--", module, *args],
                                stdout=log_file, stderr=subprocess.STDOUT, cwd=str(cwd or sandbox_dir),
                                # no .pyc writes: a stale bytecode cache is not the server writing files
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                                     **(env or {})})
    except BaseException:
        shutil.rmtree(sandbox_dir, ignore_errors=True)
        raise
    finally:
        log_file.close()
    proc.sandbox_dir = sandbox_dir  # removed by stop_process
    return proc


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM (then SIGKILL after ``timeout``) the process we started; remove its sandbox dir."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    finally:
        sandbox_dir = getattr(proc, "sandbox_dir", None)
        if sandbox_dir is not None:
            shutil.rmtree(sandbox_dir, ignore_errors=True)
    return proc.returncode


def run_server_sandboxed(model_dir: Path, log_path: Path, events: Path, context: list[int],
                         timeout_s: float = 120.0, num_tokens: int = 4) -> SandboxResult:
    """`specdraft serve --model-dir DIR --port 0` in the sandbox: wait for it, POST one /draft, stop it."""
    import httpx

    started = time.monotonic()
    deadline = started + timeout_s
    result = SandboxResult()
    proc = start_sandboxed("specdraft.cli", ["serve", "--model-dir", str(model_dir), "--host", "127.0.0.1",
                                             "--port", "0", "--threads", "1"], events, log_path)
    try:
        with httpx.Client(trust_env=False, timeout=10) as client:
            while time.monotonic() < deadline:
                text = log_path.read_text(encoding="utf-8", errors="replace")
                if result.url is None and (m := LISTENING.search(text)):
                    result.url = m.group(1).rstrip("/")
                if result.url is not None:
                    try:
                        r = client.get(result.url + "/health")
                        if r.status_code == 200:
                            break
                        if r.status_code == 503 and r.json().get("status") == "failed":
                            result.error = f"/health says failed: {r.json().get('detail')}"
                            break
                    except (httpx.HTTPError, ValueError):
                        pass
                if proc.poll() is not None:
                    result.error = f"the server exited with code {proc.returncode} before it was ready"
                    break
                time.sleep(0.2)
            else:
                result.error = f"not ready within {timeout_s:.0f}s"
            if result.error is None:
                t = time.monotonic()
                try:
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
    finally:
        result.returncode = stop_process(proc)
    result.seconds = time.monotonic() - started
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
    result.log_tail = "\n".join(text.splitlines()[-20:])
    if (m := LOADED_QD4.search(text)):
        result.loaded = (int(m.group(1)), int(m.group(2)))
    read_sandbox_events(events, result)
    return result


def allowed_roots(model_dir: Path, python_roots: Iterable[str], denied: Iterable[str | os.PathLike] = (),
                  own_dirs: Iterable[str | os.PathLike | None] = (), created: Iterable[str] = (),
                  absent: Iterable[str] = ()) -> dict[str, list[str]]:
    """Where the server may read: the model dir; code and package metadata of the Python installation (and of
    specdraft's own package dir, which an editable install keeps outside it); /proc, /sys, /dev but /dev/shm;
    its own sandbox dir (``own_dirs``) and the files it created itself (``created``). No other temp file: a
    table left in /tmp is data the model dir does not declare. ``absent`` (paths no open found on disk: import
    probes) are harmless inside the Python roots. ``denied`` (the run dir) is never allowed outside the model
    dir, even when it lies in a temp dir."""
    import specdraft
    python = {os.path.realpath(p) for p in python_roots if p}
    python |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    python.add(os.path.realpath(Path(specdraft.__file__).parent))
    return {"model_dir": [os.path.realpath(model_dir)], "denied": sorted(os.path.realpath(d) for d in denied),
            "python": sorted(python), "system": ["/proc", "/sys", "/dev"], "not_system": ["/dev/shm"],
            "temp": sorted(os.path.realpath(d) for d in own_dirs if d), "created": sorted(created),
            "absent": sorted(absent)}


# What an import reads inside the Python roots: code, and package metadata (importlib.metadata, entry points).
PYTHON_CODE = re.compile(r"\.(py|pyc|pyd|pth|typed)$|\.so(\.\d+)*$")
PYTHON_METADATA_DIR = re.compile(r"/[^/]+\.(dist|egg)-info(/|$)")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _python_file(path: str, absent: bool) -> bool:
    """A file an import may read: code or package metadata; or a probe of a path that did not exist."""
    return absent or bool(PYTHON_CODE.search(path) or PYTHON_METADATA_DIR.search(path))


def classify_path(path: str, roots: dict[str, list[str]]) -> str:
    """model_dir | python | system | temp (the server's own) | other (a finding)."""
    real = os.path.realpath(path)
    forms = (path, real)

    def under(kind: str) -> bool:
        return any(_under(p, r) for r in roots.get(kind, ()) for p in forms)
    if under("model_dir"):
        return "model_dir"
    if under("denied"):
        return "other"
    if path in roots.get("created", ()) or under("temp"):
        return "temp"
    if under("system") and not under("not_system"):
        return "system"
    if under("python"):
        absent = path in roots.get("absent", ())
        return "python" if all(_python_file(p, absent) for p in forms) else "other"
    return "other"


def classify_opens(opens: Iterable[str], roots: dict[str, list[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {k: set() for k in ("model_dir", "python", "system", "temp", "other")}
    for p in opens:
        out[classify_path(p, roots)].add(p)
    return out


# --------------------------------------------------------------------------------------------- output

def render_markdown(report: AuditReport, cfg: AuditConfig, meta: dict[str, Any]) -> str:
    c = report.counts()
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# specdraft audit: `{report.run_dir}`", "",
             f"**{verdict}**: {c['fail']} failed, {c['warn']} warnings, {c['pass']} passed, {c['skip']} skipped "
             f"({meta.get('created_at')}, specdraft git {meta.get('git_sha')}).", "",
             "Each finding cites the file (relative to the run dir) and the field it rests on.", "",
             "| section | pass | fail | warn | skip |", "|---|---:|---:|---:|---:|"]
    for s in SECTIONS:
        sc = report.counts(s)
        lines.append(f"| {s} | {sc['pass']} | {sc['fail']} | {sc['warn']} | {sc['skip']} |")
    if report.failed:
        lines += ["", "## Failures", ""]
        lines += [f"- **{f.section} / {f.check}**: {f.message}" for f in report.failed]
    for s in SECTIONS:
        lines += ["", f"## {s}", ""]
        for f in (f for f in report.findings if f.section == s):
            cites = "; ".join(f"`{x['file']}`" + (f" → `{x['field']}`" if x["field"] else " (whole file)")
                              for x in f.cites)
            lines.append(f"- {f.status.upper()} **{f.check}**: {f.message}"
                         + (f"  \n  rests on: {cites}" if cites else ""))
            lines += [f"  - {d}" for d in f.details]
    return "\n".join(lines) + "\n"


def write_report(report: AuditReport, cfg: AuditConfig) -> tuple[Path, Path]:
    meta = run_metadata()
    out = report.out_dir
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "run_dir": str(report.run_dir),
        "passed": report.passed,
        "counts": report.counts(),
        "sections": {s: report.counts(s) for s in SECTIONS},
        "findings": [f.to_json() for f in report.findings],
        "facts": report.facts,
        "config": cfg.to_json_dict(),
        **meta,
    }
    json_path, md_path = out / "audit.json", out / "audit.md"
    atomic_write_json(json_path, data)
    atomic_write_text(md_path, render_markdown(report, cfg, meta))
    return md_path, json_path


def audit_run(cfg: AuditConfig) -> AuditReport:
    """The checks without the exit code (tests and programmatic use); also writes audit.md / audit.json."""
    paths = RunPaths.from_config(cfg)
    if not paths.run_dir.is_dir():
        raise FileNotFoundError(f"run dir {paths.run_dir}: no such directory")
    paths.out.mkdir(parents=True, exist_ok=True)
    with stage_log(paths.out / "audit.log", "specdraft"):
        report = Audit(cfg).run()
        md, js = write_report(report, cfg)
        c = report.counts()
        log.info("audit %s: %d failed, %d warnings, %d passed, %d skipped; wrote %s and %s",
                 "passed" if report.passed else "FAILED", c["fail"], c["warn"], c["pass"], c["skip"], md, js)
    return report


def run_audit(cfg: AuditConfig) -> int:
    """`specdraft audit RUN_DIR`: 0 when every check passes (warnings allowed), 1 on any failure, 2 on no run dir."""
    try:
        report = audit_run(cfg)
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    c = report.counts()
    print(f"audit {'PASSED' if report.passed else 'FAILED'}: {c['fail']} failed, {c['warn']} warnings, "
          f"{c['pass']} passed, {c['skip']} skipped -> {report.out_dir / 'audit.md'}")
    for f in report.failed:
        print(f"  FAIL {f.section}/{f.check}: {f.message}")
    return 0 if report.passed else 1
