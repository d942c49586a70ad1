"""A user's own target through the demo's whole pipeline (tiny models, no ../shared), and the reference rehearsal
(`specdraft rehearse`: Qwen3-shaped models on the real Qwen3 tokenizer; needs ../shared, skipped without it)."""

import json
import shutil

import pytest

import specdraft.demo as demo
from specdraft.core.io import read_json
from specdraft.data.corpus import MANIFEST_FILE, heldout_path
from specdraft.model.tiny import build_tiny_model
from specdraft.rehearsal import QWEN3_TOKENIZER_DIR, RehearseConfig, run_rehearsal, summary_markdown, traces_check

TOKENIZER = QWEN3_TOKENIZER_DIR / "tokenizer"
needs_qwen3_tokenizer = pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file(),
                                           reason=f"the real Qwen3 tokenizer is not at {TOKENIZER} "
                                                  "(../shared is absent)")
# the demo's pipeline at the smallest size that still gives every stage something to do
TINY_BUDGET = demo.Budget(trace_prompts=24, trace_tokens=24, draft_init="", epochs=1, lr=1e-3, freeze_layers=0,
                          val_prompts=6, val_tokens=32, spec_prompts=2, spec_tokens=16, spec_k=[4], spec_repeats=1,
                          compile_drafts=False, predict=False, mt_bench_answer_tokens=32)


def test_a_users_own_target_and_draft_dir_go_through_the_pipeline_and_the_audit(tmp_path):
    target = build_tiny_model(tmp_path / "target", "qwen3", layers=2, tie_embeddings=False, max_positions=2048)
    draft = build_tiny_model(tmp_path / "draft", "qwen3", layers=1, max_positions=2048, seed=3)  # smaller, tied
    cfg = demo.DemoConfig(out=str(tmp_path / "run"), target=str(target), draft_init=str(draft),
                          manifest=str(MANIFEST_FILE), eval_set=str(heldout_path()), threads=1)
    assert demo.run_demo(cfg, budget=TINY_BUDGET, budget_name="tiny") == 0
    summary = read_json(tmp_path / "run" / "demo_summary.json")
    assert summary["draft_init"] == str(draft) and summary["frozen_layers"] == 0
    assert summary["models"]["gguf_export"] and summary["audit_exit"] == 0 and summary["selfcheck_exit"] == 0
    assert read_json(tmp_path / "run" / "init" / "init_source.json")["init"] == str(draft)
    assert summary["llama_cpp_not_measured"]["why"]  # a target without a GGUF file of its own
    text = (tmp_path / "run" / "demo_summary.md").read_text()
    assert "What the larger budgets reach" not in text  # the embedded target's figures are not this target's


def test_the_summary_marks_skips_apart_from_failures():
    text = summary_markdown({"checks": [{"name": "a", "ok": True, "detail": "x"},
                                        {"name": "b", "ok": None, "detail": "not installed"},
                                        {"name": "c", "ok": False, "detail": "y"}],
                             "passed": False, "wall_seconds": 1.0, "target": "t", "draft_init": "d",
                             "demo_summary": "s"})
    assert "| a | PASS | x |" in text and "| b | SKIP | not installed |" in text and "| c | FAIL | y |" in text


@needs_qwen3_tokenizer
@pytest.mark.parametrize("broken", ["thinking prompt", "answer past the end token"])
def test_the_traces_check_fails_on_a_prompt_or_answer_out_of_shape(tmp_path, broken):
    shutil.copytree(TOKENIZER, tmp_path / "reference" / "target")
    prompt = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271]
    rows = [{"id": "a", "prompt_ids": prompt, "completion_ids": [9707, 151645], "finish_reason": "eos"}]
    if broken == "thinking prompt":
        rows[0]["prompt_ids"] = prompt[:-4]  # the generation prompt without the empty think block
    else:
        rows[0]["completion_ids"] = [151645, 9707]
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "traces" / "traces.summary.json").write_text(json.dumps({"chat_template": True}))
    assert not traces_check(tmp_path)["ok"]
    rows[0].update(prompt_ids=prompt, completion_ids=[9707, 151645])
    (tmp_path / "traces" / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert traces_check(tmp_path)["ok"]


@pytest.mark.slow
@pytest.mark.rehearsal
@needs_qwen3_tokenizer
def test_the_reference_rehearsal_passes_every_check(tmp_path):
    assert run_rehearsal(RehearseConfig(out=str(tmp_path / "rehearsal"), threads=2)) == 0
    summary = read_json(tmp_path / "rehearsal" / "rehearsal_summary.json")
    assert summary["passed"] and all(c["ok"] is True for c in summary["checks"]), summary["checks"]
    llama = next(c for c in summary["checks"] if "llama.cpp" in c["name"])
    assert llama["first_token_agreement"] >= 0.95 and llama["points"] >= 20
