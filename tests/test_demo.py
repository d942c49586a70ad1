"""The demo: its default data, its summary (what the draft saw, what each row means, the speed in each engine
with its baseline, a verdict computed from the figures, what the larger budgets reach), and the audit at the
end."""

import json
import os
import time

import pytest

import specdraft.demo as demo
from specdraft.data.corpus import heldout_path
from specdraft.demo import pipeline, steps
from specdraft.demo.plan import Plan
from specdraft.drafting.hybrid_rule import RulePoint, measure_rules
from specdraft.drafting.spec import DrafterSpec
from specdraft.model.compat import PipelineModels
from specdraft.model.specs import DEFAULT_TARGET
from specdraft.reports import demo as report
from specdraft.stages.pack import PackResult

# the target's measured pass costs: a pass over 5 tokens (k = 4) costs two one-token steps
PASS_SECONDS = {"1": 0.02, "3": 0.03, "5": 0.04}


SPECS = {"torch": {"draft": DrafterSpec("draft"), "draft+lookup": DrafterSpec("draft", behind_lookup=True),
                   "lookup": DrafterSpec("lookup"), "self": DrafterSpec("self")},
         "llama.cpp": {name: DrafterSpec(name, "llama.cpp") for name in ("draft", "lookup", "self", "ngram",
                                                                          "self-4bit")}}
SPECS["llama.cpp"]["draft+lookup"] = DrafterSpec("draft", "llama.cpp", behind_lookup=True)


def _speculate_report(rows, engine="torch", baseline=20.0, verdict=(), **extra):
    """A speculate.json with the fields the summary reads; ``rows``: {drafter: (best k, median speed-up, range over
    passes, predicted speed-up, share equal to plain greedy, draft cost per token in target steps)}."""
    return {"prompts": 6, "repeats": 3, "clock": "wall", "lossless": True, "engine": engine,
            "exact_engine": engine == "torch", "config": {"max_new_tokens": 64, "dtype": "float32"},
            "baseline": {"tokens_per_s": baseline},
            "drafters": {name: {"best_k": k, "best_tokens_per_s": baseline * s, "best_speedup": s,
                                "per_k": {str(k): {"accepted_per_step": 1.0, "speedup_median": s, "speedup_range": r,
                                                   "predicted_speedup": p, "equal_to_plain_greedy": equal}}}
                         for name, (k, s, r, p, equal, _) in rows.items()},
            "drafter_specs": {name: SPECS[engine][name].to_json() for name in rows},
            "prediction": {"engine": engine, "verdict": list(verdict), "costs": {"pass_seconds": PASS_SECONDS},
                           "drafters": {name: {str(k): {"predicted_speedup": p,
                                                        "draft_cost_per_token_vs_target_step": cost}}
                                        for name, (k, _, _, p, _, cost) in rows.items()}},
            **extra}


TORCH_ROWS = {"draft": (2, 1.02, [0.95, 1.10], 1.05, 1.0, 0.4), "draft+lookup": (2, 1.10, [1.0, 1.2], 1.1, 1.0, 0.3),
              "lookup": (4, 1.08, [1.01, 1.15], 1.1, 1.0, 0.01), "self": (16, 1.9, [1.8, 2.0], 2.0, 1.0, 0.2)}
# llama.cpp where nothing pays: every drafter at most 1x, measured and predicted
LLAMA_ROWS = {"draft": (4, 0.50, [0.49, 0.51], 0.48, 1.0, 2.85), "draft+lookup": (4, 0.49, [0.48, 0.51], 0.33, 1, 4.2),
              "self": (4, 0.68, [0.59, 0.77], 0.45, 0.75, 4.9), "ngram": (4, 0.78, [0.71, 0.84], 0.75, 1.0, 2.2),
              "lookup": (4, 0.99, [0.93, 1.04], 0.82, 1.0, 1.25)}
LLAMA_VERDICT = ["llama.cpp: a pass over k + 1 tokens costs 2.42x a one-token step (k = 4).",
                 "self: a drafted token costs 4.91x a target step, so even with every token accepted it cannot pay."]
LLAMA_REPORT = _speculate_report(
    LLAMA_ROWS, "llama.cpp", baseline=45.5, verdict=LLAMA_VERDICT, threads=2, llama_cpp_python="0.3.36",
    target={"gguf": "/x/SmolLM2-135M-Instruct-Q4_1.gguf"},
    full_precision={**_speculate_report({"self-4bit": (4, 0.58, [0.58, 0.59], 0.61, 1.0, 3.6)}, "llama.cpp",
                                        baseline=30.0), "target": {"gguf": "/x/run/SmolLM2.F32.gguf"}})

