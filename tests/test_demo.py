"""The demo: its default data, its summary (what the draft saw, what each row means, a verdict, what the larger
budgets reach), and the audit at the end."""

import json
import os
import time

import pytest

import specdraft.demo as demo
from specdraft.data.corpus import heldout_path

STUB_FILES = {  # what the stubbed stages would write, with the fields the summary reads
    "prompts/prompts.stats.json": {"total": 2210, "corpora": {
        "specdraft-coding": {"read": 228, "dropped": {"near_duplicate": 2, "too_long": 0}},
        "specdraft-math": {"read": 229, "dropped": {"contaminated": 1}}}},
    "traces/traces.summary.json": {"rows": 96, "completion_tokens": 5800},
    "draft/train_meta.json": {"traces": {"train": 91, "heldout": 5}, "steps": 28, "train_tokens_this_run": 11200,
                              "seconds_this_run": 171.2},
    "validation/validation.summary.json": {"points": 52, "prompts": 16},
    "eval/init/report.json": {"mean_accepted_pooled": 0.57, "mean_accepted_per_prompt": 0.6, "points": 52},
    "eval/trained/report.json": {"mean_accepted_pooled": 0.71, "mean_accepted_per_prompt": 0.7, "points": 52,
                                 "latency": {"p50_ms": 410.0, "p99_ms": 900.0}},
    "eval/lookup/report.json": {"mean_accepted_pooled": 1.1, "mean_accepted_per_prompt": 1.0, "points": 52},
    "eval/trained_lookup/report.json": {"mean_accepted_pooled": 1.3, "mean_accepted_per_prompt": 1.2, "points": 52},
    "eval/self/report.json": {"mean_accepted_pooled": 14.9, "mean_accepted_per_prompt": 14.8, "points": 52},
    "model/architecture.json": {"bytes": 1000, "parameters": 10},
    "model_self/architecture.json": {"bytes": 2000, "parameters": 20},
    "speculate/speculate.json": {
        "prompts": 6, "repeats": 3, "clock": "wall", "lossless": True, "config": {"max_new_tokens": 64},
        "baseline": {"tokens_per_s": 20.0},
        "drafters": {name: {"best_k": k, "best_tokens_per_s": 20 * s, "best_speedup": s,
                            "per_k": {str(k): {"accepted_per_step": 1.0, "speedup_median": s, "speedup_range": r}}}
                     for name, k, s, r in (("draft", 2, 1.02, [0.95, 1.10]), ("draft+lookup", 2, 1.10, [1.0, 1.2]),
                                           ("lookup", 4, 1.08, [1.01, 1.15]), ("self", 16, 1.9, [1.8, 2.0]))}},
}


def _stub_run(tmp_path, monkeypatch, audit_exit=0):
    calls: list[str] = []
    monkeypatch.setattr(demo, "_stage", lambda run_dir, name, fingerprint, fn: calls.append(name))
    monkeypatch.setattr(demo, "run_selfcheck", lambda cfg: calls.append("selfcheck") or 0)
    monkeypatch.setattr(demo, "run_audit", lambda cfg: calls.append(f"audit {cfg.run_dir}") or audit_exit)
    run = tmp_path / "demo"
    for name, content in STUB_FILES.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(json.dumps(content))
    return run, calls


@pytest.mark.parametrize("audit_exit", [0, 1])
def test_demo_ends_with_the_audit_and_fails_with_it(tmp_path, monkeypatch, audit_exit):
    """`specdraft demo` runs the audit last on its run dir and exits 1 when the audit fails (stages stubbed)."""
    run, calls = _stub_run(tmp_path, monkeypatch, audit_exit)
    rc = demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(tmp_path / "eval.jsonl")))
    assert calls[-3:] == ["speculate", "selfcheck", f"audit {run}"] and "pack_self" in calls and "eval_self" in calls
    assert calls.index("pack") < calls.index("export") < calls.index("selfcheck")  # the audit follows the export
    assert rc == audit_exit and json.loads((run / "demo_summary.json").read_text())["audit_exit"] == audit_exit


def test_without_shared_data_the_demo_uses_the_packaged_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "SHARED_DATA", tmp_path / "no-shared")
    assert demo._default_manifest() is None  # the built-in default: the packaged corpus
    path, kind = demo._default_eval_set()
    assert path == str(heldout_path()) and "held-out" in kind


def test_the_summary_says_what_the_draft_saw_and_what_its_numbers_mean(tmp_path, monkeypatch):
    run, _ = _stub_run(tmp_path, monkeypatch)
    demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(heldout_path())))
    text = (run / "demo_summary.md").read_text()
    # what the draft saw
    assert "2210 prompts kept of 457 read from 2 corpora" in text
    assert "dropped: 1 contaminated, 2 near duplicate" in text
    assert "96 of them (5800 tokens); 91 trained on, 5 held out" in text
    assert "28 steps over 11200 tokens in 2.9 min; the draft starts as 24 of the target's layers, the first 12" in text
    assert "52 points" in text and "16 prompts" in text
    # each row's meaning, and the speculation measured over passes
    for name, (label, meaning) in demo.DRAFTERS.items():
        assert f"| {label} |" in text and meaning in text
    assert "6 prompts x 64 tokens, 3 pass(es)" in text and "| self-draft | 16 | 1.90x | 1.80x to 2.00x |" in text
    # the verdict: fastest, trained vs init and vs lookup, noise, and the plain statement about this CPU
    assert "Fastest here: the self-draft, 1.90x" in text
    assert "from 0.57 to 0.71 accepted tokens of 16 (+0.14); prompt lookup accepts 1.10" in text
    assert "is level with prompt lookup (1.08x): their ranges over 3 passes overlap" in text
    assert "at best level with prompt lookup" in text and "reference pair" in text
    # what the larger budgets reach, quoted from BENCHMARKS.md
    reference = demo.budget_reference()
    assert reference is not None and "| default |" in reference and "| full |" in reference and reference in text


def test_a_resumed_demo_says_what_training_took_over_its_sittings_and_which_stages_it_skipped(tmp_path,
                                                                                            monkeypatch):
    run, _ = _stub_run(tmp_path, monkeypatch)
    meta = {**STUB_FILES["draft/train_meta.json"], "resumed_from_step": 20, "train_tokens": 11200,
            "train_seconds": 171.2, "train_tokens_this_run": 3000, "seconds_this_run": 40.0}
    (run / "draft" / "train_meta.json").write_text(json.dumps(meta))
    for name, age_s in (("prompts", 3600), ("traces", 3000), ("speculate", 0)):
        marker = run / ".stages" / f"{name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("{}")
        os.utime(marker, (time.time() - age_s + 60,) * 2)  # speculate's marker: written after the start
    demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(heldout_path())))
    text = (run / "demo_summary.md").read_text()
    assert "28 steps over 11200 tokens in 2.9 min over its sittings (resumed at step 20 after an interruption)" in text
    assert "for this invocation, which skipped 2 stages an earlier one finished (prompts, traces;" in text


def test_the_verdict_tells_a_real_difference_from_noise():
    summary = {"acceptance": {}, "speculate": {
        "prompts": 6, "repeats": 3,
        "draft": {"best_k": 2, "speedup_median": 1.5, "speedup_range": [1.4, 1.6]},
        "lookup": {"best_k": 4, "speedup_median": 1.1, "speedup_range": [1.0, 1.2]}}}
    assert any("(1.50x) is faster than prompt lookup (1.10x)." in line for line in demo.verdict(summary))
