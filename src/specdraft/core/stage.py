"""The shared opening of a resumable stage that writes one JSONL row per prompt (traces, validation, label,
conversations).

An output ``X.jsonl`` has ``X.summary.json`` and ``X.log`` beside it (``side_paths``; ``run_logged`` runs a stage
with that log). A rerun appends: the rows already there are checked (``checked_rows`` / ``row_ids``, after a torn
last line is cut: ``resumed_ids``) before anything is decoded, and refused when the summary's ``resume_key`` (target
weights, token limit, template, ...) differs from this run's (``check_resume``); the summary of the run under way
keeps the earlier runs' records (``write_running_summary``). ``Progress`` shows a tqdm bar and gathers the counts
the summary records.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from tqdm import tqdm

from specdraft.core.config import StageConfig
from specdraft.core.io import RecordFileError, atomic_write_json, read_json, read_jsonl, repair_jsonl
from specdraft.core.provenance import run_metadata, stage_log

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    out: Path
    summary: Path
    rows: int  # lines in the output file
    new_prompts: int  # prompts decoded by this run
    summary_data: dict[str, Any] = field(default_factory=dict)


def side_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.stem + ".summary.json"), out.with_name(out.stem + ".log")


Result = TypeVar("Result")


def run_logged(out: str | Path, run: Callable[[Path, Path, Path], Result]) -> Result:
    """``run(out, summary path, log path)`` with the stage's log file beside its output (its folder made first)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary_path, log_path = side_paths(out)
    with stage_log(log_path):
        return run(out, summary_path, log_path)


def summary_path(records: str | Path) -> Path:
    """The summary the writing stage keeps beside its output: X.summary.json for X.jsonl (``side_paths``)."""
    return side_paths(Path(records))[0]


def recorded_target(records: str | Path) -> str | None:
    """The target spec recorded in the summary beside a traces or labels file, if it records one."""
    path = summary_path(records)
    target = read_json(path).get("target") if path.is_file() else None
    if isinstance(target, dict):
        return target.get("spec")
    return target if isinstance(target, str) else None


def resume_key(target: dict[str, Any], cfg: StageConfig, template: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """What must match for a rerun to append to an existing output."""
    return {"target_weights_sha256": target.get("weights_sha256"), "target_gguf_sha256": target.get("gguf_sha256"),
            "max_new_tokens": cfg.max_new_tokens, "chat_template": template, **extra}


def check_resume(summary_path: Path, out: Path, key: dict[str, Any], done: int) -> None:
    if not done:
        return
    if not summary_path.is_file():
        log.warning("%s has %d rows but no %s: cannot check they come from the same target", out, done,
                    summary_path.name)
        return
    previous = read_json(summary_path)
    old = previous.get("resume_key")
    if old is not None and old != key:
        diff = {k: (old.get(k), key.get(k)) for k in sorted({*old, *key}) if old.get(k) != key.get(k)}
        raise RecordFileError(f"{out}: its rows were made with different settings {diff} (old, new); refusing to "
                          "mix them: use another --out or move the file away")
    if previous.get("status") != "complete":
        log.info("resuming an interrupted run: %d rows already in %s", done, out)


class Progress:
    """tqdm over prompts with completion tokens/s; also the numbers the summary needs."""

    def __init__(self, total: int, desc: str):
        self.bar = tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True, mininterval=1.0,
                        file=sys.stderr)
        self.started = time.perf_counter()
        self.prompts = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def update(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix(tok_s=f"{self.completion_tokens / elapsed:.1f}", refresh=False)
        self.bar.update(1)

    def close(self) -> dict[str, Any]:
        self.bar.close()
        wall = time.perf_counter() - self.started
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "wall_s": round(wall, 3),
                "completion_tokens_per_s": round(self.completion_tokens / wall, 2) if wall > 0 else None,
                "total_tokens_per_s": round((self.prompt_tokens + self.completion_tokens) / wall, 2)
                if wall > 0 else None}


def peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)


def previous_runs(summary_path: Path, done: int) -> list[dict[str, Any]]:
    """The finished runs that made the rows already in the file (a killed run leaves no record)."""
    if not done or not summary_path.is_file():
        return []
    runs = read_json(summary_path).get("runs") or []
    return runs if isinstance(runs, list) else []


# What a resumed output file's rows must hold (checked before any decoding: the totals written after the run read
# them again, and a bad row found then would leave the new work behind an unfinished summary).
TRACE_FIELDS = {"prompt_ids": list, "completion_ids": list, "finish_reason": str}
POINT_FIELDS = {"category": str, "context_ids": list, "target_ids": list}
LABEL_FIELDS = {"prompt_ids": list, "completion_ids": list, "target_ids": list}


def checked_rows(path: Path, fields: dict[str, type]) -> Iterator[tuple[int, dict]]:
    for lineno, obj in read_jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            raise RecordFileError(f"{path}:{lineno}: not a row this stage wrote (a JSON object with a string 'id'); "
                              "move the file away and rerun")
        bad = [name for name, kind in fields.items() if not isinstance(obj.get(name), kind)]
        if bad:
            raise RecordFileError(f"{path}:{lineno}: field(s) {bad} missing or of the wrong type (expected "
                              f"{', '.join(f'{n}: {fields[n].__name__}' for n in bad)}); move the file away and rerun")
        yield lineno, obj


def resumed_ids(out: Path, fields: dict[str, type] = TRACE_FIELDS) -> set[str]:
    """The ids already in an output a rerun appends to (``row_ids``), once a torn last line (a killed write) is cut;
    the file exists afterwards."""
    repair_jsonl(out)
    out.touch()
    return row_ids(out, fields)


def resume_rows(out: Path, summary_path: Path, key: dict[str, Any], fields: dict[str, type] = TRACE_FIELDS) -> set[str]:
    """The ids a rerun keeps in ``out`` (``resumed_ids``), once ``check_resume`` finds them made with ``key``."""
    done = resumed_ids(out, fields)
    check_resume(summary_path, out, key, len(done))
    return done


def write_running_summary(summary_path: Path, base: dict[str, Any], done: int) -> list[dict[str, Any]]:
    """The summary of a run under way (``base`` and the earlier runs' records, which it keeps); those records."""
    earlier_runs = previous_runs(summary_path, done)
    atomic_write_json(summary_path, {**base, "status": "running", "runs": earlier_runs, "run": run_metadata()})
    return earlier_runs


def row_ids(path: Path, fields: dict[str, type] = TRACE_FIELDS) -> set[str]:
    ids: set[str] = set()
    for lineno, obj in checked_rows(path, fields):
        rid = obj["id"]
        if rid in ids:
            raise RecordFileError(f"{path}:{lineno}: duplicate id {rid!r}")
        ids.add(rid)
    return ids