# MT-bench's both turns: 4 questions, 2 points a turn each; turn 1's answers are new text (the draft accepts 3,
# lookup has nothing), turn 2 restates turn 1 (lookup copies 10 of 16 at long matches, the draft 1)
MT_POINTS = ([RulePoint(f"{q}-turn1", "turn1/writing", 100, 3, 0, 0) for q in range(4) for _ in range(2)]
             + [RulePoint(f"{q}-turn2", "turn2/writing", 700, 1, 10, 20) for q in range(4) for _ in range(2)])
MT_BENCH_FILES = {
    "mt_bench/validation.summary.json": {"points": 16, "prompts": 8, "categories": {
        "turn1/writing": {"turn": 1, "category": "writing", "points": 8},
        "turn2/writing": {"turn": 2, "category": "writing", "points": 8}}},
    "eval_mt_bench/trained/report.json": {
        "drafter": "qd4:model", "mean_accepted_pooled": 2.0,
        "per_category": {"turn1/writing": {"points": 8, "accepted_total": 24, "mean_accepted": 3.0},
                         "turn2/writing": {"points": 8, "accepted_total": 8, "mean_accepted": 1.0}},
        "hybrid_rule": measure_rules(MT_POINTS),
        "per_point": [{"category": point.category, "lookup_accepted": point.lookup} for point in MT_POINTS]},
}

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
    # the keys the pack writes, and none of the names an older summary guessed
    "model/architecture.json": {"bytes": 1000, "parameters": 10, "tensors": 3},
    "model_self/architecture.json": {"bytes": 2000, "parameters": 20, "tensors": 3},
    "speculate/speculate.json": _speculate_report(TORCH_ROWS),
    **MT_BENCH_FILES,  # read where ../shared holds MT-bench (DemoConfig's default shared_data)
}


def _stub_run(tmp_path, monkeypatch, audit_exit=0, llama=False, run=(), files=None):
    """Stages stubbed to their files (``files`` over STUB_FILES); llama-cpp-python installed or not; the stages
    named in ``run`` run their function (with whatever the test stubs below them)."""
    calls: list[str] = []
    stages: dict[str, dict] = {}

    def stage(run_dir, name, fingerprint, fn):
        calls.append(name)
        stages[name] = {"fingerprint": fingerprint, "result": fn() if name in run else None}
        return stages[name]["result"]
    monkeypatch.setattr(pipeline, "run_stage", stage)
    monkeypatch.setattr(pipeline, "plan", lambda budget, stages, threads: NO_PLAN)  # no probe of this machine
    monkeypatch.setattr(steps, "llama_cpp_available", lambda: llama)
    monkeypatch.setattr(steps, "engine_problem", lambda: None)  # the engine runs (no child process here)
    monkeypatch.setattr(steps, "run_selfcheck", lambda cfg: calls.append("selfcheck") or 0)
    monkeypatch.setattr(steps, "run_audit", lambda cfg: calls.append(f"audit {cfg.run_dir}") or audit_exit)
    monkeypatch.setattr(pipeline, "check_pipeline_models", lambda target, init: PipelineModels(
        target=target, model_type="llama", vocab_rows=49152, tokenizer_entries=49152, draft_init=init,
        lean_forward=True, gguf_export=True))
    run_dir = tmp_path / "demo"
    for name, content in {**STUB_FILES, **(files or {})}.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(json.dumps(content))
    return run_dir, calls, stages


NO_PLAN = Plan(machine={"cpu": "CPU", "cpu_family": "1", "cpu_model": "2", "cpu_class": "avx2", "cpus": 2},
               threads=1, probe_seconds=0.1, speed_vs_reference=None, expected_seconds={}, reference_machine=None)
MACHINE = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "cpu_class": "avx512-bf16", "cpus": 2}
LLAMA_RESULT = {"bench": "llamacpp_speed", "command": "specdraft speculate --engine llama.cpp", "date": "2026-12-04",
                "machine": MACHINE, "figures": {"target": "SmolLM2-135M-Instruct Q4_1", "plain_tokens_per_s": 88.7,
                                                "drafters": [{"label": "llama rows", "best_k": 1, "speedup": 0.77,
                                                              "range": [0.75, 0.78], "predicted": 0.84}]}}


def _summary_text(run, **config) -> str:
    """The demo run in ``run`` (its stages stubbed by ``_stub_run``) on the packaged held-out set, ``config`` over
    DemoConfig's defaults: its demo_summary.md."""
    demo.run_demo(demo.DemoConfig(out=str(run), **{"eval_set": str(heldout_path()), **config}))
    return (run / "demo_summary.md").read_text()


def _references(tmp_path, results: dict[str, dict]) -> str:
    """A results folder holding only these (bench/results/<name>.json)."""
    folder = tmp_path / "results"
    folder.mkdir(exist_ok=True)
    for old in folder.glob("*.json"):
        old.unlink()
    for name, result in results.items():
        (folder / f"{name}.json").write_text(json.dumps(result))
    return str(folder)


