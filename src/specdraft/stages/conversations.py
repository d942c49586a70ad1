"""`specdraft conversations`: training rows whose context carries the target's own earlier answer.

Users send conversations and passages: a second turn asks about the first answer (shorten it, translate it, go
on), a prompt carries a text to summarise or answer from. There the target's answer repeats its context, and a draft
trained only on single-turn traces has never seen that. This stage makes such rows from a finished traces run over a
prompts file (the *first turns*: the target's greedy answers):

followup  the conversation [user: the prompt, assistant: the target's first answer (its text, as a chat client
          sends it back), user: a follow-up], in the target's chat template with the generation prompt, and the
          target's greedy answer to it. The follow-up is the chat's own second user turn where the prompts file
          carries one (``followup``: ShareGPT's, read by the prompts stage; its assistant turns are never used,
          the target's answer stands in their place), else one of the packaged follow-ups
          (``data.followups``), picked by a seeded hash of the row's id.
passage   one user turn: a packaged request (summarise, translate, answer from the text, ...) wrapped around the
          text of a first answer, and the target's greedy answer to it.

Which first turns get a row is seeded: for follow-ups, the ones with a second user turn of their own first. A row
whose text (every turn, the first answer and passage included) shares a word n-gram with the evaluation sets -- the
packaged held-out set always, and ``--eval-set`` files (MT-bench, every turn) -- is never made, the check the prompts
stage runs (``data.text.ngram_overlap``); so is one whose context exceeds ``--max-context-tokens``.

Output: traces rows (``id``, ``source``, ``prompt_ids``, ``completion_ids``, ``finish_reason``, and ``kind``,
``first_turn``, ``request`` saying what made it), so `specdraft train` reads the file as it reads traces; with
``--keep-first-turns`` (the default) the first-turn rows are copied in first, so the file alone is the training set.
Beside it ``X.summary.json`` (the inputs' sha256, the plan's, counts, the rows dropped and why, the run record) and
``X.log``. Resumable as the traces stage is: rows are appended and flushed as they finish, a torn last line is cut,
ids already present are skipped, and a rerun whose plan or target differs is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections import Counter
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from specdraft.core.config import StageConfig
from specdraft.core.io import RecordFileError, atomic_write_json, jsonl_line, read_json, read_jsonl, sha256_file
from specdraft.core.provenance import run_metadata
from specdraft.core.records import PromptRecord, read_prompts
from specdraft.core.stage import (
    TRACE_FIELDS,
    StageResult,
    checked_rows,
    peak_rss_mb,
    resume_key,
    resume_rows,
    run_logged,
    side_paths,
    write_running_summary,
)
from specdraft.data.corpus import heldout_path
from specdraft.data.followups import load_requests, pick
from specdraft.data.readers import read_eval_prompts
from specdraft.data.text import ngram_overlap
from specdraft.model.chat import encode_conversation, encode_prompts, has_chat_template
from specdraft.model.device import DEVICE_HELP
from specdraft.model.generation import Generation
from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_tokenizer, tokenizer_fingerprint
from specdraft.model.trace_backend import HFBackend, TraceBackend, append_generations

log = logging.getLogger(__name__)

MAX_REPORTED = 50  # contamination examples kept in the summary


class ConversationsConfig(StageConfig):
    """Rows whose context holds the target's own first answer: a follow-up turn after it, or it as a passage."""

    target: str = Field(DEFAULT_TARGET, description="target model spec (the one that wrote --first-turns)")
    prompts: Path = Field(description="the prompts.jsonl the first turns were decoded from (id, source, prompt, "
                                      "and a chat's own second user turn as 'followup')")
    first_turns: Path = Field(description="a finished `specdraft traces` run over --prompts (its X.summary.json "
                                          "beside it): the target's first answers")
    out: Path = Field(description="output traces-format JSONL; X.summary.json and X.log go beside it")
    followups: int = Field(0, ge=0, description="conversation rows: a first turn, the target's answer, a follow-up "
                                                "(the chat's own second user turn first, else a packaged one)")
    passages: int = Field(0, ge=0, description="passage rows: a packaged request (summarise, translate, answer from "
                                               "the text) around the text of a first answer")
    keep_first_turns: bool = Field(True, description="copy the first-turn rows into --out first, so that the file "
                                                     "alone is what `specdraft train --traces` reads")
    max_new_tokens: int = Field(256, ge=1, description="tokens the target writes per row at most (stop at EOS)")
    max_context_tokens: int = Field(1024, ge=1, description="rows whose templated context is longer are not made")
    min_passage_words: int = Field(12, ge=1, description="a first answer needs at least this many words to be a "
                                                         "passage")
    seed: int = Field(0, description="which first turns get a row, and which packaged request each gets")
    eval_set: list[str] = Field(default=[], description="evaluation file (repeatable; every turn is read): rows "
                                                        "sharing a word n-gram with it are not made; the packaged "
                                                        "held-out set is always checked")
    contamination_ngram: int = Field(13, ge=1, description="n of the word n-gram contamination check")
    batch_size: int = Field(32, ge=1, description="rows decoded together (finished rows are replaced by waiting "
                                                  "ones)")
    device: str = Field("auto", description=DEVICE_HELP)

    @model_validator(mode="after")
    def _some_rows(self) -> "ConversationsConfig":
        if not self.followups and not self.passages:
            raise ValueError("followups, passages: ask for at least one row of either kind")
        return self


