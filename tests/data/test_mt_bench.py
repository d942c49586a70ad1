"""The MT-bench reader keeps both turns, strictly, and selects questions round-robin over the categories."""

import json

import pytest

from specdraft.core.io import RecordFileError
from specdraft.data.mt_bench import MTBenchQuestion, interleave_categories, read_mt_bench


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_both_turns_read_and_categories_interleaved(tmp_path):
    rows = [{"question_id": 81 + i, "category": cat, "turns": [f"first {i}", f"second {i}"]}
            for i, cat in enumerate(["writing", "writing", "writing", "math", "math", "coding"])]
    questions = read_mt_bench(_write(tmp_path / "q.jsonl", rows))
    assert questions[0] == MTBenchQuestion("81", "writing", ("first 0", "second 0"))
    assert questions[0].to_json() == {"question_id": "81", "category": "writing", "turns": ["first 0", "second 0"]}
    assert [q.id for q in interleave_categories(questions)] == ["81", "84", "86", "82", "85", "83"]
    assert [q.category for q in interleave_categories(questions, 3)] == ["writing", "math", "coding"]


@pytest.mark.parametrize("row, message", [
    ({"category": "x", "turns": ["a", "b"]}, "question_id"),
    ({"question_id": 1, "category": "x", "turns": ["a"]}, "two non-empty strings"),
    ({"question_id": 1, "category": "x", "turns": ["a", " "]}, "two non-empty strings"),
    ({"question_id": 1, "category": 3, "turns": ["a", "b"]}, "category"),
])
def test_a_bad_question_is_named_by_file_and_line(tmp_path, row, message):
    good = {"question_id": 0, "category": "x", "turns": ["a", "b"]}
    with pytest.raises(RecordFileError, match=rf"q.jsonl:2: .*{message}"):
        read_mt_bench(_write(tmp_path / "q.jsonl", [good, row]))
    with pytest.raises(RecordFileError, match="duplicate question_id"):
        read_mt_bench(_write(tmp_path / "q.jsonl", [good, good]))
