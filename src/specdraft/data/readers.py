"""Record sources (jsonl / json / parquet files, hub datasets) and readers (one record -> one prompt).

A *source* yields ``Record``s: the record's ordinal, a location for messages (``file:line``,
``file:row N``, ``hf://ORG/NAME@REV/SPLIT#i``) and the parsed record, or the reason it could not be parsed.
A *reader* turns a parsed record into a prompt string, returns None when the record holds no prompt (a chat
with no user turn), or raises ``MalformedRecord`` when the record does not have the reader's shape. Its
*response* reader returns the record's reference answer to that prompt (the first assistant turn after it,
alpaca `output`, GSM8K `answer`, ...) or None; a missing or odd response is never an error. A chat's *follow-up*
reader returns the user's next turn after that answer (what `specdraft conversations` asks after the target's own
first answer), or None. Responses are
not training targets themselves: `specdraft label` has the target label every position of them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import datasets
import pyarrow.parquet as pq

USER_ROLES = {"user", "human"}
ASSISTANT_ROLES = {"assistant", "gpt", "model", "chatgpt", "bot"}


class MalformedRecord(ValueError):
    """A record without the fields its reader needs (reported as file:line and counted, not fatal)."""


class DataSourceError(ValueError):
    """A source that cannot be read at all (missing file, not JSON at all, hub unreachable)."""


@dataclass
class Record:
    index: int
    location: str
    data: Any = None
    error: str | None = None  # set when the record could not be parsed


# ------------------------------------------------------------------------------------------------ readers

def _get(rec: Any, key: str, *, required: bool = True, kind: type | tuple = str) -> Any:
    if not isinstance(rec, dict):
        raise MalformedRecord(f"record is a {type(rec).__name__}, not an object")
    if key not in rec or rec[key] is None:
        if required:
            raise MalformedRecord(f"missing field {key!r}")
        return None
    value = rec[key]
    if not isinstance(value, kind):
        raise MalformedRecord(f"field {key!r} is a {type(value).__name__}, not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def _turns(rec: dict, f: dict[str, str]) -> list[tuple[str, Any]] | None:
    """(role, content) pairs from `messages` (role/content) or `conversations` (from/value); None if absent."""
    for list_key, role_key, text_key in ((f["messages"], f["role"], f["content"]),
                                         (f["conversations"], f["from"], f["value"])):
        if isinstance(rec, dict) and rec.get(list_key) is not None:
            turns = _get(rec, list_key, kind=list)
            out = []
            for i, turn in enumerate(turns):
                if not isinstance(turn, dict):
                    raise MalformedRecord(f"{list_key}[{i}] is a {type(turn).__name__}, not an object")
                # ShareGPT variants sometimes use role/content inside `conversations`, and vice versa.
                role = turn.get(role_key, turn.get(f["role"], turn.get(f["from"])))
                text = turn.get(text_key, turn.get(f["content"], turn.get(f["value"])))
                if not isinstance(role, str):
                    raise MalformedRecord(f"{list_key}[{i}] has no role ({role_key!r})")
                out.append((role, text))
            return out
    return None


def read_chat(rec: Any, f: dict[str, str]) -> str | None:
    """UltraChat / ShareGPT: the first user turn (leading system/assistant turns are skipped).

    Accepts `messages` [{role, content}], `conversations` [{from, value}] or a plain `prompt` string.
    """
    turns = _turns(rec, f)
    if turns is None:
        if isinstance(rec, dict) and f["prompt"] in rec:
            return _get(rec, f["prompt"])
        raise MalformedRecord(f"no {f['messages']!r}, {f['conversations']!r} or {f['prompt']!r} field")
    for role, text in turns:
        if role.lower() in USER_ROLES:
            if not isinstance(text, str):
                raise MalformedRecord(f"user turn content is a {type(text).__name__}, not str")
            return text
    return None


def read_oss_instruct(rec: Any, f: dict[str, str]) -> str | None:
    """Magicoder-OSS-Instruct: the `problem` field."""
    return _get(rec, f["problem"])


def read_alpaca(rec: Any, f: dict[str, str]) -> str | None:
    """Alpaca-style: `instruction`, followed by a blank line and `input` when that is not empty."""
    instruction = _get(rec, f["instruction"])
    extra = _get(rec, f["input"], required=False)
    return f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction


def read_question(rec: Any, f: dict[str, str]) -> str | None:
    """GSM8K-style: the `question` field."""
    return _get(rec, f["question"])


def read_turns(rec: Any, f: dict[str, str]) -> str | None:
    """MT-bench-style question sets: `turns[0]` (later turns depend on the model's first answer)."""
    turns = _get(rec, f["turns"], kind=list)
    if not turns:
        return None
    if not isinstance(turns[0], str):
        raise MalformedRecord(f"{f['turns']}[0] is a {type(turns[0]).__name__}, not str")
    return turns[0]


def read_field(rec: Any, f: dict[str, str]) -> str | None:
    """Any single text field, named by the mapping `{"text": "<field>"}`."""
    return _get(rec, f["text"])


# ------------------------------------------------------------------------------------- response readers

def _text_field(rec: Any, *keys: str) -> str | None:
    if not isinstance(rec, dict):
        return None
    for key in keys:
        value = rec.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def response_chat(rec: Any, f: dict[str, str]) -> str | None:
    """The first assistant turn after the first user turn."""
    try:
        turns = _turns(rec, f)
    except MalformedRecord:
        return None
    if turns is None:
        return _text_field(rec, f["response"])
    seen_user = False
    for role, text in turns:
        if role.lower() in USER_ROLES:
            if seen_user:  # the user spoke again before any answer
                return None
            seen_user = True
        elif seen_user and role.lower() in ASSISTANT_ROLES:
            return text if isinstance(text, str) and text.strip() else None
    return None


def followup_chat(rec: Any, f: dict[str, str]) -> str | None:
    """The user's next turn after the first answer (user, assistant, *user*): what a conversation asks once the first
    prompt has been answered. None without one (a single turn, or the user spoke twice before any answer)."""
    try:
        turns = _turns(rec, f)
    except MalformedRecord:
        return None
    if turns is None:
        return None
    roles = [(role.lower(), text) for role, text in turns]
    first_user = next((i for i, (role, _) in enumerate(roles) if role in USER_ROLES), None)
    if first_user is None or first_user + 2 >= len(roles):
        return None
    (answer_role, _), (next_role, text) = roles[first_user + 1], roles[first_user + 2]
    if answer_role not in ASSISTANT_ROLES or next_role not in USER_ROLES:
        return None
    return text if isinstance(text, str) and text.strip() else None


def response_alpaca(rec: Any, f: dict[str, str]) -> str | None:
    """Alpaca `output` (GPTeacher calls it `response`)."""
    return _text_field(rec, f["output"], f["response"])


def response_oss_instruct(rec: Any, f: dict[str, str]) -> str | None:
    return _text_field(rec, f["solution"])


def response_question(rec: Any, f: dict[str, str]) -> str | None:
    return _text_field(rec, f["answer"])


@dataclass(frozen=True)
class Reader:
    func: Callable[[Any, dict[str, str]], str | None]
    fields: dict[str, str]  # reader key -> default record key
    required_fields: tuple[str, ...] = ()  # keys the manifest must map (no default)
    response: Callable[[Any, dict[str, str]], str | None] | None = None
    followup: Callable[[Any, dict[str, str]], str | None] | None = None  # chats: the user's second turn

    def bind(self, mapping: dict[str, str]) -> Callable[[Any], str | None]:
        fields = {**self.fields, **mapping}
        return lambda rec: self.func(rec, fields)

    def bind_response(self, mapping: dict[str, str]) -> Callable[[Any], str | None]:
        fields = {**self.fields, **mapping}
        response = self.response
        return (lambda rec: None) if response is None else (lambda rec: response(rec, fields))

    def bind_followup(self, mapping: dict[str, str]) -> Callable[[Any], str | None]:
        fields = {**self.fields, **mapping}
        followup = self.followup
        return (lambda rec: None) if followup is None else (lambda rec: followup(rec, fields))


READERS: dict[str, Reader] = {
    "chat": Reader(read_chat, {"messages": "messages", "role": "role", "content": "content",
                               "conversations": "conversations", "from": "from", "value": "value",
                               "prompt": "prompt", "response": "response"}, response=response_chat,
                   followup=followup_chat),
    "oss_instruct": Reader(read_oss_instruct, {"problem": "problem", "solution": "solution"},
                           response=response_oss_instruct),
    "alpaca": Reader(read_alpaca, {"instruction": "instruction", "input": "input", "output": "output",
                                   "response": "response"}, response=response_alpaca),
    "question": Reader(read_question, {"question": "question", "answer": "answer"}, response=response_question),
    "turns": Reader(read_turns, {"turns": "turns"}),
    "field": Reader(read_field, {"text": ""}, required_fields=("text",)),
}


def get_reader(name: str, mapping: dict[str, str] | None = None) -> Callable[[Any], str | None]:
    """The bound reader; KeyError for an unknown name (manifest validation reports it per corpus)."""
    return READERS[name].bind(mapping or {})


def get_response_reader(name: str, mapping: dict[str, str] | None = None) -> Callable[[Any], str | None]:
    """The bound response reader (returns None for readers without one)."""
    return READERS[name].bind_response(mapping or {})


def get_followup_reader(name: str, mapping: dict[str, str] | None = None) -> Callable[[Any], str | None]:
    """The bound follow-up reader: a chat's second user turn (returns None for readers without one)."""
    return READERS[name].bind_followup(mapping or {})


# ------------------------------------------------------------------------------------------------ sources

def iter_file_records(path: str | os.PathLike, fmt: str) -> Iterator[Record]:
    """Records of a local file. Blank jsonl lines are skipped; a bad jsonl line is a Record with `error`."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"{path}: no such file")
    if fmt == "jsonl":
        yield from _iter_jsonl(path)
    elif fmt == "json":
        yield from _iter_json(path)
    elif fmt == "parquet":
        yield from _iter_parquet(path)
    else:
        raise DataSourceError(f"{path}: unknown format {fmt!r} (jsonl | json | parquet)")


def format_from_extension(path: str | os.PathLike) -> str:
    suffix = Path(path).suffix.lower()
    formats = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
    if suffix not in formats:
        raise DataSourceError(f"{path}: cannot tell the format from the extension {suffix!r} "
                              "(.jsonl | .json | .parquet)")
    return formats[suffix]


def _iter_jsonl(path: Path) -> Iterator[Record]:
    index = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Record(index, f"{path}:{lineno}", json.loads(line))
            except json.JSONDecodeError as e:
                yield Record(index, f"{path}:{lineno}", error=f"invalid JSON ({e.msg}, column {e.colno})")
            index += 1


def _iter_json(path: Path) -> Iterator[Record]:
    """A JSON array of records, decoded element by element so that each record keeps its line number."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos, n = _skip_ws(text, 0), len(text)
    if pos >= n or text[pos] != "[":
        # Not an array: maybe an object holding one (e.g. {"data": [...]}); accept a single list value.
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataSourceError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
        lists = [v for v in obj.values() if isinstance(v, list)] if isinstance(obj, dict) else []
        if len(lists) != 1:
            raise DataSourceError(f"{path}: expected a JSON array of records (or an object with one list)")
        for i, rec in enumerate(lists[0]):
            yield Record(i, f"{path}:record {i}", rec)
        return
    pos, line, last, index = _skip_ws(text, pos + 1), 1, 0, 0
    if pos < n and text[pos] == "]":
        return
    while True:
        line += text.count("\n", last, pos)
        last = pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataSourceError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e
        yield Record(index, f"{path}:{line}", obj)
        index += 1
        pos = _skip_ws(text, end)
        if pos < n and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < n and text[pos] == "]":
            return
        lineno = text.count("\n", 0, pos) + 1
        raise DataSourceError(f"{path}: not valid JSON (line {lineno}: expected ',' or ']')")


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_parquet(path: Path) -> Iterator[Record]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataSourceError(f"{path}: not a readable parquet file ({e})") from e
    index = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield Record(index, f"{path}:row {index}", row)
            index += 1


def load_hub_records(repo_id: str, revision: str, split: str, subset: str | None,
                     columns: list[str] | None = None) -> tuple[Iterator[Record], dict[str, Any]]:
    """Rows of a hub dataset at a pinned revision, via `datasets`; a clear DataSourceError when offline."""
    label = f"hf://{repo_id}@{revision}/{split}"
    try:
        ds = datasets.load_dataset(repo_id, subset, split=split, revision=revision)
    except Exception as e:
        raise DataSourceError(
            f"{label}: cannot load hub dataset ({e.__class__.__name__}: {str(e)[:300]}). This machine may be "
            "offline or the revision may not exist. Load it once on a connected machine into the "
            "Hugging Face cache (HF_HOME / HF_DATASETS_CACHE) and rerun with HF_HUB_OFFLINE=1, or use a "
            "manifest of local files (configs/manifest.shared.json)") from e
    if columns:
        keep = [c for c in columns if c in ds.column_names]
        if keep:
            ds = ds.select_columns(keep)
    meta = {"rows": len(ds), "fingerprint": getattr(ds, "_fingerprint", None),
            "download_checksums": _jsonable(getattr(ds.info, "download_checksums", None))}

    def rows() -> Iterator[Record]:
        for i, row in enumerate(ds):
            yield Record(i, f"{label}#{i}", row)

    return rows(), meta


def _jsonable(obj: Any) -> Any:
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return str(obj)


# ----------------------------------------------------------------------------------------------- eval sets

def eval_prompts_from_record(rec: Any) -> list[str]:
    """Every prompt an evaluation record holds: all `turns`, all user turns of a chat, or one field."""
    if not isinstance(rec, dict):
        raise MalformedRecord(f"record is a {type(rec).__name__}, not an object")
    if "turns" in rec:
        turns = _get(rec, "turns", kind=list)
        bad = [i for i, t in enumerate(turns) if not isinstance(t, str)]
        if bad:
            raise MalformedRecord(f"turns[{bad[0]}] is not a string")
        return list(turns)
    chat = _turns(rec, READERS["chat"].fields)
    if chat is not None:
        return [t for r, t in chat if r.lower() in USER_ROLES and isinstance(t, str)]
    for key, reader in (("prompt", "field"), ("instruction", "alpaca"), ("question", "question"),
                        ("problem", "oss_instruct"), ("text", "field")):
        if key in rec:
            mapping = {"text": key} if reader == "field" else {}
            return [get_reader(reader, mapping)(rec)]
    raise MalformedRecord("no turns, messages, conversations, prompt, instruction, question, problem "
                          "or text field")


def read_eval_prompts(path: str | os.PathLike) -> list[str]:
    """All prompts of an evaluation file (format by extension). Strict: a bad record is an error, since a
    prompt we cannot read is a prompt we cannot decontaminate against."""
    path = Path(path)
    if not path.is_file():
        raise DataSourceError(f"eval set {path}: no such file")
    prompts: list[str] = []
    for rec in iter_file_records(path, format_from_extension(path)):
        if rec.error:
            raise DataSourceError(f"eval set {rec.location}: {rec.error}")
        try:
            prompts.extend(eval_prompts_from_record(rec.data))
        except MalformedRecord as e:
            raise DataSourceError(f"eval set {rec.location}: {e}") from e
    if not prompts:
        raise DataSourceError(f"eval set {path}: no prompts found")
    return prompts
