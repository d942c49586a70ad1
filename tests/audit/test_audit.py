"""`specdraft audit` on a tiny run built with the real stages, then each link broken once (the sandbox itself:
test_sandbox.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import specdraft
from specdraft.audit import AuditConfig, audit_run, run_audit
from specdraft.audit import serve as audit_serve
from specdraft.audit.sandbox import SandboxResult
from specdraft.cli import main
from specdraft.core.io import sha256_file
from specdraft.stages.label import LabelConfig, run_label
from specdraft.stages.prompts import PromptsConfig, build_prompts
from specdraft.stages.traces import TracesConfig, ValidationConfig, run_traces, run_validation
from specdraft.stages.train import TrainConfig, run_train

QUESTIONS = [
    "What is the sum of seven and five?",
    "Write a Python function that reverses a string.",
    "Explain why the sky looks blue during a clear afternoon in simple words for a curious child who asks often.",
    "Name three rivers in Europe.",
    "How many legs does a spider have?",
    "Translate good night into Spanish.",
    "Describe a quiet morning in a small mountain village.",
    "Give two tips for writing readable code.",
]
LONG_QUESTION = QUESTIONS[2]  # >= 13 words: the contamination test reuses a 13-gram of it
EVAL = [
    {"question_id": 81, "category": "writing", "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
        "Rewrite your previous response, starting every sentence with the letter A."]},
    {"question_id": 101, "category": "reasoning", "turns": [
        "Imagine you are participating in a race with a group of people and you have just overtaken the second "
        "person. What is your current position?"]},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_qwen3_dir):
    """data/ (corpus + manifest), eval/mt_bench.jsonl and run/ built by prompts, traces, validation, train, pack."""
    root = tmp_path_factory.mktemp("audit")
    corpus = _write_jsonl(root / "data" / "corpus.jsonl",
                          [{"question": q, "answer": f"The answer to {q.lower()} is short."} for q in QUESTIONS])
    manifest = root / "data" / "manifest.json"
    manifest.write_text(json.dumps({
        "schema_version": 1, "name": "audit-test", "uses_eval_splits": False,
        "eval_examples_used_as_targets": False,
        "corpora": [
            {"name": "qa", "kind": "local_file", "path": "corpus.jsonl", "sha256": sha256_file(corpus),
             "format": "jsonl", "reader": "question", "license": "MIT"},
            {"name": "templates", "kind": "templates", "reader": "templates", "license": "Apache-2.0",
             "count": 6, "generate": 6},
        ]}, indent=2))
    eval_file = _write_jsonl(root / "eval" / "mt_bench.jsonl", EVAL)
    run = root / "run"
    tiny = str(tiny_qwen3_dir)
    build_prompts(PromptsConfig(manifest=str(manifest), out=str(run / "prompts" / "prompts.jsonl"), tokenizer=tiny,
                                eval_set=[str(eval_file)]))
    run_traces(TracesConfig(prompts=run / "prompts" / "prompts.jsonl", out=run / "traces" / "traces.jsonl",
                            target=tiny, max_new_tokens=16, batch_size=16, device="cpu"))
    run_validation(ValidationConfig(prompts=eval_file, out=run / "validation" / "validation.jsonl", target=tiny,
                                    max_new_tokens=24, num_draft=8, device="cpu"))
    run_label(LabelConfig(prompts=str(run / "prompts" / "prompts.jsonl"), out=str(run / "labels" / "labels.jsonl"),
                          target=tiny, min_answer_tokens=1, device="cpu"))
    run_train(TrainConfig(traces=str(run / "traces" / "traces.jsonl"), labels=str(run / "labels" / "labels.jsonl"),
                          init=f"truncate:{tiny}:1",
                          out=str(run / "draft"), target=tiny, max_steps=2, eval_every=1, warmup_steps=1,
                          heldout_fraction=0.2, batch_tokens=512, threads=1))
    assert main(["pack", "--checkpoint", str(run / "draft"), "--out", str(run / "model")]) == 0
    return root


@pytest.fixture
def run(base, tmp_path):
    """A private copy of the run (the data and eval files stay shared, read-only)."""
    return shutil.copytree(base / "run", tmp_path / "run", ignore=shutil.ignore_patterns("audit"))


def _audit(run: Path, **kw):
    kw.setdefault("serve_check", False)
    return audit_run(AuditConfig(run_dir=str(run), **kw))


def _failed(report) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in report.failed:
        out.setdefault(f.check, []).append(f)
    return out


def _edit_json(path: Path, dotted: str, value) -> None:
    data = json.loads(path.read_text())
    cur = data
    *head, last = dotted.split(".")
    for part in head:
        cur = cur[part]
    cur[last] = value
    path.write_text(json.dumps(data, indent=2))


# ----------------------------------------------------------------------------------------------- intact

def test_intact_run_passes_with_the_sandboxed_server(run):
    rc = main(["audit", str(run), "--serve-timeout-s", "90"])
    report = json.loads((run / "audit" / "audit.json").read_text())
    fails = [f for f in report["findings"] if f["status"] == "fail"]
    assert rc == 0 and report["passed"] and not fails, fails
    md = (run / "audit" / "audit.md").read_text()
    assert "**PASSED**" in md and "## serve" in md
    by_check = {f["check"]: f for f in report["findings"]}
    assert by_check["tensor shapes"]["message"].endswith("tensors with Qwen3ForCausalLM shapes")
    assert by_check["contamination"]["status"] == "pass" and "completions" in by_check["contamination"]["message"]
    assert by_check["greedy re-scored"]["status"] == "pass"
    for check in ("train labels sha256", "labels sha256", "labels target", "labels prompts", "labels re-scored"):
        assert by_check[check]["status"] == "pass", by_check[check]
    for check in ("server answers", "server load", "no network", "files read", "files written", "no subprocess"):
        assert by_check[check]["status"] == "pass", by_check[check]
    assert "missing=0 unexpected=0" in by_check["server load"]["message"]
    # every finding cites a file; the server opened nothing of the run but the model dir
    assert all(f["cites"] and all(c["file"] for c in f["cites"]) for f in report["findings"])
    opens = report["facts"]["serve_opens"]
    run_real = str(run.resolve())
    model_real = str((run / "model").resolve())
    assert opens["model_dir"] and any(p.endswith("draft.qd4") for p in opens["model_dir"])
    assert not [p for kind in opens.values() for p in kind if p.startswith(run_real) and not p.startswith(model_real)]
    assert not opens["other"]


def test_missing_files_are_named(run, tmp_path):
    shutil.rmtree(run / "validation")
    (run / "traces" / "traces.summary.json").unlink()
    report = _audit(run, greedy_check=0)
    missing = " ".join(f.message for f in _failed(report)["file present"])
    assert "validation/validation.summary.json" in missing and "traces/traces.summary.json" in missing
    assert run_audit(AuditConfig(run_dir=str(tmp_path / "nope"))) == 2


# ------------------------------------------------------------------------------------------------- data

def test_edited_manifest(run):
    path = run / "prompts" / "data_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["corpora"][0]["name"] = "qa_renamed"
    path.write_text(json.dumps(manifest, indent=2))
    fails = _failed(_audit(run, greedy_check=0))
    assert "manifest sha256" in fails
    (undeclared,) = fails["prompt sources declared"]
    assert "source 'qa'" in " ".join(undeclared.details)
    assert {"file": "prompts/prompts.jsonl", "field": "source"} in undeclared.cites


def test_manifest_with_an_eval_split(run):
    path = run / "prompts" / "data_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["corpora"][0]["split"] = "test"
    path.write_text(json.dumps(manifest, indent=2))
    (bad,) = _failed(_audit(run, greedy_check=0))["manifest valid"]
    assert "evaluation split" in bad.message and bad.cites[0]["file"] == "prompts/data_manifest.json"


def test_corpus_file_changed_since_the_run(run, base, tmp_path):
    changed = tmp_path / "corpus.jsonl"
    changed.write_text((base / "data" / "corpus.jsonl").read_text() + '{"question": "one more"}\n')
    stats = run / "prompts" / "prompts.stats.json"
    data = json.loads(stats.read_text())
    for rec in data["provenance"]["files"]:
        if rec["corpus"] == "qa":
            rec["resolved_path"] = str(changed)
    stats.write_text(json.dumps(data))
    (bad,) = _failed(_audit(run, greedy_check=0))["corpus pinned"]
    assert bad.message.startswith("qa:") and "changed" in bad.message
    assert bad.cites == [{"file": "prompts/data_manifest.json", "field": "corpora[0].sha256"}]


def test_contamination_of_prompts_and_completions_is_listed(run, tmp_path):
    tok = AutoTokenizer.from_pretrained(run / "draft")
    rows = [json.loads(line) for line in (run / "traces" / "traces.jsonl").read_text().splitlines()]
    texts = {r["id"]: tok.decode(r["completion_ids"], skip_special_tokens=True) for r in rows}
    victim = max(texts, key=lambda i: len(texts[i].split()))
    leaked = " ".join(LONG_QUESTION.split()[:13])
    eval_file = _write_jsonl(tmp_path / "leaky_eval.jsonl", [{"question_id": 1, "turns": [texts[victim]]},
                                                             {"question_id": 2, "turns": [f"Note: {leaked}!"]}])
    (bad,) = _failed(_audit(run, greedy_check=0, eval_set=[str(eval_file)]))["contamination"]
    details = "\n".join(bad.details)
    assert f"completion of {victim!r}" in details
    assert "prompt 'qa-" in details and leaked.lower() in details
    assert any(c["file"] == str(eval_file) for c in bad.cites)


def test_contaminated_labelled_answer_is_named(run, tmp_path):
    """An eval prompt that a labelled reference answer contains: neither a prompt nor a trace holds it."""
    tok = AutoTokenizer.from_pretrained(run / "draft")
    rows = [json.loads(line) for line in (run / "labels" / "labels.jsonl").read_text().splitlines()]
    victim = next(r for r in rows if "sum of seven" in tok.decode(r["completion_ids"], skip_special_tokens=True))
    answer = tok.decode(victim["completion_ids"], skip_special_tokens=True)
    eval_file = _write_jsonl(tmp_path / "leaky_eval.jsonl", [{"question_id": 1, "turns": [answer]}])
    (bad,) = _failed(_audit(run, greedy_check=0, eval_set=[str(eval_file)]))["contamination"]
    (detail,) = bad.details
    assert detail.startswith(f"response of {victim['id']!r} (labels.jsonl line {rows.index(victim) + 1}): ")
    assert "labelled answers" in bad.message
    assert {"file": "labels/labels.jsonl", "field": "completion_ids"} in bad.cites


# ----------------------------------------------------------------------------------------------- traces

def test_trace_with_an_unknown_id(run):
    path = run / "traces" / "traces.jsonl"
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row["id"] = "ghost-000001"
    lines[1] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    fails = _failed(_audit(run, greedy_check=0))
    assert "'ghost-000001'" in " ".join(fails["trace ids in prompts"][0].details)
    assert {"traces sha256", "train traces sha256"} <= set(fails)


def test_swapped_traces(run):
    path = run / "traces" / "traces.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    a, b = next((i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))
                if rows[i]["prompt_ids"] != rows[j]["prompt_ids"] and rows[i]["source"] == rows[j]["source"])
    rows[a]["id"], rows[b]["id"] = rows[b]["id"], rows[a]["id"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fails = _failed(_audit(run, greedy_check=0))
    (bad,) = fails["prompt ids"]
    assert len(bad.details) == 2 and rows[a]["id"] in " ".join(bad.details)
    assert "traces sha256" in fails


def test_completion_that_is_not_the_targets_greedy_choice(run):
    path = run / "traces" / "traces.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["completion_ids"] = [(t + 1) % 300 + 3 for t in rows[0]["completion_ids"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bad,) = _failed(_audit(run, greedy_check=2))["greedy re-scored"]
    assert repr(rows[0]["id"]) in bad.details[0] and "not the target's greedy choice" in bad.message


def test_llama_cpp_traces_are_greedy_but_not_rescored_by_the_torch_target(run):
    # llama.cpp traces are the GGUF file as llama.cpp computes it: the float32 target is not their judge, and the
    # tiny target has no GGUF file to decode them again with, so the check says so instead of passing
    path = run / "traces" / "traces.summary.json"
    _edit_json(path, "backend", "llama.cpp")
    _edit_json(path, "config.backend", "llama.cpp")
    report = _audit(run, greedy_check=2)
    checks = {f.check: f for f in report.findings if f.section == "traces"}
    assert checks["greedy"].status == "pass" and "'llama.cpp'" in checks["greedy"].message
    rescored = checks["greedy re-scored"]
    assert rescored.status == "skip", rescored
    assert "not decoded again" in rescored.message and "has no GGUF file" in rescored.message
    assert {"file": "traces/traces.summary.json", "field": "target.gguf_sha256"} in rescored.cites
    assert report.passed, _failed(report)


def test_labels_that_are_not_the_targets_argmax(run):
    path = run / "labels" / "labels.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[-1]["target_ids"] = [(t + 1) % 300 + 3 for t in rows[-1]["target_ids"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fails = _failed(_audit(run, greedy_check=2))
    (bad,) = fails["labels re-scored"]
    assert repr(rows[-1]["id"]) in " ".join(bad.details) and "not the target's argmax" in bad.message
    assert "train labels sha256" in fails and "labels sha256" in fails


def test_labels_from_other_prompts_are_named(run):
    _edit_json(run / "labels" / "labels.summary.json", "prompts.sha256", "0" * 64)
    (bad,) = _failed(_audit(run, greedy_check=0))["labels prompts"]
    assert "another prompts file" in bad.message and "contamination check" not in bad.message


@pytest.mark.parametrize("file,field,check", [
    ("draft/train_meta.json", "traces.sha256", "train traces sha256"),
    ("draft/train_meta.json", "init.weights_sha256", "init model still on disk"),
    ("traces/traces.summary.json", "target.weights_sha256", "train target"),
    ("model/pack_recipe.json", "source.weights_sha256", "recipe source"),
    ("model/architecture.json", "sha256", "weight sha256"),
])
def test_changed_hash(run, file, field, check):
    _edit_json(run / file, field, "0" * 64)
    fails = _failed(_audit(run, greedy_check=0))
    assert check in fails, sorted(fails)
    assert any(c["file"] == file and c["field"] == field for f in fails[check] for c in f.cites)


# ------------------------------------------------------------------------------------- training / pack

def test_checkpoint_shapes_not_its_config(run):
    _edit_json(run / "draft" / "config.json", "intermediate_size", 96)
    fails = _failed(_audit(run, greedy_check=0))
    (bad,) = fails["tensor shapes"]
    assert any("mlp.up_proj.weight: file [128, 64]" in d for d in bad.details)
    assert "config vs init" in fails


def test_flipped_byte_in_the_weights(run):
    weight = run / "model" / "draft.qd4"
    data = bytearray(weight.read_bytes())
    data[-1] ^= 0x01
    weight.write_bytes(bytes(data))
    fails = _failed(_audit(run, greedy_check=0))
    assert {"weight sha256", "weight file structure", "strict load"} <= set(fails)
    assert "checksum mismatch" in fails["weight file structure"][0].message


def test_gptq_calibration_traces_are_checked(run):
    """A --fit gptq pack names its calibration traces; the audit checks they still hold the recorded bytes."""
    traces = run / "traces" / "traces.jsonl"
    assert main(["pack", "--checkpoint", str(run / "draft"), "--out", str(run / "model"), "--overwrite",
                 "--fit", "gptq", "--calibration", str(traces), "--calibration-sequences", "4"]) == 0
    report = _audit(run, greedy_check=0)
    assert report.passed, [(f.check, f.message) for f in report.failed]
    assert [f.status for f in report.findings if f.check == "calibration"] == ["pass"]
    _edit_json(run / "model" / "pack_recipe.json", "calibration.traces", str(run / "moved" / "traces.jsonl"))
    report = _audit(run, greedy_check=0)  # recorded path gone, but the run's traces hold the recorded bytes
    assert report.passed and [f.status for f in report.findings if f.check == "calibration"] == ["pass"]
    _edit_json(run / "model" / "pack_recipe.json", "calibration.sha256", "0" * 64)
    (bad,) = _failed(_audit(run, greedy_check=0))["calibration"]
    assert bad.cites[0] == {"file": "model/pack_recipe.json", "field": "calibration.sha256"}


def test_recorded_group_sizes_are_checked_against_the_file(run):
    report = _audit(run, greedy_check=0)
    assert [f.status for f in report.findings if f.check == "group sizes"] == ["pass"]
    _edit_json(run / "model" / "pack_recipe.json", "group_sizes", {"model.layers.0.mlp.up_proj.weight": 32})
    (bad,) = _failed(_audit(run, greedy_check=0))["group sizes"]
    assert "1 tensors at [32]" in bad.message and bad.cites[1] == {"file": "model/pack_recipe.json",
                                                                     "field": "group_sizes"}


def test_generation_config_is_the_checkpoints_plus_the_recorded_draft_settings(run):
    report = _audit(run, greedy_check=0)
    (ok,) = [f for f in report.findings if f.check == "generation config"]
    assert ok.status == "pass" and "num_assistant_tokens" in ok.message
    _edit_json(run / "model" / "generation_config.json", "num_assistant_tokens", 9)
    (bad,) = _failed(_audit(run, greedy_check=0))["generation config"]
    assert any("not pack_recipe.json's" in d for d in bad.details)
    _edit_json(run / "model" / "generation_config.json", "num_assistant_tokens", 4)
    _edit_json(run / "model" / "generation_config.json", "eos_token_id", 7)
    (bad,) = _failed(_audit(run, greedy_check=0))["generation config"]
    assert any(d.startswith("eos_token_id: 7 in the model dir") for d in bad.details)


# ----------------------------------------------------------------------------------------------- export

def test_exports_are_followed_to_their_records_and_the_packed_model(run, tiny_qwen3_dir):
    report = _audit(run, greedy_check=0)
    assert [(f.check, f.status) for f in report.findings if f.section == "export"] == [("exports", "skip")]
    assert main(["export", str(run / "model"), "--format", "gguf", "--out", str(run / "export" / "draft.gguf")]) == 0
    assert main(["export", str(run / "model"), "--format", "hf", "--out", str(run / "export" / "hf")]) == 0
    report = _audit(run, greedy_check=0)
    found = [(f.check, f.status) for f in report.findings if f.section == "export"]
    assert report.passed and found == [("export file", "pass"), ("export tensors", "pass"),
                                       ("export source", "pass"), ("export file", "pass"),
                                       ("export source", "pass")], found
    assert "model" in [f for f in report.findings if f.check == "export source"][0].message
    assert main(["export", str(tiny_qwen3_dir), "--format", "gguf", "--out", str(run / "export" / "other.gguf")]) == 0
    (other,) = [f for f in _audit(run, greedy_check=0).findings if f.check == "export source" and f.status != "pass"]
    assert other.status == "warn" and "not a model of this run" in other.message

    gguf_file = run / "export" / "draft.gguf"
    data = bytearray(gguf_file.read_bytes())
    data[-1] ^= 0x01
    gguf_file.write_bytes(bytes(data))
    (tokenizer := run / "export" / "hf" / "tokenizer.json").write_text(tokenizer.read_text() + " ")
    _edit_json(run / "export" / "hf" / "export_record.json", "source.weights_sha256", "0" * 64)
    fails = _failed(_audit(run, greedy_check=0))
    assert len(fails["export file"]) == 2 and "sha256" in fails["export file"][0].message
    assert any("tokenizer.json: sha256" in d for d in fails["export file"][1].details)
    (source,) = fails["export source"]
    assert "no longer holds the recorded weights" in source.message


def test_self_draft_is_checked_against_its_records_and_the_target(run, tiny_qwen3_dir, tiny_llama_dir):
    """RUN_DIR/model_self (the demo's self-draft): its file against its records, its source against the target."""
    assert main(["pack", "--checkpoint", str(tiny_qwen3_dir), "--out", str(run / "model_self"),
                 "--embedding-encoding", "f16"]) == 0
    report = _audit(run, greedy_check=0)
    assert report.passed, [(f.check, f.message) for f in report.failed]
    assert [f.status for f in report.findings if f.check.startswith("self-draft")] == ["pass"] * 3
    weight = run / "model_self" / "draft.qd4"
    data = bytearray(weight.read_bytes())
    data[-1] ^= 0x01
    weight.write_bytes(bytes(data))
    fails = _failed(_audit(run, greedy_check=0))
    bad = fails["self-draft weight file"]  # its sha256 against both records, and the file's own checksum
    assert len(bad) == 3 and "checksum mismatch" in bad[-1].message, [f.message for f in bad]
    assert main(["pack", "--checkpoint", str(tiny_llama_dir), "--out", str(run / "model_self"), "--overwrite"]) == 0
    (bad,) = _failed(_audit(run, greedy_check=0))["self-draft source"]  # packed from another model
    assert bad.cites[0] == {"file": "model_self/pack_recipe.json", "field": "source.weights_sha256"}


# -------------------------------------------------------------------------------------------------- serve

def test_stray_file_in_the_model_dir(run):
    (run / "model" / "notes.txt").write_text("not a model file")
    assert main(["audit", str(run), "--greedy-check", "0", "--no-serve-check"]) == 1  # the CLI's exit code
    report = json.loads((run / "audit" / "audit.json").read_text())
    (bad,) = [f for f in report["findings"] if f["check"] == "model dir contents"]
    assert bad["status"] == "fail" and "notes.txt" in bad["message"] and not report["passed"]
    assert bad["cites"] == [{"file": "model", "field": "directory listing"}]


def test_server_reading_a_stray_file_fails_the_audit(run, monkeypatch):
    """The serve finding names a table in /tmp or in the package dir that the sandboxed server read."""
    stray = [str(Path(specdraft.__file__).parent / "lookup.json"), "/tmp/cheat_table.json"]
    model = run / "model"

    def fake_server(model_dir, log_path, events, context, timeout_s=120.0):
        log_path.write_text("loaded qd4 missing=0 unexpected=0\n")
        events.write_text("")
        return SandboxResult(url="http://127.0.0.1:1", draft_ids=[1, 2, 3, 4], loaded=(0, 0),
                             opens={str(model / "draft.qd4"): False, **{p: False for p in stray}},
                             python_roots=[], sandbox_dir="/tmp/specdraft-audit-sandbox-x")
    monkeypatch.setattr(audit_serve, "run_server_sandboxed", fake_server)
    (bad,) = _failed(_audit(run, greedy_check=0, serve_check=True))["files read"]
    assert bad.details == sorted(stray)
    assert bad.cites == [{"file": "audit/serve_check.events.jsonl", "field": "event=open"}]


def test_a_stored_distribution_must_be_the_declared_top_k_with_the_greedy_token_first(run):
    path, summary = run / "traces" / "traces.jsonl", run / "traces" / "traces.summary.json"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["top_ids"] = [[t, (t + 1) % 300] for t in r["completion_ids"]]
        r["top_logprobs"] = [[-0.1, -2.5] for _ in r["completion_ids"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fails = _failed(_audit(run, greedy_check=0))
    assert "stored distribution" in fails  # stored without top_logprobs declared
    _edit_json(summary, "config.top_logprobs", 2)
    assert "stored distribution" not in _failed(_audit(run, greedy_check=0))
    rows[0]["top_ids"][0] = [rows[0]["top_ids"][0][1], rows[0]["top_ids"][0][0]]  # the greedy token second
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bad,) = _failed(_audit(run, greedy_check=0))["stored distribution"]
    assert repr(rows[0]["id"]) in bad.details[0]