@pytest.mark.parametrize("audit_exit", [0, 1])
def test_demo_ends_with_the_audit_and_fails_with_it(tmp_path, monkeypatch, audit_exit):
    """`specdraft demo` runs the audit last on its run dir and exits 1 when the audit fails (stages stubbed)."""
    run, calls, _ = _stub_run(tmp_path, monkeypatch, audit_exit)
    rc = demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(tmp_path / "eval.jsonl")))
    assert calls[-3:] == ["speculate", "selfcheck", f"audit {run}"] and "pack_self" in calls and "eval_self" in calls
    assert calls.index("pack") < calls.index("export") < calls.index("selfcheck")  # the audit follows the export
    assert "speculate_llama_cpp" not in calls  # llama-cpp-python is not installed
    assert rc == audit_exit and json.loads((run / "demo_summary.json").read_text())["audit_exit"] == audit_exit


@pytest.mark.parametrize("budget", ["small", "default"])
def test_with_llama_cpp_installed_the_demo_speculates_there_with_the_exported_draft(tmp_path, monkeypatch, budget):
    run, calls, stages = _stub_run(tmp_path, monkeypatch, llama=True, run=("speculate_llama_cpp",),
                                   files={"speculate_llama_cpp/speculate.json": LLAMA_REPORT})
    configs = []
    monkeypatch.setattr(steps, "run_speculate", lambda cfg: configs.append(cfg) or 0)
    demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(tmp_path / "eval.jsonl"), budget=budget, threads=1))
    assert calls.index("export") < calls.index("speculate") < calls.index("speculate_llama_cpp") < calls.index(
        "selfcheck")
    [cfg] = configs
    want = demo.BUDGETS[budget]
    assert cfg.engine == "llama.cpp" and cfg.draft == str(run / "export" / "draft.gguf") and cfg.target_gguf is None
    assert cfg.out == run / "speculate_llama_cpp" and cfg.prompts == tmp_path / "eval.jsonl"
    assert (cfg.threads, cfg.clock) == (1, "cpu")  # as the torch engine's speculation at one thread
    assert (cfg.k, cfg.full_precision) == (want.llama_k, want.llama_full_precision)
    assert (cfg.num_prompts, cfg.max_new_tokens, cfg.repeats) == (want.spec_prompts, want.spec_tokens,
                                                                  want.spec_repeats)
    # its marker changes with the draft (its export, pack and training) and with the engine's version
    fingerprint = stages["speculate_llama_cpp"]["fingerprint"]
    assert {"export", "pack", "train", "llama_cpp_python"} <= set(fingerprint)
    assert fingerprint["export"]["out"] == str(run / "export" / "draft.gguf")


def test_the_pack_stages_record_the_bytes_the_pack_wrote(tmp_path, monkeypatch):
    run, _, stages = _stub_run(tmp_path, monkeypatch, run=("pack", "pack_self"))
    monkeypatch.setattr(steps, "run_pack", lambda cfg: PackResult(bytes=4321 if cfg.out.endswith("model") else 8765))
    demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(tmp_path / "eval.jsonl")))
    assert stages["pack"]["result"] == {"bytes": 4321} and stages["pack_self"]["result"] == {"bytes": 8765}
    summary = json.loads((run / "demo_summary.json").read_text())
    assert summary["pack"] == {"bytes": 1000, "parameters": 10}  # architecture.json's keys
    assert summary["pack_self"] == {"bytes": 2000, "parameters": 20}
    assert "Pack: 1000 bytes, 10 parameters (self-draft: 2000 bytes, 20 parameters)" in (
        run / "demo_summary.md").read_text()


def test_without_shared_data_the_demo_uses_the_packaged_corpus(tmp_path):
    for shared in (None, str(tmp_path / "no-shared")):
        run = steps.Run(demo.DemoConfig(shared_data=shared), demo.BUDGETS["small"], tmp_path, "init", 0, None)
        assert run.manifest is None  # the built-in default: the packaged corpus
        path, kind = run.eval_set
        assert path == str(heldout_path()) and "held-out" in kind
        assert run.mt_bench is None and run.prompts.eval_set == [str(heldout_path())]
    (tmp_path / "shared" / "dev").mkdir(parents=True)
    (tmp_path / "shared" / "dev" / "mt_bench.jsonl").write_text("{}\n")
    run = steps.Run(demo.DemoConfig(shared_data=str(tmp_path / "shared")), demo.BUDGETS["small"], tmp_path, "i", 0,
                    None)
    # MT-bench is evaluated beside the packaged held-out set, and training prompts are decontaminated against both
    mt_bench = tmp_path / "shared" / "dev" / "mt_bench.jsonl"
    assert run.eval_set == (str(heldout_path()), "the packaged corpus's held-out families")
    assert run.mt_bench == mt_bench and run.prompts.eval_set == [str(heldout_path()), str(mt_bench)]
    assert run.manifest == str(steps.SHARED_MANIFEST)


