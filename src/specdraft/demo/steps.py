"""The demo's pipeline as a declared table of steps (``STEPS``): each step's name, what it runs, what it reads and
writes under the run dir, when it is skipped and why it does not run at all.

``Run`` holds what every step needs (the config, the budget, the draft's start, the data) and builds each stage's
config once. A step's ``fingerprint`` is its skip rule: a marker (``RUN_DIR/.stages/NAME.json``) holding the same
fingerprint means the step ran already, so a rerun resumes; a step ``always`` run has no marker (the checks of the
files as they are now). ``unavailable`` says why a step cannot run here (llama.cpp not installed), and the summary
says it too.

MT-bench (``DemoConfig.shared_data``'s ``dev/mt_bench.jsonl``, when there) is evaluated beside the main evaluation
set on both of its turns: ``mt_bench_points`` decodes the target's first answers (a traces file, resumable) and the
second turns' contexts over them (``drafting.mt_bench``), ``eval_mt_bench`` measures the trained draft there with
prompt lookup beside it and the hybrid's rule chosen on half the prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from specdraft.audit import AuditConfig, run_audit
from specdraft.core.io import atomic_write_json, atomic_write_text, jsonl_line, read_json, sha256_file
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.data.corpus import heldout_path
from specdraft.data.mt_bench import interleave_categories, read_mt_bench
from specdraft.demo.budgets import SELF_DRAFT_EMBEDDING, Budget
from specdraft.demo.config import REPO_ROOT, DemoConfig
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM
from specdraft.drafting.mt_bench import write_mt_bench_points
from specdraft.model.compat import PipelineModels
from specdraft.model.llamacpp import llama_cpp_available, llama_cpp_version
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.trace_backend import HFBackend
from specdraft.model.truncate import save_init
from specdraft.server.process import ServerProcess
from specdraft.stages.evaluate import EvalConfig, run_eval
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.prompts import PromptsConfig, build_prompts
from specdraft.stages.selfcheck import SelfcheckConfig, run_selfcheck
from specdraft.stages.speculate import SpeculateConfig, run_speculate
from specdraft.stages.traces import TracesConfig, ValidationConfig, run_traces, run_validation
from specdraft.stages.train import TrainConfig, run_train

SHARED_MANIFEST = REPO_ROOT / "configs" / "manifest.shared.json"


@dataclass
class Run:
    """One demo run: its config and budget, the draft's start, the target's checks, and each stage's config."""

    cfg: DemoConfig
    budget: Budget
    run_dir: Path
    init_spec: str
    frozen: int
    models: PipelineModels
    results: dict[str, Any] = field(default_factory=dict)  # what each step returned, by name

    @cached_property
    def eval_set(self) -> tuple[str, str]:
        """(path, what it is): --eval-set, else the packaged held-out set (MT-bench, when the shared data has it, is
        evaluated beside it: ``mt_bench``)."""
        if self.cfg.eval_set:
            return self.cfg.eval_set, "the --eval-set file"
        return str(heldout_path()), "the packaged corpus's held-out families"

    @cached_property
    def mt_bench(self) -> Path | None:
        """The shared data's MT-bench file (``DemoConfig.shared_data``), None where it is not there."""
        if not self.cfg.shared_data:
            return None
        path = Path(self.cfg.shared_data) / "dev" / "mt_bench.jsonl"
        return path if path.is_file() else None

    @property
    def mt_bench_dir(self) -> Path:
        return self.run_dir / "mt_bench"

    @cached_property
    def mt_bench_answers(self) -> TracesConfig:
        """The target's greedy first answers to the selected MT-bench questions (``mt_bench/questions.jsonl``)."""
        return TracesConfig(target=self.cfg.target, prompts=self.mt_bench_dir / "questions.jsonl",
                            out=self.mt_bench_dir / "answers.jsonl", max_new_tokens=self.budget.mt_bench_answer_tokens,
                            device=self.cfg.device)

    @cached_property
    def eval_mt_bench(self) -> EvalConfig:
        """The trained pack in process on both MT-bench turns, with lookup scored beside it and the hybrid's rule
        measured; greedy only (acceptance at temperature is the main evaluation's)."""
        return EvalConfig(validation=self.mt_bench_dir / "validation.jsonl", model_dir=self.run_dir / "model",
                          out=self.run_dir / "eval_mt_bench" / "trained", device=self.cfg.device,
                          target=self.cfg.target, threads=self.cfg.threads, choose_hybrid_rule=True,
                          temperatures=[])

    @cached_property
    def manifest(self) -> str | None:
        """--manifest, else the shared data's manifest when that data is here, else None (the packaged corpus)."""
        if self.cfg.manifest:
            return self.cfg.manifest
        shared = self.cfg.shared_data and Path(self.cfg.shared_data).is_dir() and SHARED_MANIFEST.is_file()
        return str(SHARED_MANIFEST) if shared else None

    @property
    def validation(self) -> Path:
        return self.run_dir / "validation" / "validation.jsonl"

    @property
    def clock(self) -> str:
        return "cpu" if self.cfg.threads == 1 else "wall"  # CPU time is steady on a shared machine at one thread

    @cached_property
    def prompts(self) -> PromptsConfig:
        # decontaminated against every set the run evaluates on (every turn of MT-bench)
        eval_sets = [self.eval_set[0]] + ([str(self.mt_bench)] if self.mt_bench else [])
        return PromptsConfig(manifest=self.manifest, out=str(self.run_dir / "prompts" / "prompts.jsonl"),
                             tokenizer=self.cfg.target, eval_set=eval_sets)

    @cached_property
    def traces(self) -> TracesConfig:
        return TracesConfig(target=self.cfg.target, prompts=self.run_dir / "prompts" / "prompts.jsonl",
                            out=self.run_dir / "traces" / "traces.jsonl", max_new_tokens=self.budget.trace_tokens,
                            limit=self.budget.trace_prompts, device=self.cfg.device)

    @cached_property
    def validation_config(self) -> ValidationConfig:
        return ValidationConfig(target=self.cfg.target, prompts=Path(self.eval_set[0]), out=self.validation,
                                max_new_tokens=self.budget.val_tokens, limit=self.budget.val_prompts,
                                device=self.cfg.device)

    @cached_property
    def pack(self) -> PackConfig:
        gptq = {"fit": "gptq", "calibration": str(self.run_dir / "traces" / "traces.jsonl")} if self.budget.gptq else {}
        return PackConfig(checkpoint=str(self.run_dir / "draft"), out=str(self.run_dir / "model"), overwrite=True,
                          **gptq)

    @cached_property
    def train(self) -> TrainConfig:
        b = self.budget
        return TrainConfig(traces=str(self.run_dir / "traces" / "traces.jsonl"), init=self.init_spec,
                           out=str(self.run_dir / "draft"), target=self.cfg.target, epochs=b.epochs, lr=b.lr,
                           freeze_layers=self.frozen, threads=self.cfg.threads, eval_every=b.eval_every,
                           qat_group_size=self.pack.group_size if b.qat else None)

    @cached_property
    def export(self) -> ExportConfig:
        """GGUF for llama.cpp, or an HF dir for transformers / vLLM where the GGUF writer does not cover the
        architecture; the audit follows its record back to the pack."""
        if self.models.gguf_export:
            return ExportConfig(model_dir=str(self.run_dir / "model"), format="gguf",
                                out=str(self.run_dir / "export" / "draft.gguf"), overwrite=True)
        return ExportConfig(model_dir=str(self.run_dir / "model"), format="hf",
                            out=str(self.run_dir / "export" / "hf"), overwrite=True)

    @cached_property
    def pack_self(self) -> PackConfig:
        """The reference draft no training makes: the target's own weights, packed (SELF_DRAFT_EMBEDDING)."""
        return PackConfig(checkpoint=self.cfg.target, out=str(self.run_dir / "model_self"), overwrite=True,
                          embedding_encoding=SELF_DRAFT_EMBEDDING)

    def eval_config(self, name: str, **drafter: Any) -> EvalConfig:
        return EvalConfig(validation=self.validation, out=self.run_dir / "eval" / name, device=self.cfg.device,
                          target=self.cfg.target, **drafter)

    @cached_property
    def speculate(self) -> SpeculateConfig:
        b = self.budget
        return SpeculateConfig(target=self.cfg.target, draft=str(self.run_dir / "model"),
                               prompts=Path(self.eval_set[0]), out=self.run_dir / "speculate",
                               max_new_tokens=b.spec_tokens, k=b.spec_k, num_prompts=b.spec_prompts,
                               threads=self.cfg.threads, repeats=b.spec_repeats,
                               also_draft=[f"self={self.run_dir / 'model_self'}"],
                               draft_compile="on" if b.compile_drafts else "off", clock=self.clock,
                               predict=b.predict, device=self.cfg.device)

    @cached_property
    def speculate_llama_cpp(self) -> SpeculateConfig:
        b = self.budget
        return SpeculateConfig(engine="llama.cpp", target=self.cfg.target,
                               draft=str(self.run_dir / "export" / "draft.gguf"), prompts=Path(self.eval_set[0]),
                               out=self.run_dir / "speculate_llama_cpp", max_new_tokens=b.spec_tokens,
                               k=b.llama_k, num_prompts=b.spec_prompts, threads=self.cfg.threads,
                               repeats=b.spec_repeats, full_precision=b.llama_full_precision, clock=self.clock)


