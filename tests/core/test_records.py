"""specdraft.core.records: the readers of prompts, answers, traces and evaluation points (the error paths of
read_prompts / read_answers / read_traces / load_validation that the stage tests cover are not repeated)."""

import json

import pytest

from specdraft.core.io import RecordFileError
from specdraft.core.records import (
    Example,
    PromptRecord,
    ValidationPoint,
    json_rows,
    load_validation,
    parse_point,
    prompt_record,
    read_answers,
    read_prompts,
    read_traces,
    token_ids,
)


def _jsonl(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------- json_rows

def test_json_rows_gives_path_and_line_of_each_row(tmp_path):
    p = _jsonl(tmp_path / "r.jsonl", {"a": 1}, "", "  ", [2])
    assert list(json_rows(p)) == [(f"{p}:1", {"a": 1}), (f"{p}:4", [2])]
    assert list(json_rows(str(p))) == list(json_rows(p))


def test_json_rows_names_a_missing_file_and_a_bad_line(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RecordFileError) as e:
        list(json_rows(missing, "prompts file"))
    assert str(e.value) == f"prompts file {missing}: no such file"
    with pytest.raises(RecordFileError, match="^file "):
        list(json_rows(tmp_path))  # a folder is not a file either
    p = _jsonl(tmp_path / "r.jsonl", {"a": 1}, '{"a": ')
    with pytest.raises(RecordFileError) as e:
        list(json_rows(p))
    assert str(e.value) == f"{p}:2: not valid JSON (Expecting value)"


# ---------------------------------------------------------------------------------------------- token_ids

def test_token_ids_accepts_lists_of_non_negative_ints():
    assert token_ids([0, 5, 7], "f:1", "ids") == [0, 5, 7]
    assert token_ids([], "f:1", "ids") == []
    assert token_ids([1, 2], "f:1", "ids", min_len=2, vocab=3) == [1, 2]


@pytest.mark.parametrize("value, kwargs, says", [
    ("12", {}, "field 'ids' must be a list of token ids (integers), got str"),
    (None, {}, "field 'ids' must be a list of token ids (integers), got NoneType"),
    ([1, True], {}, "field 'ids' must be a list of token ids (integers), got list"),  # true is not token 1
    ([1, 2.0], {}, "field 'ids' must be a list of token ids (integers), got list"),
    ([1], {"min_len": 2}, "field 'ids' has 1 ids, need at least 2"),
    ([1, -1], {}, "field 'ids' holds a negative token id"),
    ([1, 10], {"vocab": 10}, "field 'ids' must be a non-empty list of token ids (integers in 0..9, the target"),
    ([], {"vocab": 10}, "field 'ids' must be a non-empty list of token ids (integers in 0..9"),
    ([-1], {"vocab": 10}, "field 'ids' must be a non-empty list of token ids"),
    ([False], {"vocab": 10}, "field 'ids' must be a non-empty list of token ids"),
    ([1, 2], {"vocab": 10, "min_len": 3}, "field 'ids' must be a non-empty list of token ids"),
])
def test_token_ids_refusals_name_the_place_and_field(value, kwargs, says):
    with pytest.raises(RecordFileError) as e:
        token_ids(value, "f.jsonl:3", "ids", **kwargs)
    assert str(e.value).startswith(f"f.jsonl:3: {says}")


# ------------------------------------------------------------------------------------------------ prompts

def test_prompt_record_formats():
    assert prompt_record({"id": "a", "source": "code", "prompt": "hi"}, "f:1") == PromptRecord(
        id="a", source="code", category="code", text="hi")
    assert prompt_record({"id": 3, "category": "math", "prompt": "hi"}, "f:1") == PromptRecord(
        id="3", source="math", category="math", text="hi")
    assert prompt_record({"id": "a", "source": "s", "category": "c", "prompt": "hi"}, "f:1") == PromptRecord(
        id="a", source="s", category="c", text="hi")
    # MT-bench / Spec-Bench: the first turn; the id may be 'id'; the category is also the source
    assert prompt_record({"id": "q1", "turns": ["one", "two"]}, "f:1") == PromptRecord(
        id="q1", source="unknown", category="unknown", text="one")


@pytest.mark.parametrize("obj, says", [
    ([1], "expected a JSON object"),
    ({"question_id": 1, "turns": []}, "'turns' must be a list whose first item is a non-empty string"),
    ({"question_id": 1, "turns": ["  "]}, "'turns' must be a list whose first item"),
    ({"question_id": 1, "turns": "text"}, "'turns' must be a list"),
    ({"turns": ["hi"]}, "missing 'question_id'"),
    ({"prompt": "hi"}, "missing field 'id'"),
    ({"id": "a", "prompt": 5}, "'prompt' must be a non-empty string"),
    ({"id": [1], "prompt": "hi"}, "'id' must be a string"),
    ({"id": "a", "context_ids": [1, 2]}, "missing field 'prompt'"),  # token ids only where allowed
])
def test_prompt_record_refusals_name_the_line(obj, says):
    with pytest.raises(RecordFileError) as e:
        prompt_record(obj, "p.jsonl:7")
    assert str(e.value).startswith(f"p.jsonl:7: {says}")


def test_token_id_prompts_where_allowed_take_the_line_number_as_id():
    rec = prompt_record({"context_ids": [1, 2], "category": "code", "offset": 16}, "p.jsonl:4", True, vocab=5)
    assert rec == PromptRecord(id="4", source="code", category="code", ids=[1, 2], offset=16)
    rec = prompt_record({"id": "t", "prompt_ids": [3], "source": "chat"}, "p.jsonl:9", True)
    assert (rec.id, rec.source, rec.category, rec.ids, rec.text, rec.offset) == ("t", "chat", "chat", [3], None, None)
    assert prompt_record({"turns": ["hi"]}, "p.jsonl:2", True).id == "2"
    assert prompt_record({"prompt": "hi"}, "p.jsonl:5", True).id == "5"
    with pytest.raises(RecordFileError, match=r"^p.jsonl:4: field 'context_ids' must be a non-empty list .*0\.\.4"):
        prompt_record({"context_ids": [1, 5]}, "p.jsonl:4", True, vocab=5)
    with pytest.raises(RecordFileError, match=r"^p.jsonl:4: no prompt: expected 'prompt' \(str\)"):
        prompt_record({"id": "a", "text": "hi"}, "p.jsonl:4", True)


def test_read_prompts_names_the_first_line_of_a_duplicate_id(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl", {"id": "x", "prompt": "a"}, "", {"id": 7, "prompt": "b"},
               {"id": "7", "prompt": "c"})
    with pytest.raises(RecordFileError) as e:
        read_prompts(p)
    assert str(e.value) == f"{p}:4: duplicate id '7' (first on line 3)"  # int 7 and "7" are the same id


def test_read_prompts_with_token_ids_keeps_the_first_point_of_each_prompt(tmp_path):
    p = _jsonl(tmp_path / "v.jsonl",
               {"id": "a", "category": "code", "offset": 0, "context_ids": [1, 2], "target_ids": [3]},
               {"id": "a", "category": "code", "offset": 16, "context_ids": [1, 2, 3], "target_ids": [4]},
               {"id": "b", "category": "chat", "offset": 0, "context_ids": [5], "target_ids": [6]},
               {"prompt": "plain text"})
    recs = read_prompts(p, token_ids_allowed=True, vocab=10)
    assert [(r.id, r.category, r.ids, r.offset, r.text) for r in recs] == [
        ("a", "code", [1, 2], 0, None), ("b", "chat", [5], 0, None), ("4", "unknown", None, None, "plain text")]


def test_read_prompts_refuses_a_file_without_prompts(tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n \n")
    with pytest.raises(RecordFileError) as e:
        read_prompts(p)
    assert str(e.value) == f"prompts file {p}: no prompts"


def test_read_answers_keeps_rows_with_a_response_and_counts_all(tmp_path):
    p = _jsonl(tmp_path / "p.jsonl",
               {"id": "a", "prompt": "x", "response": "r1"}, {"id": "b", "prompt": "y"},
               {"id": "c", "prompt": "z", "response": "  "}, {"id": 4, "prompt": "w", "response": "r4"},
               {"id": "e", "prompt": "v", "response": 5})
    rows, total = read_answers(p)
    assert total == 5 and [r["id"] for r in rows] == ["a", 4]
    rows, total = read_answers(p, limit=1)
    assert total == 5 and rows == [{"id": "a", "prompt": "x", "response": "r1"}]


# ------------------------------------------------------------------------------------- traces and labels

def test_read_traces_cuts_the_completion_first_then_the_prompt_from_the_left(tmp_path):
    p = _jsonl(tmp_path / "t.jsonl",
               {"id": "short", "prompt_ids": [1, 2], "completion_ids": [3, 4]},
               {"id": "long_prompt", "prompt_ids": list(range(10, 20)), "completion_ids": [5, 6]},
               {"id": "long_completion", "prompt_ids": [1, 2], "completion_ids": list(range(30, 40)),
                "target_ids": list(range(50, 60))},
               {"id": "empty", "prompt_ids": [1], "completion_ids": []},
               {"id": 9, "prompt_ids": [], "completion_ids": [7], "target_ids": None})
    ex = read_traces(p, max_seq_len=6)
    assert [e.id for e in ex] == ["short", "long_prompt", "long_completion", "9"]  # no completion: skipped
    assert (ex[0].input_ids, ex[0].prompt_len, ex[0].targets, ex[0].completion) == ([1, 2, 3, 4], 2, None, [3, 4])
    assert (ex[1].input_ids, ex[1].prompt_len) == ([16, 17, 18, 19, 5, 6], 4)
    assert (ex[2].input_ids, ex[2].prompt_len) == ([2, 30, 31, 32, 33, 34], 1)
    assert ex[2].targets == [50, 51, 52, 53, 54] and ex[2].completion == [30, 31, 32, 33, 34]
    assert (ex[3].input_ids, ex[3].prompt_len) == ([7], 0)
    assert all(len(e.input_ids) <= 6 for e in ex)


def test_read_traces_refuses_a_file_without_usable_traces(tmp_path):
    p = _jsonl(tmp_path / "t.jsonl", {"id": "a", "prompt_ids": [1], "completion_ids": []})
    with pytest.raises(RecordFileError) as e:
        read_traces(p, 64)
    assert str(e.value) == f"{p}: no usable traces"


def test_example_completion_is_the_part_after_the_prompt():
    assert Example("x", [1, 2, 3, 4], 1).completion == [2, 3, 4]
    assert Example("x", [1, 2], 2, targets=[]).completion == []


# -------------------------------------------------------------------------------------- evaluation points

def test_parse_point_defaults():
    point = parse_point({"id": 3, "context_ids": [1], "target_ids": [2, 3]}, k=2)
    assert point == ValidationPoint(id="3", category="all", offset=0, context_ids=[1], target_ids=[2, 3])
    assert parse_point({"id": "a", "category": "", "context_ids": [1], "target_ids": []}, k=0).category == "all"
    assert parse_point({"id": "a", "category": "code", "offset": 8, "context_ids": [1], "target_ids": [2]},
                       k=1).offset == 8


def test_parse_point_refusals_name_where(tmp_path):
    with pytest.raises(RecordFileError, match="^point: expected a JSON object$"):
        parse_point([1], k=1)
    with pytest.raises(RecordFileError, match="^v.jsonl:2: missing field 'id'$"):
        parse_point({"context_ids": [1], "target_ids": [2]}, k=1, where="v.jsonl:2")
    with pytest.raises(RecordFileError, match=r"^point: field 'offset' must be an integer >= 0, got True$"):
        parse_point({"id": "a", "offset": True, "context_ids": [1], "target_ids": [2]}, k=1)


def test_load_validation_reads_points_in_order_and_refuses_an_empty_file(tmp_path):
    rows = [{"id": f"p{i}", "category": "c", "offset": 4 * i, "context_ids": [i + 1], "target_ids": [1, 2]}
            for i in range(3)]
    p = _jsonl(tmp_path / "v.jsonl", *rows)
    points = load_validation(p, k=2)
    assert [(pt.id, pt.offset, pt.context_ids) for pt in points] == [("p0", 0, [1]), ("p1", 4, [2]), ("p2", 8, [3])]
    assert [pt.id for pt in load_validation(p, k=2, limit=2)] == ["p0", "p1"]
    with pytest.raises(RecordFileError, match=r"v.jsonl:1: field 'target_ids' has 2 ids, need at least 3"):
        load_validation(p, k=3)
    p.write_text("\n")
    with pytest.raises(RecordFileError) as e:
        load_validation(p)
    assert str(e.value) == f"{p}: no evaluation points"
