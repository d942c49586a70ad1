"""Evaluation points on both turns of MT-bench: where a draft meets a conversation's later turns.

Turn 1 is what `specdraft validation` measures: the templated question plus the target's greedy answer up to each
offset, the label the target's next 16 greedy tokens. Here the answers are the target's whole greedy first answers
(a `specdraft traces` file over the questions, resumable, with its summary: decoded once, never again on a rerun),
and turn 1's points are read off them. Turn 2's context is the conversation as a chat server renders it -- the
question, the target's own first answer, the follow-up -- in the target's chat template, the generation prompt
added; its points are its greedy continuation at offsets 0, 16, 32, ..., the same way.

``write_mt_bench_points`` writes ``validation.jsonl`` (the format `specdraft eval` reads; category
``turn1/<category>`` or ``turn2/<category>``) and ``validation.summary.json`` beside it (the inputs' sha256, the
target, the settings, the run record). A rerun whose inputs and settings match the summary's leaves both as they
are and decodes nothing. No point is ever trained on: the questions are the demo's evaluation set, which the prompts
stage decontaminates its training prompts against, both turns.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from specdraft.core.io import RecordFileError, atomic_file, atomic_write_json, jsonl_line, read_json, sha256_file
from specdraft.core.provenance import run_metadata
from specdraft.core.records import json_rows, token_ids
from specdraft.core.stage import summary_path
from specdraft.data.mt_bench import MTBenchQuestion
from specdraft.model.chat import encode_conversation
from specdraft.model.specs import describe_source, load_tokenizer, tokenizer_fingerprint
from specdraft.model.trace_backend import TraceBackend

log = logging.getLogger(__name__)

TURNS = (1, 2)


def turn_category(turn: int, category: str) -> str:
    """A point's category: its question's, with the turn it is in (turn 2's contexts hold turn 1 whole)."""
    return f"turn{turn}/{category}"


def point_id(question_id: str, turn: int) -> str:
    return f"{question_id}-turn{turn}"


def continuation_points(pid: str, category: str, context: Sequence[int], continuation: Sequence[int],
                        num_draft: int, max_tokens: int) -> list[dict[str, Any]]:
    """The points of one prompt, as `specdraft validation` makes them: offsets 0, n, 2n, ... into the first
    ``max_tokens`` tokens of the target's greedy ``continuation`` while n remain."""
    cont = list(continuation[:max_tokens])
    return [{"id": pid, "category": category, "offset": o, "context_ids": list(context) + cont[:o],
             "target_ids": cont[o:o + num_draft]} for o in range(0, len(cont) - num_draft + 1, num_draft)]


def second_turn_context(tokenizer, question: MTBenchQuestion, answer_ids: Sequence[int]) -> list[int]:
    """The token ids of the conversation the second question is asked in: the first question, the target's own
    first answer (its text, as a chat client would send it back), the second question, the generation prompt."""
    answer = tokenizer.decode(list(answer_ids), skip_special_tokens=True)
    return encode_conversation(tokenizer, [{"role": "user", "content": question.turns[0]},
                                           {"role": "assistant", "content": answer},
                                           {"role": "user", "content": question.turns[1]}])


def read_answers(path: Path) -> dict[str, dict[str, Any]]:
    """The first answers (a traces file: ``id``, ``prompt_ids``, ``completion_ids``), by question id."""
    answers: dict[str, dict[str, Any]] = {}
    for where, obj in json_rows(path, "answers file"):
        if not isinstance(obj, dict) or "id" not in obj:
            raise RecordFileError(f"{where}: expected a traces row with an 'id'")
        answers[str(obj["id"])] = {"prompt_ids": token_ids(obj.get("prompt_ids"), where, "prompt_ids", 1),
                                   "completion_ids": token_ids(obj.get("completion_ids"), where, "completion_ids")}
    return answers


def write_mt_bench_points(out: Path, questions: Sequence[MTBenchQuestion], questions_path: Path, answers_path: Path,
                          target: str, backend: Callable[[], TraceBackend], num_draft: int,
                          max_new_tokens: int) -> dict[str, Any]:
    """Both turns' points of ``questions`` (``questions_path``, the file the answers were decoded from) to ``out``,
    and their summary; turn 2 decoded by the backend ``backend()`` builds (only when the points are not there
    already, and closed after). Returns the summary."""
    out = Path(out)
    tokenizer = load_tokenizer(target)
    key = {"questions_sha256": sha256_file(questions_path), "answers_sha256": sha256_file(answers_path),
           "target": describe_source(target), "tokenizer": tokenizer_fingerprint(tokenizer), "num_draft": num_draft,
           "max_new_tokens": max_new_tokens}
    summary_file = summary_path(out)
    if out.is_file() and summary_file.is_file():
        previous = read_json(summary_file)
        if previous.get("key") == key and previous.get("validation_sha256") == sha256_file(out):
            log.info("%s: the points of these answers and settings are there already", out)
            return previous
    answers = read_answers(answers_path)
    missing = [q.id for q in questions if q.id not in answers]
    if missing:
        raise RecordFileError(f"{answers_path}: no first answer for question(s) {', '.join(missing[:5])}")
    rows = {1: {q.id: continuation_points(point_id(q.id, 1), turn_category(1, q.category),
                                          answers[q.id]["prompt_ids"], answers[q.id]["completion_ids"], num_draft,
                                          max_new_tokens) for q in questions}}
    contexts = [second_turn_context(tokenizer, q, answers[q.id]["completion_ids"]) for q in questions]
    rows[2] = {}
    with backend() as engine:
        for i, gen in engine.generate(contexts, max_new_tokens):
            q = questions[i]
            rows[2][q.id] = continuation_points(point_id(q.id, 2), turn_category(2, q.category), contexts[i],
                                                gen.tokens, num_draft, max_new_tokens)
        engine_info = engine.info()
    points = [row for turn in TURNS for q in questions for row in rows[turn][q.id]]
    with atomic_file(out) as tmp:
        tmp.write_text("".join(jsonl_line(row) + "\n" for row in points), encoding="utf-8")
    categories = Counter(row["category"] for row in points)
    summary = {
        "stage": "mt_bench_points", "key": key, "questions": str(questions_path), "answers": str(answers_path),
        "answers_summary_sha256": (sha256_file(summary_path(answers_path))
                                   if summary_path(answers_path).is_file() else None),
        "points": len(points), "prompts": len({row["id"] for row in points}),
        "prompts_without_points": sorted(point_id(q.id, t) for t in TURNS for q in questions if not rows[t][q.id]),
        "categories": {c: {"turn": t, "category": q.category, "points": categories[turn_category(t, q.category)]}
                       for t in TURNS for q in questions if (c := turn_category(t, q.category)) in categories},
        "turn2_context_tokens": {"min": min(map(len, contexts)), "max": max(map(len, contexts))},
        "backend": engine_info, "run": run_metadata(), "validation_sha256": sha256_file(out)}
    atomic_write_json(summary_file, summary)
    log.info("wrote %s: %d points from %d prompts (both turns of %d questions)", out, len(points),
             summary["prompts"], len(questions))
    return summary
