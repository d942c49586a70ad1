"""specdraft.core.layout: where each stage of a run writes (the table in the module's docstring)."""

from pathlib import Path

from specdraft.core.layout import RunPaths


def test_the_default_layout_under_a_run_dir(tmp_path):
    run = tmp_path / "run"
    paths = RunPaths.from_run_dir(run)
    assert paths == RunPaths(run_dir=run, prompts=run / "prompts" / "prompts.jsonl",
                             traces=run / "traces" / "traces.jsonl",
                             validation=run / "validation" / "validation.jsonl", checkpoint=run / "draft",
                             model_dir=run / "model", out=run / "audit")
    assert paths.prompts_stats == run / "prompts" / "prompts.stats.json"
    assert paths.manifest == run / "prompts" / "data_manifest.json"
    assert paths.traces_summary == run / "traces" / "traces.summary.json"
    assert paths.validation_summary == run / "validation" / "validation.summary.json"
    assert paths.train_meta == run / "draft" / "train_meta.json"
    assert paths.labels == run / "labels" / "labels.jsonl"
    assert paths.model_self == run / "model_self"


def test_paths_are_absolute_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = RunPaths.from_run_dir("run", traces="elsewhere/t.jsonl")
    assert paths.run_dir == tmp_path / "run" and paths.run_dir.is_absolute()
    assert paths.traces == tmp_path / "elsewhere" / "t.jsonl"
    assert all(Path(p).is_absolute() for p in vars(paths).values())
    assert RunPaths.from_run_dir(tmp_path / "a" / ".." / "run").run_dir == tmp_path / "run"


def test_files_given_elsewhere_carry_their_side_records(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    paths = RunPaths.from_run_dir(run, prompts=other / "my.prompts.jsonl", traces=str(other / "t.jsonl"),
                                  validation=other / "v.jsonl", checkpoint=other / "ckpt", model_dir=other / "m",
                                  out=other / "report")
    assert (paths.prompts, paths.traces, paths.validation) == (other / "my.prompts.jsonl", other / "t.jsonl",
                                                               other / "v.jsonl")
    assert (paths.checkpoint, paths.model_dir, paths.out) == (other / "ckpt", other / "m", other / "report")
    assert paths.prompts_stats == other / "my.prompts.stats.json"  # the stem keeps its inner dots
    assert paths.manifest == other / "data_manifest.json"
    assert paths.traces_summary == other / "t.summary.json"
    assert paths.validation_summary == other / "v.summary.json"
    assert paths.train_meta == other / "ckpt" / "train_meta.json"
    # the run's own records stay in the run
    assert (paths.labels, paths.model_self) == (run / "labels" / "labels.jsonl", run / "model_self")


def test_an_empty_or_none_path_keeps_the_default(tmp_path):
    paths = RunPaths.from_run_dir(tmp_path, prompts="", traces=None, checkpoint="")
    assert (paths.prompts, paths.traces, paths.checkpoint) == (tmp_path / "prompts" / "prompts.jsonl",
                                                               tmp_path / "traces" / "traces.jsonl",
                                                               tmp_path / "draft")