def test_with_mt_bench_the_demo_evaluates_both_turns_and_summarises_them(tmp_path, monkeypatch):
    """The MT-bench steps run where the shared data holds it (its path from DemoConfig.shared_data), never feed
    training, and the summary renders both turns per category and context length from their records."""
    shared = tmp_path / "shared"
    (shared / "dev").mkdir(parents=True)
    (shared / "dev" / "mt_bench.jsonl").write_text(json.dumps({"question_id": 1, "category": "writing",
                                                               "turns": ["a", "b"]}) + "\n")
    run, calls, stages = _stub_run(tmp_path, monkeypatch)
    demo.run_demo(demo.DemoConfig(out=str(run), shared_data=str(shared)))
    assert calls.index("mt_bench_points") < calls.index("train") < calls.index("pack") < calls.index(
        "eval_mt_bench") < calls.index("speculate")
    fingerprint = stages["eval_mt_bench"]["fingerprint"]
    assert fingerprint["validation"] == str(run / "mt_bench" / "validation.jsonl")
    assert fingerprint["model_dir"] == str(run / "model") and fingerprint["choose_hybrid_rule"]
    assert {"train", "pack"} <= set(fingerprint)  # a new draft measures again
    assert stages["mt_bench_points"]["fingerprint"]["mt_bench"] == str(shared / "dev" / "mt_bench.jsonl")
    train = next(step for step in steps.STEPS if step.name == "train")
    assert "mt_bench" not in train.inputs and stages["eval_trained"]["fingerprint"]["choose_hybrid_rule"]
    text = (run / "demo_summary.md").read_text()
    section = text[text.index("## MT-bench, both turns"):text.index("## Speed in")]
    assert "16 points from 8 prompts" in section
    assert ("The trained draft over every point: 2.00 accepted of 16, turn 1 3.00, turn 2 1.00. Prompt lookup over "
            "every point: 5.00, turn 1 0.00, turn 2 10.00.") in section
    assert ("On MT-bench (never trained on), over every point, the trained draft accepts more than prompt lookup on "
            "turn 1 (3.00 against 0.00), and less than prompt lookup on turn 2 (1.00 against 10.00).") in text
    assert "**lookup where its match >= 1**" in section and "On the other 8 points" in section
    # the chosen rule is the better of the two in each turn: short in no group (each of 2 prompts: no interval)
    assert ("The chosen rule accepts less than the better of the model alone and lookup alone in 0 of 4 groups "
            "(categories and context lengths); beyond its 90% interval over prompts in 0 (4 of the groups have fewer "
            "than 4 reported prompts: no interval).") in section
    assert "| turn 1 | 4 | 3.00 | 0.00 | 3.00 | 3.00 |" in section
    assert "| turn 2 | 4 | 1.00 | 10.00 | 10.00 | 10.00 |" in section
    assert "| turn2/writing | 4 | 1.00 | 10.00 | 10.00 | 10.00 |" in section
    assert "| 256-1K | 4 | 1.00 | 10.00 | 10.00 | 10.00 |" in section
    summary = json.loads((run / "demo_summary.json").read_text())
    assert summary["mt_bench"]["hybrid_rule"]["chosen"]["min_match"] == 1

    # without MT-bench: neither step runs, and the summary says why
    run2, calls, _ = _stub_run(tmp_path / "none", monkeypatch)
    demo.run_demo(demo.DemoConfig(out=str(run2), shared_data=None))
    assert "mt_bench_points" not in calls and "eval_mt_bench" not in calls
    text = (run2 / "demo_summary.md").read_text()
    assert "Not measured in this run: no dev/mt_bench.jsonl in the shared data folder (none given)." in text