@dataclass(frozen=True)
class PlannedRow:
    """A row to decode: what made it, its turns as text (the contamination check reads them) and its context."""

    id: str
    source: str
    kind: str  # "followup" | "passage"
    first_turn: str  # the first-turn row whose answer it holds
    request: str  # "conversation" (the chat's own second turn) or the packaged request's name
    messages: tuple[tuple[str, str], ...]  # (role, content)
    prompt_ids: tuple[int, ...] = ()

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "kind": self.kind, "first_turn": self.first_turn,
                "request": self.request}


def run_conversations(cfg: ConversationsConfig, backend: TraceBackend | None = None) -> StageResult:
    """``backend`` (optional) replaces the hf backend built from the config; its caller closes it."""
    return run_logged(cfg.out, lambda out, summary_path, log_path: _run(cfg, out, summary_path, log_path, backend))


def _run(cfg: ConversationsConfig, out: Path, summary_path: Path, log_path: Path,
         given: TraceBackend | None) -> StageResult:
    started = time.time()
    target = describe_source(cfg.target)
    first_summary = _check_first_turns(cfg, target)
    tokenizer = load_tokenizer(cfg.target)
    if not has_chat_template(tokenizer):
        raise ValueError(f"target {cfg.target}: a conversation needs a chat template, and its tokenizer has none")
    prompts = {r.id: r for r in read_prompts(cfg.prompts)}
    first_rows = [row for _, row in checked_rows(cfg.first_turns, TRACE_FIELDS)]
    eval_files = [str(heldout_path()), *cfg.eval_set]
    eval_texts = [text for path in eval_files for text in read_eval_prompts(path)]
    plan, dropped, examples = make_plan(cfg, tokenizer, prompts, first_rows, eval_texts)

    plan_sha = hashlib.sha256(json.dumps([[r.id, list(r.prompt_ids)] for r in plan]).encode()).hexdigest()
    key = resume_key(target, cfg, True, {"tokenizer": tokenizer_fingerprint(tokenizer), "plan_sha256": plan_sha,
                                         "keep_first_turns": cfg.keep_first_turns})
    done = resume_rows(out, summary_path, key)
    clash = {r.id for r in plan} & {row["id"] for row in first_rows}
    if clash:
        raise RecordFileError(f"{cfg.first_turns}: row id(s) {sorted(clash)[:3]} clash with this stage's ids")
    base = {"stage": "conversations", "target": target,
            "prompts": {"path": str(cfg.prompts), "sha256": sha256_file(cfg.prompts)},
            "first_turns": {"path": str(cfg.first_turns), "sha256": sha256_file(cfg.first_turns),
                            "summary_sha256": sha256_file(side_paths(cfg.first_turns)[0]),
                            "max_new_tokens": (first_summary.get("config") or {}).get("max_new_tokens")},
            "eval_sets": [{"path": p, "sha256": sha256_file(p)} for p in eval_files],
            "chat_template": True, "config": cfg.to_json_dict(), "resume_key": key, "plan_sha256": plan_sha,
            "planned": dict(Counter(r.kind for r in plan)), "not_made": dropped, "contamination_examples": examples}
    earlier_runs = write_running_summary(summary_path, base, len(done))

    copied = _copy_first_turns(out, first_rows, done) if cfg.keep_first_turns else 0
    todo = [r for r in plan if r.id not in done]
    log.info("conversations: %d rows planned (%s), %d already in %s, %d to decode; %d first-turn rows copied",
             len(plan), dict(Counter(r.kind for r in plan)), len(plan) - len(todo), out, len(todo), copied)
    this_run: dict[str, Any] = {"prompts": 0}
    if todo:
        this_run = _decode(cfg, out, todo, given)
    rows = list(read_jsonl(out))
    kinds = Counter(obj.get("kind", "first_turn") for _, obj in rows)
    summary = {**base, "status": "complete", "rows": len(rows), "kinds": dict(kinds),
               "prompt_tokens": sum(len(obj["prompt_ids"]) for _, obj in rows),
               "completion_tokens": sum(len(obj["completion_ids"]) for _, obj in rows),
               "first_turns_copied": copied, "this_run": {**this_run, "peak_rss_mb": peak_rss_mb()},
               "runs": earlier_runs + [this_run], "wall_s": round(time.time() - started, 3), "run": run_metadata(),
               "log": str(log_path), "traces_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s (%d rows: %s) and %s", out, len(rows), dict(kinds), summary_path)
    return StageResult(out=out, summary=summary_path, rows=len(rows), new_prompts=this_run["prompts"],
                       summary_data=summary)


