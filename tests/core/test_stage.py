"""specdraft.core.stage: the shared opening of a resumable JSONL stage (side files, resume checks, the rows
already written) and its progress counts."""

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdraft.core import stage
from specdraft.core.config import StageConfig
from specdraft.core.io import RecordFileError, drop_last_group, jsonl_line, repair_jsonl


class _Cfg(StageConfig):
    max_new_tokens: int = 32


def _trace(rid, **over):
    return {"id": rid, "source": "s", "prompt_ids": [1, 2], "completion_ids": [3], "finish_reason": "stop", **over}


def _write_rows(path: Path, rows, mode="w"):
    with open(path, mode, encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else jsonl_line(r)) + "\n")
    return path


# ------------------------------------------------------------------------------------------- side files, keys

def test_side_paths_sit_beside_the_output():
    assert stage.side_paths(Path("/r/traces/traces.jsonl")) == (Path("/r/traces/traces.summary.json"),
                                                         Path("/r/traces/traces.log"))
    assert stage.side_paths(Path("shard.0.jsonl")) == (Path("shard.0.summary.json"), Path("shard.0.log"))
    assert stage.side_paths(Path("out")) == (Path("out.summary.json"), Path("out.log"))


def test_resume_key_holds_the_target_the_settings_and_the_extras():
    key = stage.resume_key({"weights_sha256": "w", "gguf_sha256": None, "spec": "x"}, _Cfg(max_new_tokens=8), True,
                     {"tokenizer": "t", "num_draft": 4})
    assert key == {"target_weights_sha256": "w", "target_gguf_sha256": None, "max_new_tokens": 8,
                   "chat_template": True, "tokenizer": "t", "num_draft": 4}
    assert stage.resume_key({}, _Cfg(), False, {})["target_weights_sha256"] is None


# ------------------------------------------------------------------------------------------- stage.check_resume

KEY = {"target_weights_sha256": "w", "max_new_tokens": 8, "chat_template": True}