def test_the_summary_says_what_the_draft_saw_and_what_its_numbers_mean(tmp_path, monkeypatch):
    run, _, _ = _stub_run(tmp_path, monkeypatch)
    text = _summary_text(run)
    # what the draft saw
    assert "2210 prompts kept of 457 read from 2 corpora" in text
    assert "dropped: 1 contaminated, 2 near duplicate" in text
    assert "96 of them (5800 tokens); 91 trained on, 5 held out" in text
    assert "28 steps over 11200 tokens in 2.9 min; the draft starts as 24 of the target's layers." in text
    assert "52 points" in text and "16 prompts" in text
    # each row's meaning, and the speculation measured over passes, labelled with its engine and baseline
    for name, spec in pipeline.EVAL_DRAFTERS.items():
        assert f"| {spec.label} |" in text and spec.description in text
    assert "## Speed in specdraft's own engine (torch, float32 target), against its own plain greedy decoding" in text
    assert "6 prompts x 64 tokens, 3 pass(es)" in text
    assert "| self-draft | 16 | 1.90x | 1.80x to 2.00x | 2.00x |" in text
    # the verdict, from the figures: fastest per engine, whether anything beats plain decoding in every pass,
    # trained vs init and vs lookup, and the noise
    assert ("Fastest in specdraft's own engine (torch, float32 target): the self-draft, 1.90x its own plain greedy "
            "decoding (k = 16, range 1.80x to 2.00x).") in text
    # lookup's whole range is above 1x too, the trained draft's and the hybrid's are not
    assert ("In specdraft's own engine (torch, float32 target) the prompt lookup and the self-draft beat its own "
            "plain greedy decoding in each of the 3 passes.") in text
    assert "from 0.57 to 0.71 accepted tokens of 16 (+0.14); prompt lookup accepts 1.10" in text
    assert "is level with prompt lookup (1.08x): their ranges over 3 passes overlap" in text
    assert "the trained draft behind lookup (1.10x) is level with prompt lookup (1.08x)" in text
    # the trained draft does not pay here, and its draft cost leaves room (k = 2: 3 tokens for 1.5 + 2 x 0.4 steps)
    assert ("it is the trained draft's acceptance that falls short: a drafted token costs it 0.40x a target step, so "
            "with every token accepted it would reach at most 1.30x, and it keeps 1.00 drafted tokens per step") in text
    assert "at best level with prompt lookup" not in text  # no fixed paragraph whatever the figures
    # what the larger budgets reach, quoted from the measured results in bench/results (with their machine)
    section = text[text.index("## What the larger budgets reach"):text.index("## Files and checks")]
    assert "| default | AMD EPYC (family 25, model 17, avx512-bf16)" in section and "| full |" in section


def _at_temperature(**pooled):
    return {"acceptance_at_temperature": {"temperatures": {
        key: {"temperature": float(key), "mean_expected_accepted_pooled": v} for key, v in pooled.items()}}}


def test_the_acceptance_table_has_columns_at_temperature(tmp_path, monkeypatch):
    """Eval's temperatures above 0 as columns, filled from each report's acceptance at temperature; '-' where a
    report has none (here the untrained init's stub); every drafter's eval is asked for them."""
    files = {"eval/trained/report.json": {**STUB_FILES["eval/trained/report.json"],
                                          **_at_temperature(**{"0.0": 0.71, "0.7": 0.93, "1.0": 1.02})},
             "eval/self/report.json": {**STUB_FILES["eval/self/report.json"],
                                       **_at_temperature(**{"0.0": 14.9, "0.7": 12.25, "1.0": 11.5})}}
    run, _, stages = _stub_run(tmp_path, monkeypatch, files=files)
    text = _summary_text(run)
    assert "| per-prompt mean | sampling at T = 0.7 | sampling at T = 1.0 | what it is |" in text
    assert "| trained draft | 0.71 | 0.70 | 0.93 | 1.02 |" in text
    assert "| self-draft | 14.90 | 14.80 | 12.25 | 11.50 |" in text
    assert "| untrained init | 0.57 | 0.60 | - | - |" in text
    # the served draft's distributions come from its pack in process; the marker follows the temperatures
    assert "from the pack the server serves, loaded in process" in text
    assert stages["eval_trained"]["fingerprint"]["temperatures"] == [0.0, 0.7, 1.0]
    for name, temperatures in (("eval_self", [0.0, 0.7, 1.0]), ("eval_lookup", [0.0, 0.7, 1.0]),
                               ("eval_init", [0.0, 0.7, 1.0])):
        fingerprint = stages[name]["fingerprint"]
        assert fingerprint["temperatures"] == temperatures and fingerprint["target"] == DEFAULT_TARGET


def test_without_llama_cpp_the_summary_quotes_its_speed_and_says_how_to_measure_it(tmp_path, monkeypatch):
    results = _references(tmp_path, {"llamacpp_speed.avx512-bf16": LLAMA_RESULT})
    run, _, _ = _stub_run(tmp_path, monkeypatch)
    text = _summary_text(run, reference_results=results)
    assert "## Speed in llama.cpp (the engine CPU users run)" in text
    assert "Not measured in this run: llama-cpp-python is not installed. `make install-llama`, then `make demo`" in text
    assert "| llama rows |" in text and "In llama.cpp" not in text  # quoted, and no verdict drawn from it

    # a target without a GGUF file of its own: why, and the command that measures it
    hub = dict(target="hub:org/model@main", draft_init="truncate:2", reference_results=results)
    text = _summary_text(run, **hub)
    assert "Not measured in this run: llama-cpp-python is not installed" in text  # the first reason that holds
    assert "| llama rows |" not in text  # the embedded target's figures are not this target's
    monkeypatch.setattr(steps, "llama_cpp_available", lambda: True)
    text = _summary_text(run, **hub)
    assert "the target hub:org/model@main brings no GGUF file of its own" in text and "--target-gguf FILE" in text
    monkeypatch.setattr(steps, "llama_cpp_available", lambda: False)

    # no measured results beside the installation: one line says so
    text = _summary_text(run, reference_results=None)
    assert "(No measured results beside this installation: see the repository's BENCHMARKS.md.)" in text