@dataclass(frozen=True)
class Step:
    """One step of the pipeline: ``run`` does the work (its result is kept in the marker), ``fingerprint`` is the
    skip rule, ``inputs`` / ``outputs`` the run-dir paths it reads and writes, ``unavailable`` why it cannot run here
    (None: it runs), ``always``: no marker, it runs every time."""

    name: str
    run: Callable[[Run], Any]
    fingerprint: Callable[[Run], dict[str, Any]]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    unavailable: Callable[[Run], dict[str, str] | None] = lambda run: None
    always: bool = False


# ------------------------------------------------------------------------------------------- the steps

def _write_init(run: Run) -> dict[str, str]:
    source = save_init(run.init_spec, run.run_dir / "init")
    atomic_write_json(run.run_dir / "init" / "init_source.json", source)
    return {"init": run.init_spec}


def _export(run: Run) -> dict[str, Any]:
    result = run_export(run.export)
    record = read_json(result.record)
    out = Path(result.out)
    files = [f for f in out.rglob("*") if f.is_file()] if out.is_dir() else [out]
    return {"path": str(out), "format": record.get("format", "gguf"), "bytes": sum(f.stat().st_size for f in files),
            "exact": result.exact,
            "tensors": len(record.get("tensors", [])), "not_exact": len(record.get("not_exact", []))}


