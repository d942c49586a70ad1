"""The audit's traces link on real llama.cpp traces of the embedded target: the picked completions are decoded again
by llama.cpp from the recorded GGUF file and must come out token for token; a changed token, another GGUF file
or a missing engine is never a pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdraft.audit import AuditConfig
from specdraft.audit import traces as audit_traces_module
from specdraft.audit.context import AuditContext
from specdraft.audit.traces import audit_traces
from specdraft.stages.traces import TracesConfig, run_traces

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'specdraft[llama]')")
pytestmark = pytest.mark.slow

TARGET = "embedded:smollm2-135m-instruct"
QUESTIONS = ["Hi", "What is 2+2?", "List three colours."]


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    """A run dir with prompts/ and traces/ only: three short prompts, six tokens each, through llama.cpp."""
    run = tmp_path_factory.mktemp("llamacpp_run")
    prompts = run / "prompts" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "source": "s", "prompt": q}) + "\n"
                               for i, q in enumerate(QUESTIONS)))
    # two sequences for three prompts: the audit's one-at-a-time decode is checked against batched rows
    run_traces(TracesConfig(prompts=prompts, out=run / "traces" / "traces.jsonl", target=TARGET,
                            backend="llama.cpp", max_new_tokens=6, batch_size=2, threads=1))
    return run


@pytest.fixture
def run(traced, tmp_path) -> Path:
    return shutil.copytree(traced, tmp_path / "run")


def _traces_section(run: Path) -> dict:
    """Only the traces link (its own module's entry point), every traces row picked."""
    ctx = AuditContext(AuditConfig(run_dir=str(run), greedy_check=len(QUESTIONS), serve_check=False))
    audit_traces(ctx)
    return {f.check: f for f in ctx.findings if f.check != "file present"}  # no validation/ in this run


def test_llama_cpp_traces_pass_and_a_changed_token_fails(run):
    checks = _traces_section(run)
    assert not [f for f in checks.values() if f.status == "fail"], checks
    assert checks["greedy"].status == "pass"
    rescored = checks["greedy re-scored"]
    assert rescored.status == "pass", rescored
    assert rescored.message.startswith(f"{len(QUESTIONS)} traces decoded again by llama.cpp")

    path = run / "traces" / "traces.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    victim = max(rows, key=lambda r: len(r["completion_ids"]))
    victim["completion_ids"][1] = (victim["completion_ids"][1] + 1) % 1000 + 3  # another token, not an EOS
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rescored = _traces_section(run)["greedy re-scored"]
    assert rescored.status == "fail" and "1 of 3 traces" in rescored.message, rescored
    assert rescored.details == [f"'{victim['id']}' (traces.jsonl line {rows.index(victim) + 1}): llama.cpp gives "
                                f"6 tokens, 6 stored, first different at completion position 1"]


def test_another_gguf_file_or_no_engine_is_not_a_pass(run, monkeypatch):
    summary = run / "traces" / "traces.summary.json"
    recorded = json.loads(summary.read_text())
    true_sha = recorded["target"]["gguf_sha256"]
    recorded["target"]["gguf_sha256"] = "0" * 64
    summary.write_text(json.dumps(recorded))
    rescored = _traces_section(run)["greedy re-scored"]
    assert rescored.status == "fail" and "not the file the traces were decoded from" in rescored.message

    recorded["target"]["gguf_sha256"] = true_sha
    summary.write_text(json.dumps(recorded))

    def missing():
        raise ImportError("the llama.cpp engine needs llama-cpp-python: pip install 'specdraft[llama]'")

    monkeypatch.setattr(audit_traces_module, "llama_cpp_module", missing)
    rescored = _traces_section(run)["greedy re-scored"]
    assert rescored.status == "skip" and "needs llama-cpp-python" in rescored.message, rescored