def test_with_llama_cpp_the_summary_gives_its_speed_and_the_verdict_says_nothing_pays_there(tmp_path, monkeypatch):
    results = _references(tmp_path, {"llamacpp_speed.avx512-bf16": LLAMA_RESULT})
    run, _, _ = _stub_run(tmp_path, monkeypatch, llama=True,
                          files={"speculate_llama_cpp/speculate.json": LLAMA_REPORT})
    text = _summary_text(run, reference_results=results)
    section = text[text.index("## Speed in llama.cpp"):text.index("## Verdict")]
    assert "llama-cpp-python 0.3.36, the target's own file `SmolLM2-135M-Instruct-Q4_1.gguf`, 2 threads" in section
    assert "| plain decoding | - | 1.00x (45.5 tokens/s) |" in section
    assert ("| trained draft | 4 | 0.50x | 0.49x to 0.51x | 0.48x | 1.00 | 100% | the trained draft as "
            "exported") in section
    assert "| self-draft | 4 | 0.68x | 0.59x to 0.77x | 0.45x | 1.00 | 75% |" in section
    assert "| n-gram lookup | 4 | 0.78x |" in section
    assert "`SmolLM2.F32.gguf`" in section and "| plain decoding | - | 1.00x (30.0 tokens/s) |" in section
    assert "| 4-bit self-draft | 4 | 0.58x | 0.58x to 0.59x | 0.61x |" in section
    assert all(f"- {line}" in section for line in LLAMA_VERDICT)
    assert "| llama rows |" not in text  # measured here, so not quoted
    verdict = text[text.index("## Verdict"):]
    assert "Fastest in llama.cpp: the prompt lookup, 0.99x llama.cpp's plain decoding (k = 4" in verdict
    assert "In llama.cpp no drafter beats llama.cpp's plain decoding in each of the 3 passes." in verdict
    assert ("In llama.cpp no drafter can pay on this machine: every drafter's best speed-up, measured and predicted "
            "from the measured costs, is at most 1x (best measured: the prompt lookup, 0.99x; best predicted: the "
            "prompt lookup, 0.82x).") in verdict
    assert "the 4-bit self-draft gives 0.58x llama.cpp's plain decoding of the F32 file: it does not pay" in verdict
    assert "In llama.cpp the trained draft (0.50x) is slower than prompt lookup (0.99x)." in verdict
    assert ("In llama.cpp the trained draft cannot pay whatever it accepts: a drafted token costs it 2.85x a target "
            "step, so with every token accepted it would reach at most 0.37x.") in verdict
    summary = json.loads((run / "demo_summary.json").read_text())
    assert summary["speculate_llama_cpp"]["drafters"]["self"]["equal_to_plain_greedy"] == 0.75
    assert summary["llama_cpp_not_measured"] is None