def _eval_served(run: Run) -> int:
    """The trained draft measured the way it ships: packed, behind the HTTP server; then the same server behind
    prompt lookup (the lookup runs in the client, never in the server). At temperature the distributions come from
    the pack loaded here as the server runs it (the compute its /health says)."""
    cfg = run.cfg
    server = ServerProcess(run.run_dir / "model", run.run_dir / "eval" / "served_server.log",
                           ["--device", cfg.device, *(["--threads", str(cfg.threads)] if cfg.threads else [])])
    try:
        ok, detail = server.wait_ready(300)
        if not ok:
            raise RuntimeError(f"draft server did not start: {detail}")
        common = dict(server=server.url, pack_dir=run.run_dir / "model", threads=cfg.threads)
        exit_code = run_eval(run.eval_config("trained", choose_hybrid_rule=True, **common))
        return max(exit_code, run_eval(run.eval_config("trained_lookup", hybrid_min_ngram=DEFAULT_HYBRID_MIN_NGRAM,
                                                       **common)))
    finally:
        server.stop()


def _mt_bench_points(run: Run) -> dict[str, Any]:
    """The selected MT-bench questions (the budget's evaluation prompts, round-robin over the categories), the
    target's first answers to them, and both turns' points."""
    questions = interleave_categories(read_mt_bench(run.mt_bench), run.budget.val_prompts)
    listed = run.mt_bench_dir / "questions.jsonl"
    text = "".join(jsonl_line(q.to_json()) + "\n" for q in questions)
    if not listed.is_file() or listed.read_text(encoding="utf-8") != text:
        atomic_write_text(listed, text)
    answers = run_traces(run.mt_bench_answers)
    summary = write_mt_bench_points(
        run.mt_bench_dir / "validation.jsonl", questions, listed, run.mt_bench_answers.out, run.cfg.target,
        lambda: HFBackend(run.cfg.target, run.cfg.device, run.mt_bench_answers.batch_size), DRAFT_TOKENS,
        run.budget.mt_bench_eval_tokens)
    return {"questions": len(questions), "answers": answers.rows, "points": summary["points"]}


