"""MT-bench questions with both turns (``question_id``, ``category``, ``turns``: the user's first and second
message), the evaluation set of later turns: a second turn is asked after the target's own first answer.

The prompt readers (``core.records.read_prompts``) take the first turn only; this reader keeps both, strictly (a
question without two non-empty turns is an error naming the file and line), and selects questions round-robin over
the categories so that the first N cover every category (the file lists its categories in blocks of ten).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from specdraft.core.io import RecordFileError
from specdraft.core.records import json_rows


@dataclass(frozen=True)
class MTBenchQuestion:
    id: str
    category: str
    turns: tuple[str, str]

    def to_json(self) -> dict:
        """The question as an MT-bench line (what the prompt readers take: ``turns[0]`` the first turn)."""
        return {"question_id": self.id, "category": self.category, "turns": list(self.turns)}


def read_mt_bench(path: str | os.PathLike) -> list[MTBenchQuestion]:
    """Every question of an MT-bench file, in the file's order; ids unique, two non-empty turns each."""
    questions: list[MTBenchQuestion] = []
    seen: set[str] = set()
    for where, obj in json_rows(path, "MT-bench file"):
        if not isinstance(obj, dict):
            raise RecordFileError(f"{where}: expected a JSON object")
        qid, turns = obj.get("question_id", obj.get("id")), obj.get("turns")
        if qid is None or isinstance(qid, bool) or not isinstance(qid, (int, str)):
            raise RecordFileError(f"{where}: missing 'question_id' (an integer or a string)")
        if not (isinstance(turns, list) and len(turns) >= 2
                and all(isinstance(t, str) and t.strip() for t in turns[:2])):
            raise RecordFileError(f"{where}: 'turns' must hold two non-empty strings (the user's first and second "
                                  "message)")
        if str(qid) in seen:
            raise RecordFileError(f"{where}: duplicate question_id {qid!r}")
        seen.add(str(qid))
        category = obj.get("category", "unknown")
        if not isinstance(category, str) or not category:
            raise RecordFileError(f"{where}: 'category' must be a non-empty string")
        questions.append(MTBenchQuestion(str(qid), category, (turns[0], turns[1])))
    if not questions:
        raise RecordFileError(f"MT-bench file {Path(path)}: no questions")
    return questions


def interleave_categories(questions: list[MTBenchQuestion], limit: int | None = None) -> list[MTBenchQuestion]:
    """The first ``limit`` questions (all: None) taken round-robin over the categories (in order of first
    appearance), each category's in the file's order."""
    by_category: dict[str, list[MTBenchQuestion]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    out: list[MTBenchQuestion] = []
    for i in range(max(len(v) for v in by_category.values())):
        out += [v[i] for v in by_category.values() if i < len(v)]
    return out if limit is None else out[:limit]