def test_the_verdict_follows_the_figures():
    def summary(torch_rows, llama_rows=None):
        return {"acceptance": {}, "speculate": pipeline.speculate_summary(_speculate_report(torch_rows)),
                "speculate_llama_cpp": llama_rows and pipeline.speculate_summary(_speculate_report(llama_rows,
                                                                                                  "llama.cpp"))}

    # the trained draft beats lookup beyond the noise, and pays in both engines
    paying = {"draft": (4, 1.5, [1.4, 1.6], 1.4, 1.0, 0.1), "lookup": (4, 1.1, [1.0, 1.2], 1.1, 1.0, 0.01)}
    lines = report.verdict(summary(paying, paying))
    assert "In specdraft's own engine (torch, float32 target) the trained draft (1.50x) is faster than prompt " \
           "lookup (1.10x)." in lines
    # lookup's median is above 1x, but not every pass
    assert "In llama.cpp the trained draft beats llama.cpp's plain decoding in each of the 3 passes." in lines
    assert "In llama.cpp the measured costs predict the most from the trained draft: 1.40x (measured 1.50x)." in lines
    assert not any("no drafter" in line or "costs it" in line for line in lines)
    assert "In llama.cpp the trained draft (1.50x) is faster than prompt lookup (1.10x)." in lines

    # nothing pays: the same words in neither engine
    slow = {"draft": (4, 0.7, [0.6, 0.8], 0.7, 1.0, 1.2), "lookup": (4, 0.97, [0.9, 1.02], 0.95, 1.0, 0.01)}
    lines = report.verdict(summary(slow, slow))
    assert "In specdraft's own engine (torch, float32 target) no drafter beats its own plain greedy decoding " \
           "in each of the 3 passes." in lines
    assert any(line.startswith("In llama.cpp no drafter can pay on this machine") for line in lines)
    assert any("is slower than prompt lookup" in line for line in lines)
    assert any(line.startswith("In specdraft's own engine (torch, float32 target) the trained draft cannot pay "
                               "whatever it accepts: a drafted token costs it 1.20x") for line in lines)

    # a median above 1x whose range dips below it does not pay; without llama.cpp, no llama.cpp sentences
    noisy = {"draft": (4, 1.05, [0.95, 1.1], 1.0, 1.0, 0.3)}
    lines = report.verdict(summary(noisy))
    assert any("no drafter beats" in line for line in lines) and not any("llama.cpp" in line for line in lines)

    # behind lookup the trained draft is faster than lookup alone beyond the noise, alone it is slower: both said
    split = {"draft": (8, 1.09, [1.09, 1.10], 1.16, 1.0, 0.3), "draft+lookup": (8, 1.16, [1.15, 1.17], 1.21, 1.0, 0.3),
             "lookup": (4, 1.11, [1.11, 1.12], 1.2, 1.0, 0.01)}
    lines = report.verdict(summary(split))
    assert "In specdraft's own engine (torch, float32 target) the trained draft (1.09x) is slower than prompt " \
           "lookup (1.11x)." in lines
    assert "In specdraft's own engine (torch, float32 target) the trained draft behind lookup (1.16x) is faster " \
           "than prompt lookup (1.11x)." in lines


def test_a_resumed_demo_says_what_training_took_over_its_sittings_and_which_stages_it_skipped(tmp_path,
                                                                                            monkeypatch):
    run, _, _ = _stub_run(tmp_path, monkeypatch)
    meta = {**STUB_FILES["draft/train_meta.json"], "resumed_from_step": 20, "train_tokens": 11200,
            "train_seconds": 171.2, "train_tokens_this_run": 3000, "seconds_this_run": 40.0}
    (run / "draft" / "train_meta.json").write_text(json.dumps(meta))
    for name, age_s in (("prompts", 3600), ("traces", 3000), ("speculate", 0)):
        marker = run / ".stages" / f"{name}.json"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("{}")
        os.utime(marker, (time.time() - age_s + 60,) * 2)  # speculate's marker: written after the start
    text = _summary_text(run)
    assert "28 steps over 11200 tokens in 2.9 min over its sittings (resumed at step 20 after an interruption)" in text
    assert "for this invocation, which skipped 2 stages an earlier one finished (prompts, traces;" in text


# ------------------------------------------------------------------------------------------- a user's own target

def test_the_draft_start_follows_the_target():
    embedded = demo.DemoConfig()
    init = demo.DRAFT_INIT.format(target=embedded.target)
    assert demo.draft_start(embedded, demo.BUDGETS["default"]) == (init, demo.FROZEN_LAYERS)
    assert demo.draft_start(embedded, demo.BUDGETS["small"]) == (init, 0)  # small and full train every layer
    assert demo.draft_start(embedded, demo.BUDGETS["full"]) == (init, 0)
    assert report.describe_init({"draft_init": init, "frozen_layers": 12}) == ("24 of the target's layers, the first "
                                                                              "12 of them frozen")
    cut = demo.DemoConfig(target="/models/mine", draft_init="truncate:3", freeze_layers=1)
    assert demo.draft_start(cut, demo.BUDGETS["small"]) == ("truncate:/models/mine:3", 1)
    pretrained = demo.DemoConfig(target="/models/mine", draft_init="/models/small")
    assert demo.draft_start(pretrained, demo.BUDGETS["default"]) == ("/models/small", 0)


def test_without_a_draft_start_a_users_target_keeps_half_its_layers(tmp_path):
    from specdraft.model.tiny import build_tiny_model
    target = build_tiny_model(tmp_path / "target", "qwen3", layers=4)
    assert demo.draft_start(demo.DemoConfig(target=str(target)), demo.BUDGETS["small"]) == (f"truncate:{target}:2", 0)


def test_a_target_the_pipeline_cannot_carry_is_refused_before_any_stage(tmp_path, tiny_qwen3_dir, monkeypatch):
    from specdraft.model.compat import UnsupportedModelError
    from specdraft.model.tiny import build_tiny_model
    ran = []
    monkeypatch.setattr(pipeline, "run_stage", lambda *a: ran.append(a[1]))
    other = build_tiny_model(tmp_path / "other", "qwen3", vocab_size=300)
    with pytest.raises(UnsupportedModelError, match="tokenizer is not the target's"):
        demo.run_demo(demo.DemoConfig(out=str(tmp_path / "run"), target=str(tiny_qwen3_dir), draft_init=str(other)))
    assert ran == []