def _mt_bench_unavailable(run: Run) -> dict[str, str] | None:
    if run.mt_bench is not None:
        return None
    return {"why": "no dev/mt_bench.jsonl in the shared data folder" + (f" ({run.cfg.shared_data})"
                                                                      if run.cfg.shared_data else " (none given)"),
            "how": "`specdraft demo --shared-data DIR` with DIR/dev/mt_bench.jsonl (question_id, category, turns)"}


def _llama_cpp_unavailable(run: Run) -> dict[str, str] | None:
    """Why the llama.cpp speculation cannot run here and how to run it, or None when it can."""
    if not llama_cpp_available():
        return {"why": "llama-cpp-python is not installed",
                "how": "`make install-llama`, then `make demo` again (it skips the finished stages), measures it here"}
    if not run.cfg.target.startswith("embedded:"):
        return {"why": f"the target {run.cfg.target} brings no GGUF file of its own (only an embedded target does)",
                "how": "`specdraft speculate --engine llama.cpp --target-gguf FILE --draft RUN_DIR/export/draft.gguf` "
                       "measures it with the target's GGUF file"}
    problem = engine_problem()
    if problem:
        return {"why": problem, "how": "rebuild llama-cpp-python as the message says, then `make demo` again (it "
                                       "skips the finished stages)"}
    return None


def _eval_step(name: str, **drafter: Callable[[Run], Any]) -> Step:
    """Acceptance (greedy and at temperature, the target loaded by the eval) of one in-process drafter."""
    def config(run: Run) -> EvalConfig:
        return run.eval_config(name, **{key: make(run) for key, make in drafter.items()})
    return Step(f"eval_{name}", lambda run: run_eval(config(run)), lambda run: config(run).to_json_dict(),
                inputs=("validation",), outputs=(f"eval/{name}",))