def _check_first_turns(cfg: ConversationsConfig, target: dict[str, Any]) -> dict[str, Any]:
    """The first turns' summary, refused unless a finished traces run of this target over --prompts wrote them."""
    path = side_paths(cfg.first_turns)[0]
    if not cfg.first_turns.is_file() or not path.is_file():
        raise RecordFileError(f"{cfg.first_turns}: first turns need a traces file and its {path.name} beside it")
    summary = read_json(path)
    if summary.get("stage") not in ("traces", "merge-traces") or summary.get("status") != "complete":
        raise RecordFileError(f"{path}: not a finished traces run (stage {summary.get('stage')!r}, status "
                              f"{summary.get('status')!r})")
    if summary.get("traces_sha256") != sha256_file(cfg.first_turns):
        raise RecordFileError(f"{cfg.first_turns}: changed since its run finished (sha256 differs from "
                              f"{path.name}'s traces_sha256)")
    if (summary.get("prompts") or {}).get("sha256") != sha256_file(cfg.prompts):
        raise RecordFileError(f"{cfg.first_turns}: decoded from another prompts file than {cfg.prompts} (sha256 "
                              "differs from its summary's prompts.sha256)")
    theirs = summary.get("target") or {}
    if theirs.get("weights_sha256") != target.get("weights_sha256"):
        raise RecordFileError(f"{path}: written by target {theirs.get('spec')!r}, not {cfg.target!r} (weights "
                              "sha256 differ)")
    return summary