def test_a_target_without_gguf_support_is_exported_for_transformers(tmp_path, monkeypatch):
    run, _, stages = _stub_run(tmp_path, monkeypatch)
    monkeypatch.setattr(pipeline, "check_pipeline_models", lambda target, init: PipelineModels(
        target=target, model_type="mistral", vocab_rows=320, tokenizer_entries=320, draft_init=init,
        lean_forward=False, gguf_export=False, notes=["no GGUF"]))
    demo.run_demo(demo.DemoConfig(out=str(run), target="/models/mistral", draft_init="truncate:1"))
    assert stages["export"]["fingerprint"]["format"] == "hf"
    assert stages["export"]["fingerprint"]["out"] == str(run / "export" / "hf")
    assert "speculate_llama_cpp" not in stages


def test_the_plan_scales_the_reference_run_by_the_probe_and_by_each_stages_work(monkeypatch):
    from specdraft.demo import plan as plan_mod
    small, default = demo.BUDGETS["small"], demo.BUDGETS["default"]
    reference = {"machine": MACHINE, "probe_seconds": 0.2, "budget": "small", "units": plan_mod.stage_units(small),
                 "stage_seconds": {"traces": 90.0, "train": 150.0, "audit": 5.0}}
    monkeypatch.setattr(plan_mod, "reference", lambda: reference)
    monkeypatch.setattr(plan_mod, "probe_seconds", lambda: 0.1)  # this machine runs the probe twice as fast
    expected = plan_mod.plan(small, ["traces", "train", "eval_init"], threads=1)
    assert expected.speed_vs_reference == 2.0
    assert expected.expected_seconds == {"traces": 45.0, "train": 75.0}  # no reference for eval_init: none said
    assert expected.unexpected == ("eval_init",) and "so not expected: eval_init" in expected.lines()[-1]
    bigger = plan_mod.plan(default, ["traces"], threads=1)
    work = (default.trace_prompts * default.trace_tokens) / (small.trace_prompts * small.trace_tokens)
    assert bigger.expected_seconds["traces"] == pytest.approx(45.0 * work)
    assert "expected wall time 2.0 min" in expected.lines()[0] and "AMD EPYC" in expected.lines()[0]
    # the small reference packs by rounding; a GPTQ pack is not scaled from it (tokens traced would make hours of it)
    reference["stage_seconds"]["pack"] = 1.5
    assert default.gptq and not small.gptq
    assert plan_mod.plan(small, ["pack"], threads=1).expected_seconds == {"pack": 0.75}
    gptq = plan_mod.plan(default, ["traces", "pack"], threads=1)
    assert "pack" not in gptq.expected_seconds and gptq.unexpected == ("pack",)
    assert "another kind of work there" in gptq.lines()[-1]
    monkeypatch.setattr(plan_mod, "reference", lambda: None)
    assert plan_mod.plan(small, ["traces"], threads=1).expected_seconds == {}


def test_the_packaged_reference_names_its_machine_and_covers_every_marked_stage():
    from specdraft.demo import plan as plan_mod
    reference = plan_mod.reference()
    assert reference is not None and reference["budget"] == "small" and reference["probe_seconds"] > 0
    # recorded with today's small budget: every stage it timed has today's work (a stage added since is not expected)
    today = plan_mod.stage_units(demo.BUDGETS["small"])
    assert reference["units"] == {stage: today[stage] for stage in reference["units"]}
    assert {"traces", "train", "eval_trained", "speculate"} <= set(reference["stage_seconds"])
    assert reference["machine"]["cpu_class"] in ("avx2", "avx512", "avx512-bf16", "amx")


def test_an_engine_that_dies_here_leaves_the_demo_going_without_its_llama_cpp_rows(tmp_path, monkeypatch):
    run, calls, _ = _stub_run(tmp_path, monkeypatch, llama=True)
    monkeypatch.setattr(steps, "engine_problem", lambda: "llama.cpp (llama-cpp-python) does not run on this CPU: "
                                                         "decoding a few tokens of the embedded target killed by "
                                                         "SIGILL")
    assert demo.run_demo(demo.DemoConfig(out=str(run), eval_set=str(heldout_path()))) == 0
    assert "speculate_llama_cpp" not in calls and calls[-1] == f"audit {run}"
    text = (run / "demo_summary.md").read_text()
    assert "Not measured in this run: llama.cpp (llama-cpp-python) does not run on this CPU" in text
    assert "killed by SIGILL" in text and "rebuild llama-cpp-python" in text