STEPS: list[Step] = [
    Step("prompts", lambda run: {"total": build_prompts(run.prompts).total}, lambda run: run.prompts.to_json_dict(),
         inputs=(), outputs=("prompts",)),
    Step("traces", lambda run: {"rows": run_traces(run.traces).rows}, lambda run: run.traces.to_json_dict(),
         inputs=("prompts",), outputs=("traces",)),
    Step("validation", lambda run: {"rows": run_validation(run.validation_config).rows},
         lambda run: run.validation_config.to_json_dict(), inputs=(), outputs=("validation",)),
    Step("mt_bench_points", _mt_bench_points,
         lambda run: {"mt_bench": str(run.mt_bench), "sha256": sha256_file(run.mt_bench),
                      "questions": run.budget.val_prompts,
                      "tokens": run.budget.mt_bench_eval_tokens, "answers": run.mt_bench_answers.to_json_dict()},
         inputs=(), outputs=("mt_bench",), unavailable=_mt_bench_unavailable),
    Step("train", lambda run: {"best": (meta := run_train(run.train)).get("best"), "steps": meta.get("steps")},
         lambda run: run.train.to_json_dict(), inputs=("traces",), outputs=("draft",)),
    Step("init", _write_init, lambda run: {"init": run.init_spec}, inputs=(), outputs=("init",)),
    Step("pack", lambda run: {"bytes": run_pack(run.pack).bytes}, lambda run: run.pack.to_json_dict(),
         inputs=("draft", "traces"), outputs=("model",)),
    Step("export", _export, lambda run: {**run.export.to_json_dict(), "pack": run.pack.to_json_dict(),
                                         "train": run.train.to_json_dict()},
         inputs=("model",), outputs=("export",)),
    Step("pack_self", lambda run: {"bytes": run_pack(run.pack_self).bytes}, lambda run: run.pack_self.to_json_dict(),
         inputs=(), outputs=("model_self",)),
    _eval_step("init", model_dir=lambda run: run.run_dir / "init"),
    _eval_step("lookup", lookup=lambda run: True),
    _eval_step("self", model_dir=lambda run: run.run_dir / "model_self", threads=lambda run: run.cfg.threads),
    Step("eval_trained", _eval_served,
         lambda run: {"model": str(run.run_dir / "model"), "validation": str(run.validation),
                      "train": run.train.to_json_dict(), "hybrid_min_ngram": DEFAULT_HYBRID_MIN_NGRAM,
                      "choose_hybrid_rule": True,
                      "temperatures": EvalConfig.model_fields["temperatures"].default},
         inputs=("model", "validation"), outputs=("eval/trained", "eval/trained_lookup")),
    Step("eval_mt_bench", lambda run: run_eval(run.eval_mt_bench),
         lambda run: {**run.eval_mt_bench.to_json_dict(), "train": run.train.to_json_dict(),
                      "pack": run.pack.to_json_dict()},
         inputs=("model", "mt_bench"), outputs=("eval_mt_bench",), unavailable=_mt_bench_unavailable),
    Step("speculate", lambda run: run_speculate(run.speculate),
         lambda run: {**run.speculate.to_json_dict(), "train": run.train.to_json_dict(),
                      "pack_self": run.pack_self.to_json_dict()},
         inputs=("model", "model_self"), outputs=("speculate",)),
    # the same prompts in llama.cpp, the engine CPU users decode with: the exported draft against the target's own
    # GGUF file, where the extra is installed and the target brings that file
    Step("speculate_llama_cpp", lambda run: run_speculate(run.speculate_llama_cpp),
         lambda run: {**run.speculate_llama_cpp.to_json_dict(), "export": run.export.to_json_dict(),
                      "pack": run.pack.to_json_dict(), "train": run.train.to_json_dict(),
                      "llama_cpp_python": llama_cpp_version()},
         inputs=("export",), outputs=("speculate_llama_cpp",), unavailable=_llama_cpp_unavailable),
    Step("selfcheck", lambda run: run_selfcheck(SelfcheckConfig(model_dir=run.run_dir / "model",
                                                                out=run.run_dir / "selfcheck",
                                                                threads=run.cfg.threads)),
         lambda run: {}, inputs=("model",), outputs=("selfcheck",), always=True),
    Step("audit", lambda run: run_audit(AuditConfig(run_dir=str(run.run_dir))), lambda run: {},
         inputs=(), outputs=(), always=True,
         unavailable=lambda run: None if run.cfg.audit else {"why": "--no-audit", "how": "drop --no-audit"}),
]
STAGES = [step.name for step in STEPS]  # in the order they run (the markers' names)
