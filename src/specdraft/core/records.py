"""Readers of the JSONL files the stages exchange: prompts, traces and labels, evaluation points, answers.

Each reader names the file, the line and the field of a bad row (``RecordFileError``, a ValueError), so that a
stage refuses bad input before it spends any compute on it. ``json_rows`` is the one place a JSONL input is
decoded; the readers add what their rows must hold.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from specdraft.core.io import RecordFileError, text_lines


def json_rows(path: str | os.PathLike, what: str = "file") -> Iterator[tuple[str, Any]]:
    """``(where, value)`` for each non-blank line of a JSONL input (``where`` is ``path:line``); a missing file,
    a line that is not UTF-8 or not JSON raises RecordFileError naming it."""
    path = Path(path)
    if not path.is_file():
        raise RecordFileError(f"{what} {path}: no such file")
    for lineno, line in text_lines(path):
        where = f"{path}:{lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordFileError(f"{where}: not valid JSON ({e.msg})") from None


def token_ids(value: Any, where: str, field: str, min_len: int = 0, vocab: int | None = None) -> list[int]:
    """``value`` as a list of token ids (ints >= 0, below ``vocab`` when given), or RecordFileError naming the
    field. Booleans are refused: JSON true is not token 1."""
    if vocab is not None and not (isinstance(value, list) and len(value) >= max(1, min_len) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab for x in value)):
        raise RecordFileError(f"{where}: field {field!r} must be a non-empty list of token ids (integers in "
                              f"0..{vocab - 1}, the target tokenizer's)")
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise RecordFileError(f"{where}: field {field!r} must be a list of token ids (integers), got "
                              f"{type(value).__name__}")
    if len(value) < min_len:
        raise RecordFileError(f"{where}: field {field!r} has {len(value)} ids, need at least {min_len}")
    if any(x < 0 for x in value):
        raise RecordFileError(f"{where}: field {field!r} holds a negative token id")
    return value


# ------------------------------------------------------------------------------------------------ prompts

@dataclass(frozen=True)
class PromptRecord:
    """One prompt: text to be templated and tokenised, or (``token_ids`` inputs only) token ids used as they are."""

    id: str
    source: str  # corpus name (prompts.jsonl) or MT-bench category
    category: str  # MT-bench category, else the source
    text: str | None = None
    ids: list[int] | None = None
    offset: int | None = None  # a validation point's offset into its prompt's continuation
    followup: str | None = None  # prompts.jsonl: a chat's second user turn (`specdraft conversations` asks it)


def read_prompts(path: str | os.PathLike, *, token_ids_allowed: bool = False,
                 vocab: int | None = None) -> list[PromptRecord]:
    """Prompts of a prompts.jsonl (``id``, ``prompt``, ``source``), an MT-bench file (``question_id``,
    ``category``, ``turns``: the first turn) or the packaged corpus (``id``, ``category``, ``prompt``).

    By default (the decoding stages) ids must be present and unique: resuming relies on them. With
    ``token_ids_allowed`` (speculation) rows may instead hold ``context_ids`` / ``prompt_ids`` (validation
    points, traces; checked against ``vocab``), a row without an id takes its line number, and of the
    validation points of one prompt only the first is kept (one speculation per prompt).
    """
    records: list[PromptRecord] = []
    seen: dict[str, str] = {}
    for where, obj in json_rows(path, "prompts file"):
        rec = prompt_record(obj, where, token_ids_allowed, vocab)
        if rec.id in seen:
            if token_ids_allowed:
                continue
            raise RecordFileError(f"{where}: duplicate id {rec.id!r} (first on line {seen[rec.id].rpartition(':')[2]})")
        seen[rec.id] = where
        records.append(rec)
    if not records:
        raise RecordFileError(f"prompts file {path}: no prompts")
    return records


def prompt_record(obj: Any, where: str, token_ids_allowed: bool = False, vocab: int | None = None) -> PromptRecord:
    if not isinstance(obj, dict):
        raise RecordFileError(f"{where}: expected a JSON object")
    line_id = where.rpartition(":")[2]
    if "turns" in obj:  # MT-bench / Spec-Bench question
        turns, qid = obj.get("turns"), obj.get("question_id", obj.get("id"))
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise RecordFileError(f"{where}: 'turns' must be a list whose first item is a non-empty string")
        if qid is None and not token_ids_allowed:
            raise RecordFileError(f"{where}: missing 'question_id'")
        category = str(obj.get("category", "unknown"))
        return PromptRecord(id=str(line_id if qid is None else qid), source=category, category=category,
                            text=turns[0])
    ids_field = next((f for f in ("context_ids", "prompt_ids") if f in obj), None) if token_ids_allowed else None
    if ids_field is not None:
        source = str(obj.get("source", obj.get("category", "unknown")))
        return PromptRecord(id=str(obj.get("id", line_id)), source=source, category=str(obj.get("category", source)),
                            ids=list(token_ids(obj[ids_field], where, ids_field, 1, vocab)), offset=obj.get("offset"))
    if token_ids_allowed and not isinstance(obj.get("prompt"), str):
        raise RecordFileError(f"{where}: no prompt: expected 'prompt' (str), 'turns' (list of str), 'context_ids' "
                              "or 'prompt_ids'")
    for key in ("id", "prompt"):
        if key not in obj and not (key == "id" and token_ids_allowed):
            raise RecordFileError(f"{where}: missing field {key!r} (expected id, source, prompt or MT-bench turns)")
    if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
        raise RecordFileError(f"{where}: 'prompt' must be a non-empty string")
    pid = obj.get("id", line_id)
    if not isinstance(pid, (str, int)):
        raise RecordFileError(f"{where}: 'id' must be a string")
    source = str(obj.get("source", obj.get("category", "unknown")))
    followup = obj.get("followup")
    if followup is not None and not (isinstance(followup, str) and followup.strip()):
        raise RecordFileError(f"{where}: 'followup' must be a non-empty string when present")
    return PromptRecord(id=str(pid), source=source, category=str(obj.get("category", source)), text=obj["prompt"],
                        followup=followup)


def read_answers(path: str | os.PathLike, limit: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """Rows of a prompts.jsonl that carry a reference ``response`` (first ``limit``), and the row count."""
    rows, total, seen = [], 0, set()
    for where, obj in json_rows(path, "prompts file"):
        total += 1
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or "id" not in obj:
            raise RecordFileError(f"{where}: expected an object with 'id' and 'prompt'")
        if str(obj["id"]) in seen:
            raise RecordFileError(f"{where}: duplicate id {obj['id']!r}")
        seen.add(str(obj["id"]))
        if isinstance(obj.get("response"), str) and obj["response"].strip():
            rows.append(obj)
    if limit is not None:
        rows = rows[:limit]
    return rows, total


# ------------------------------------------------------------------------------------- traces and labels

@dataclass
class Example:
    """A training row: prompt + completion token ids; the loss is taken on the completion."""

    id: str
    input_ids: list[int]
    prompt_len: int  # positions < prompt_len are not trained on
    # What the target says at each completion position. None for greedy traces, where it is the completion
    # itself; teacher-forced labels (`specdraft label`) differ from the (human-written) completion.
    targets: list[int] | None = None
    # The target's K most likely ids and their log-probabilities at each completion position, when the traces
    # kept them (``traces --top-logprobs K``): the distribution ``train --kd-stored`` distils from
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    @property
    def completion(self) -> list[int]:
        return self.input_ids[self.prompt_len:]


def read_traces(path: str | Path, max_seq_len: int) -> list[Example]:
    """Greedy traces, or teacher-forced labels (rows with ``target_ids``, one per completion token), each cut to
    ``max_seq_len`` tokens (the completion first, then the prompt from the left)."""
    examples = []
    for where, rec in json_rows(path, "traces file"):
        if not isinstance(rec, dict) or "id" not in rec:
            raise RecordFileError(f"{where}: expected a JSON object with an 'id'")
        prompt, completion = token_ids(rec.get("prompt_ids"), where, "prompt_ids"), token_ids(
            rec.get("completion_ids"), where, "completion_ids")
        targets = token_ids(rec["target_ids"], where, "target_ids") if rec.get("target_ids") is not None else None
        if targets is not None and len(targets) != len(completion):
            raise RecordFileError(f"{where}: {len(targets)} target_ids for {len(completion)} completion ids")
        top_ids, top_logprobs = _top_logprobs(rec, where, len(completion))
        if not completion:
            continue
        completion = completion[: max_seq_len - 1]
        prompt = prompt[-(max_seq_len - len(completion)):]
        n = len(completion)
        examples.append(Example(str(rec["id"]), prompt + completion, len(prompt),
                                None if targets is None else list(targets[:n]),
                                None if top_ids is None else top_ids[:n],
                                None if top_logprobs is None else top_logprobs[:n]))
    if not examples:
        raise RecordFileError(f"{path}: no usable traces")
    return examples


def _top_logprobs(rec: Mapping[str, Any], where: str, positions: int
                  ) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    """A row's ``top_ids`` / ``top_logprobs`` (both or neither): one list of K per completion position, ids
    distinct, log-probabilities <= 0 and most likely first."""
    ids, lps = rec.get("top_ids"), rec.get("top_logprobs")
    if ids is None and lps is None:
        return None, None
    if not (isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps) == positions):
        raise RecordFileError(f"{where}: fields 'top_ids' and 'top_logprobs' need one list per completion token "
                              f"({positions})")
    k = len(ids[0]) if ids else 0
    for j, (row_ids, row_lps) in enumerate(zip(ids, lps)):
        token_ids(row_ids, where, f"top_ids[{j}]")
        if not (len(row_ids) == len(row_lps) == k and k > 0 and len(set(row_ids)) == k and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 for x in row_lps)
                and all(a >= b for a, b in zip(row_lps, row_lps[1:]))):
            raise RecordFileError(f"{where}: top_ids[{j}] / top_logprobs[{j}] must be {k} distinct ids with "
                                  "log-probabilities <= 0, most likely first")
    return [list(r) for r in ids], [[float(x) for x in r] for r in lps]


# -------------------------------------------------------------------------------------- evaluation points

@dataclass
class ValidationPoint:
    """A context and the target's next greedy tokens after it (``specdraft validation``)."""

    id: str
    category: str
    offset: int
    context_ids: list[int]
    target_ids: list[int]


def parse_point(obj: Mapping[str, Any], k: int, where: str = "point") -> ValidationPoint:
    if not isinstance(obj, Mapping):
        raise RecordFileError(f"{where}: expected a JSON object")
    for field in ("id", "context_ids", "target_ids"):
        if field not in obj:
            raise RecordFileError(f"{where}: missing field {field!r}")
    offset = obj.get("offset", 0)
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise RecordFileError(f"{where}: field 'offset' must be an integer >= 0, got {offset!r}")
    return ValidationPoint(id=str(obj["id"]), category=str(obj.get("category") or "all"), offset=offset,
                           context_ids=token_ids(obj["context_ids"], where, "context_ids", 1),
                           target_ids=token_ids(obj["target_ids"], where, "target_ids", k))


def load_validation(path: str | os.PathLike, k: int = 16, limit: int | None = None) -> list[ValidationPoint]:
    points: list[ValidationPoint] = []
    for where, obj in json_rows(path, "validation file"):
        points.append(parse_point(obj, k, where))
        if limit and len(points) >= limit:
            break
    if not points:
        raise RecordFileError(f"{path}: no evaluation points")
    return points