def _summary(path: Path, **data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_check_resume_refuses_rows_made_with_other_settings(tmp_path):
    summary = _summary(tmp_path / "t.summary.json", resume_key={**KEY, "max_new_tokens": 16}, status="complete")
    out = tmp_path / "t.jsonl"
    with pytest.raises(RecordFileError) as e:
        stage.check_resume(summary, out, KEY, done=3)
    assert str(e.value).startswith(f"{out}: its rows were made with different settings "
                                   "{'max_new_tokens': (16, 8)} (old, new); refusing to mix them")
    stage.check_resume(summary, out, KEY, done=0)  # nothing written yet: nothing to mix


def test_check_resume_names_a_setting_only_the_old_rows_had(tmp_path):
    summary = _summary(tmp_path / "t.summary.json", resume_key={**KEY, "temperature": 0.7}, status="complete")
    out = tmp_path / "t.jsonl"
    with pytest.raises(RecordFileError, match=r"different settings \{'temperature': \(0\.7, None\)\}"):
        stage.check_resume(summary, out, KEY, done=3)


def test_check_resume_accepts_the_same_key_and_summaries_without_one(tmp_path, caplog):
    out = tmp_path / "t.jsonl"
    with caplog.at_level(logging.INFO, logger="specdraft.core.stage"):
        stage.check_resume(_summary(tmp_path / "a.json", resume_key=dict(KEY), status="complete"), out, KEY, done=2)
        assert caplog.text == ""
        stage.check_resume(_summary(tmp_path / "b.json", resume_key=dict(KEY), status="running"), out, KEY, done=2)
        assert "resuming an interrupted run: 2 rows already in" in caplog.text
        caplog.clear()
        stage.check_resume(_summary(tmp_path / "c.json", status="complete"), out, KEY, done=2)  # an older summary
        assert caplog.text == ""
        stage.check_resume(tmp_path / "missing.summary.json", out, KEY, done=5)
    assert "has 5 rows but no missing.summary.json" in caplog.text


def test_check_resume_names_a_damaged_summary(tmp_path):
    summary = tmp_path / "t.summary.json"
    summary.write_text('{"stage.resume_key": ')
    with pytest.raises(ValueError, match=f"^{re.escape(str(summary))}: not valid JSON"):
        stage.check_resume(summary, tmp_path / "t.jsonl", KEY, done=1)


def test_previous_runs(tmp_path):
    summary = _summary(tmp_path / "s.json", runs=[{"prompts": 3}, {"prompts": 2}])
    assert stage.previous_runs(summary, done=5) == [{"prompts": 3}, {"prompts": 2}]
    assert stage.previous_runs(summary, done=0) == []  # the rows they made are gone
    assert stage.previous_runs(tmp_path / "missing.json", done=5) == []
    assert stage.previous_runs(_summary(tmp_path / "t.json", runs={"prompts": 3}), done=5) == []
    assert stage.previous_runs(_summary(tmp_path / "u.json", runs=None), done=5) == []


def test_the_running_summary_keeps_the_earlier_runs(tmp_path):
    summary = _summary(tmp_path / "s.json", runs=[{"prompts": 3}], status="complete")
    assert stage.write_running_summary(summary, {"stage": "traces"}, done=3) == [{"prompts": 3}]
    written = json.loads(summary.read_text())
    assert {k: written[k] for k in ("stage", "status", "runs")} == {"stage": "traces", "status": "running",
                                                                    "runs": [{"prompts": 3}]}
    assert "git_sha" in written["run"]  # the run record


def test_run_logged_runs_with_its_log_beside_the_output(tmp_path):
    def run(out, summary_path, log_path):
        logging.getLogger("specdraft.test").info("inside")
        return out, summary_path, log_path

    out = tmp_path / "new" / "t.jsonl"
    assert stage.run_logged(str(out), run) == (out, *stage.side_paths(out))
    assert "inside" in (tmp_path / "new" / "t.log").read_text()


# ------------------------------------------------------------------------------------ rows already written

def test_resumed_ids_cut_a_torn_last_line_and_make_the_file(tmp_path):
    p = _write_rows(tmp_path / "t.jsonl", [_trace("a")])
    with open(p, "a", encoding="utf-8") as f:
        f.write('{"id": "b", "prom')  # a killed write
    assert stage.resumed_ids(p) == {"a"} and p.read_text() == jsonl_line(_trace("a")) + "\n"
    assert stage.resumed_ids(tmp_path / "new.jsonl") == set() and (tmp_path / "new.jsonl").is_file()


def test_resume_rows_keeps_rows_made_with_the_same_key_and_refuses_others(tmp_path):
    out = _write_rows(tmp_path / "t.jsonl", [_trace("a"), _trace("b")])
    summary = _summary(tmp_path / "t.summary.json", resume_key=KEY, status="running")
    assert stage.resume_rows(out, summary, KEY) == {"a", "b"}
    with pytest.raises(RecordFileError, match="max_new_tokens"):
        stage.resume_rows(out, summary, {**KEY, "max_new_tokens": 16})
    assert stage.resume_rows(tmp_path / "new.jsonl", summary, {**KEY, "max_new_tokens": 16}) == set()


def test_row_ids_are_the_ids_already_written(tmp_path):
    p = _write_rows(tmp_path / "t.jsonl", [_trace("a"), "", _trace("b")])
    assert stage.row_ids(p) == {"a", "b"}
    assert [n for n, _ in stage.checked_rows(p, stage.TRACE_FIELDS)] == [1, 3]
    (tmp_path / "empty.jsonl").touch()
    assert stage.row_ids(tmp_path / "empty.jsonl") == set()


@pytest.mark.parametrize("row, fields, says", [
    ([1, 2], stage.TRACE_FIELDS, "not a row this stage wrote (a JSON object with a string 'id')"),
    ({"id": 7, "prompt_ids": [], "completion_ids": [], "finish_reason": "stop"}, stage.TRACE_FIELDS,
     "not a row this stage wrote (a JSON object with a string 'id')"),
    ({"id": "x", "prompt_ids": [1], "completion_ids": "3"}, stage.TRACE_FIELDS,
     "field(s) ['completion_ids', 'finish_reason'] missing or of the wrong type (expected completion_ids: list, "
     "finish_reason: str)"),
    ({"id": "x", "category": "c", "context_ids": [1]}, stage.POINT_FIELDS,
     "field(s) ['target_ids'] missing or of the wrong type (expected target_ids: list)"),
    ({"id": "x", "prompt_ids": [1], "completion_ids": [2], "finish_reason": "stop"}, stage.LABEL_FIELDS,
     "field(s) ['target_ids'] missing"),
])
def test_a_row_the_stage_did_not_write_is_named_by_line(tmp_path, row, fields, says):
    p = _write_rows(tmp_path / "t.jsonl", [_trace("a", category="c", context_ids=[1], target_ids=[2]), row])
    with pytest.raises(RecordFileError) as e:
        list(stage.checked_rows(p, fields))
    assert str(e.value).startswith(f"{p}:2: {says}")


def test_a_duplicate_id_is_refused(tmp_path):
    p = _write_rows(tmp_path / "t.jsonl", [_trace("a"), _trace("b"), _trace("a")])
    with pytest.raises(RecordFileError) as e:
        stage.row_ids(p)
    assert str(e.value) == f"{p}:3: duplicate id 'a'"


def test_a_damaged_line_before_the_last_is_refused_not_skipped(tmp_path):
    p = _write_rows(tmp_path / "t.jsonl", [_trace("a"), '{"id": "b", "prompt_ids": [1', _trace("c")])
    repair_jsonl(p)  # only a torn *last* line is cut
    with pytest.raises(RecordFileError, match=rf"^{re.escape(str(p))}:2: not valid JSON"):
        stage.row_ids(p)


def test_a_resumed_opening_redoes_only_the_torn_row_and_duplicates_nothing(tmp_path):
    """The opening of the traces / label stages: cut a torn last line, read the ids written, decode the rest."""
    out = tmp_path / "traces.jsonl"
    prompts = ["p0", "p1", "p2", "p3", "p4"]
    _write_rows(out, [_trace("p0"), _trace("p1")])
    with open(out, "a", encoding="utf-8") as f:
        f.write(jsonl_line(_trace("p2"))[:17])  # killed half-way through p2's row

    for attempt in range(2):  # a second rerun finds everything done
        repair_jsonl(out)
        done = stage.row_ids(out)
        todo = [p for p in prompts if p not in done]
        _write_rows(out, [_trace(p) for p in todo], mode="a")
        if attempt == 0:
            assert done == {"p0", "p1"} and todo == ["p2", "p3", "p4"]
        else:
            assert done == set(prompts) and todo == []
    ids = [obj["id"] for _, obj in stage.checked_rows(out, stage.TRACE_FIELDS)]
    assert ids == prompts


def test_a_resumed_validation_redoes_the_last_prompts_points(tmp_path):
    """The validation opening: the last prompt's points may be cut short, so the whole group is redone."""
    out = tmp_path / "validation.jsonl"

    def points(pid, n):
        return [{"id": pid, "category": "c", "offset": 4 * i, "context_ids": [1], "target_ids": [2]}
                for i in range(n)]
    _write_rows(out, points("a", 2) + points("b", 1))  # b should have had 3 points
    repair_jsonl(out)
    assert drop_last_group(out) == "b"
    done = {obj["id"] for _, obj in stage.checked_rows(out, stage.POINT_FIELDS)}
    assert done == {"a"}
    _write_rows(out, points("b", 3), mode="a")
    rows = [obj for _, obj in stage.checked_rows(out, stage.POINT_FIELDS)]
    assert [(r["id"], r["offset"]) for r in rows] == [("a", 0), ("a", 4), ("b", 0), ("b", 4), ("b", 8)]


# ----------------------------------------------------------------------------------------------- progress

def test_progress_counts_what_the_summary_records(capsys):
    progress = stage.Progress(total=3, desc="traces")
    progress.update(prompt_tokens=10, completion_tokens=4)
    progress.update(prompt_tokens=5, completion_tokens=6)
    stats = progress.close()
    assert set(stats) == {"prompts", "prompt_tokens", "completion_tokens", "wall_s", "completion_tokens_per_s",
                          "total_tokens_per_s"}
    assert (stats["prompts"], stats["prompt_tokens"], stats["completion_tokens"]) == (2, 15, 10)
    assert stats["wall_s"] >= 0 and stats["completion_tokens_per_s"] > 0
    assert stats["total_tokens_per_s"] == pytest.approx(2.5 * stats["completion_tokens_per_s"], rel=0.05)
    err = capsys.readouterr().err
    assert "traces" in err and "2/3" in err  # the bar goes to stderr, not stdout


def test_progress_rates_use_the_elapsed_time(monkeypatch):
    clock = iter([100.0, 100.5, 102.0])  # start, one update, close
    monkeypatch.setattr(stage, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # this module's clock
    progress = stage.Progress(total=1, desc="x")
    progress.update(prompt_tokens=6, completion_tokens=4)
    assert progress.close() == {"prompts": 1, "prompt_tokens": 6, "completion_tokens": 4, "wall_s": 2.0,
                                "completion_tokens_per_s": 2.0, "total_tokens_per_s": 5.0}


def test_peak_rss_is_a_plausible_number_of_megabytes():
    rss = stage.peak_rss_mb()
    assert isinstance(rss, float) and 1 < rss < 1024 * 1024