def make_plan(cfg: ConversationsConfig, tokenizer, prompts: dict[str, PromptRecord], first_rows: list[dict],
              eval_texts: list[str]) -> tuple[list[PlannedRow], dict[str, int], list[dict[str, Any]]]:
    """The rows to decode, in a seeded order that does not depend on the first turns' file order; the rows not
    made and why (``contaminated``, ``too_long``, ``short_passage``, ``empty_answer``); contamination examples."""
    followups, passages = load_requests()
    dropped: Counter = Counter()
    answered = []
    for row in sorted(first_rows, key=lambda r: r["id"]):
        if row["id"] not in prompts:
            raise RecordFileError(f"{cfg.first_turns}: row {row['id']!r} is not a prompt of {cfg.prompts}")
        answer = tokenizer.decode(row["completion_ids"], skip_special_tokens=True).strip()
        if answer:
            answered.append((prompts[row["id"]], answer))
        else:
            dropped["empty_answer"] += 1

    # own second turns first, each group in a seeded order
    order = random.Random(f"{cfg.seed}/followups").sample(answered, len(answered))
    order.sort(key=lambda pair: pair[0].followup is None)
    followup_rows = []
    for p, answer in order:
        # the chat's own second turn where it has one; else a packaged follow-up
        request = ("conversation", p.followup) if p.followup else astuple(pick(followups, cfg.seed, p.id))
        followup_rows.append(PlannedRow(f"{p.id}/followup", p.source, "followup", p.id, request[0],
                                        (("user", p.text), ("assistant", answer), ("user", request[1]))))
    long_enough = [(p, a) for p, a in answered if len(a.split()) >= cfg.min_passage_words]
    if cfg.passages:  # counted only where passages are asked for
        dropped["short_passage"] += len(answered) - len(long_enough)
    passage_rows = []
    for p, answer in random.Random(f"{cfg.seed}/passages").sample(long_enough, len(long_enough)):
        req = pick(passages, cfg.seed, f"{p.id}/passage")
        passage_rows.append(PlannedRow(f"{p.id}/passage", p.source, "passage", p.id, req.name,
                                       (("user", req.with_passage(answer)),)))

    examples: list[dict[str, Any]] = []
    plan: list[PlannedRow] = []
    for candidates, wanted in ((followup_rows, cfg.followups), (passage_rows, cfg.passages)):
        offending = _contaminated(candidates, eval_texts, cfg.contamination_ngram)
        kept = 0
        for i, r in enumerate(candidates):
            if kept == wanted:
                break
            if i in offending:
                dropped["contaminated"] += 1
                if len(examples) < MAX_REPORTED:
                    examples.append({"id": r.id, "ngram": offending[i]})
                continue
            ids = _encode(tokenizer, r)
            if len(ids) > cfg.max_context_tokens:
                dropped["too_long"] += 1
                continue
            plan.append(replace(r, prompt_ids=tuple(ids)))
            kept += 1
        if kept < wanted:
            log.warning("%d %s rows asked for, %d could be made (%s)", wanted, candidates[0].kind if candidates
                        else "", kept, dict(dropped))
    return plan, dict(dropped), examples


def _contaminated(rows: list[PlannedRow], eval_texts: list[str], n: int) -> dict[int, str]:
    """Which rows share a word n-gram with the evaluation sets, and the n-gram: the whole row's text, and each turn
    on its own as the prompts stage checks a prompt (an evaluation turn shorter than n words matches a turn that is
    exactly it)."""
    owners, texts = [], []
    for i, row in enumerate(rows):
        for text in ("\n".join(t for _, t in row.messages), *(t for _, t in row.messages)):
            owners.append(i)
            texts.append(text)
    found: dict[int, str] = {}
    for k, gram in ngram_overlap(texts, eval_texts, n):
        found.setdefault(owners[k], gram)
    return found


def _encode(tokenizer, row: PlannedRow) -> list[int]:
    if len(row.messages) == 1:
        return encode_prompts(tokenizer, [row.messages[0][1]])[0]
    return encode_conversation(tokenizer, [{"role": role, "content": text} for role, text in row.messages])


def _copy_first_turns(out: Path, first_rows: list[dict], done: set[str]) -> int:
    """Append the first-turn rows not in ``out`` yet, as they are; how many."""
    todo = [row for row in first_rows if row["id"] not in done]
    if todo:
        with open(out, "a", encoding="utf-8") as f:
            f.write("".join(jsonl_line(row) + "\n" for row in todo))
            f.flush()
            os.fsync(f.fileno())
    return len(todo)


def _decode(cfg: ConversationsConfig, out: Path, todo: list[PlannedRow], given: TraceBackend | None) -> dict[str, Any]:
    """Decode ``todo``, appending each row to ``out`` and flushing it as it finishes; this run's record."""
    ids = [list(r.prompt_ids) for r in todo]

    def row(i: int, gen: Generation) -> dict[str, Any]:
        return {**todo[i].record(), "prompt_ids": ids[i], "completion_ids": gen.tokens,
                "finish_reason": gen.finish_reason}

    backend = given or HFBackend(cfg.target, cfg.device, cfg.batch_size)
    try:
        return append_generations(backend, out, ids, cfg.max_new_tokens, row, "conversations")
    finally:
        if given is None:
            backend.close()
