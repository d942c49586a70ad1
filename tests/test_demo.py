"""The demo: the pipeline on the embedded default, its summary, and the audit at the end."""

import json

import pytest

# --------------------------------------------------------------------------------------------------- demo

@pytest.mark.parametrize("audit_exit", [0, 1])
def test_demo_ends_with_the_audit_and_fails_with_it(tmp_path, monkeypatch, audit_exit):
    """`specdraft demo` runs the audit last on its run dir and exits 1 when the audit fails (stages stubbed)."""
    import specdraft.demo as demo

    calls: list[str] = []
    monkeypatch.setattr(demo, "_stage", lambda run_dir, name, fingerprint, fn: calls.append(name))
    monkeypatch.setattr(demo, "run_selfcheck", lambda cfg: calls.append("selfcheck") or 0)
    monkeypatch.setattr(demo, "run_audit", lambda cfg: calls.append(f"audit {cfg.run_dir}") or audit_exit)
    run = tmp_path / "demo"
    for name in ("eval/init/report.json", "eval/lookup/report.json", "eval/trained/report.json",
                 "eval/trained_lookup/report.json", "eval/self/report.json", "model_self/architecture.json",
                 "speculate/speculate.json", "model/architecture.json"):  # what the stubbed stages would write
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("{}")
    rc = demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(tmp_path / "eval.jsonl")))
    assert calls[-3:] == ["speculate", "selfcheck", f"audit {run}"] and "pack_self" in calls and "eval_self" in calls
    assert rc == audit_exit and json.loads((run / "demo_summary.json").read_text())["audit_exit"] == audit_exit
