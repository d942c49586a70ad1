"""`specdraft demo`: the whole pipeline on the embedded default, resumable, ending with a summary that says what
its numbers mean.

manifest -> prompts -> traces -> validation -> train -> pack -> export -> serve -> eval (untrained init, trained
draft over HTTP, prompt lookup, and the self-draft: the target's own weights packed) -> speculate (specdraft's own
engine) -> speculate in llama.cpp (when llama-cpp-python is installed) -> selfcheck -> audit. Each stage records a
marker with the config it ran with; a rerun skips stages whose marker matches (traces resume inside the stage as
well). Without ../shared the data is the prompt corpus shipped in the package and its held-out set
(``data.corpus``); ``--manifest`` / ``--eval-set`` take a user's own.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import Field

from specdraft.audit import AuditConfig, run_audit
from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, atomic_write_text, read_json
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.data.corpus import heldout_path
from specdraft.demo.plan import plan
from specdraft.drafting.acceptance import temperature_key
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM
from specdraft.drafting.prediction import TargetCosts, ceiling
from specdraft.model.compat import PipelineModels, check_pipeline_models
from specdraft.model.llamacpp import llama_cpp_available, llama_cpp_version
from specdraft.model.specs import DEFAULT_TARGET, model_summary
from specdraft.model.truncate import save_init
from specdraft.server.process import ServerProcess
from specdraft.stages.evaluate import EvalConfig, compute_choice_of, run_eval
from specdraft.stages.export import ExportConfig, run_export
from specdraft.stages.pack import PackConfig, run_pack
from specdraft.stages.prompts import PromptsConfig, build_prompts
from specdraft.stages.selfcheck import SelfcheckConfig, run_selfcheck
from specdraft.stages.speculate import SpeculateConfig, run_speculate
from specdraft.stages.traces import TracesConfig, ValidationConfig, run_traces, run_validation
from specdraft.stages.train import TrainConfig, run_train

log = logging.getLogger(__name__)


REPO_ROOT = Path(__file__).resolve().parents[3]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
BENCHMARKS = REPO_ROOT / "BENCHMARKS.md"


@dataclass(frozen=True)
class Budget:
    """How much of the pipeline to run; `small` takes about 10 minutes on 2 CPU cores (BENCHMARKS.md has each budget's
    time and figures)."""

    trace_prompts: int
    trace_tokens: int
    draft_init: str  # truncate:{target}:LAYERS template
    epochs: float
    lr: float
    freeze_layers: int
    val_prompts: int
    val_tokens: int
    spec_prompts: int
    spec_tokens: int
    spec_k: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    spec_repeats: int = 1  # passes over the speculation prompts: the spread of the speed-ups over passes
    qat: bool = False  # train through the 4-bit rounding of the pack that follows (its group size)
    eval_every: int = 25  # optimizer steps between scorings of the held-out traces (each scoring is a checkpoint)
    # GPTQ-calibrate the pack on the run's traces; not after QAT, whose weights are fitted to plain rounding
    gptq: bool = False
    # speculate's draft steps through torch.compile: its compile (minutes with an empty inductor cache) pays
    # over a long sweep, not over small's few hundred draft steps
    compile_drafts: bool = True
    # specdraft's own engine predicts each speed-up from measured costs (a replay of every drafter: as much
    # drafting again); llama.cpp always does, its drafts being cheap
    predict: bool = True
    # speculation in llama.cpp (when llama-cpp-python is installed): its draft lengths, and whether to add the
    # table of the target at F32 against its own 4-bit file (a second model load and pass over the prompts)
    llama_k: list[int] = field(default_factory=lambda: [2, 4, 8])
    llama_full_precision: bool = True


# The draft keeps 24 of the target's 30 layers; the default budget trains only the last 12 (the first 12 stay
# frozen), the small and full ones train all of them (below). Which 24:
# greedy elimination on the target's traces (`specdraft choose-layers`) drops 3, 5, 13, 14, 17 and 25; untrained,
# that cut accepts about four times as much as dropping the block 16-21 (BENCHMARKS.md, "Which layers").
DRAFT_INIT = "truncate:{target}:" + ",".join(str(i) for i in range(30) if i not in (3, 5, 13, 14, 17, 25))
FROZEN_LAYERS = 12
# The self-draft (the target's own weights, packed, untrained) keeps its embedding in f16: the embedded
# target's linear layers sit on a 4-bit grid already (stored exactly), its Q8_0 embedding does not, and at 4
# bits it would lose much of the self-draft's acceptance.
SELF_DRAFT_EMBEDDING = "f16"

BUDGETS: dict[str, Budget] = {
    # 200 prompts traced 32 tokens deep, one pass: the same tokens and training steps as 102 prompts of 64 tokens
    # for 1.5 passes, spread over twice the prompts, accept more for a little more tracing (BENCHMARKS.md, "The
    # small budget's recipe", "Shorter traces over more prompts").
    # Speculation: a few prompts, each drafter at k = 16 (the calibrated stop drafts fewer where that pays), two
    # passes so that the summary can tell a difference from the machine's noise, short enough to keep the whole
    # demo within 10 minutes; no predicted speed-ups; in llama.cpp one middling k and no full-precision table, to
    # keep within its time. Every layer trains: the layers next to the ones the cut drops are among the first 12,
    # and at 22 steps training them pays more than the backward pass through them costs (BENCHMARKS.md, "The small
    # budget's recipe")
    "small": Budget(trace_prompts=200, trace_tokens=32, draft_init=DRAFT_INIT, epochs=1, lr=5e-4,
                    freeze_layers=0, val_prompts=16, val_tokens=64, spec_prompts=4, spec_tokens=32,
                    spec_k=[16], spec_repeats=2, qat=True, compile_drafts=False, predict=False, llama_k=[4],
                    llama_full_precision=False),
    # 960 traces for 1 epoch rather than 480 for 3: more data beat more epochs (BENCHMARKS.md, "More traces, one
    # epoch"); scored every 100 steps rather than 25 so that the extra traces fit the budget's earlier wall time;
    # the first 12 layers frozen: training them too accepts a little more, but by a smaller share than it adds to
    # the wall time (BENCHMARKS.md, "Which layers train")
    "default": Budget(trace_prompts=960, trace_tokens=128, draft_init=DRAFT_INIT, epochs=1, lr=5e-4,
                      freeze_layers=FROZEN_LAYERS, val_prompts=80, val_tokens=128, spec_prompts=8, spec_tokens=96,
                      spec_repeats=2, gptq=True, eval_every=100),
    # 2 epochs, scored every 100 steps: at 3 epochs scored every 25 (about 45% of the training time) the budget
    # took 4.8 h, over the 4 h it is meant for. Every layer trains: on the default budget's traces that accepts
    # more than 12 frozen for about a third more training time, which the full budget's hours leave room for
    # and the default's wall time does not repay (BENCHMARKS.md, "Which layers train")
    "full": Budget(trace_prompts=2000, trace_tokens=128, draft_init=DRAFT_INIT, epochs=2, lr=5e-4,
                   freeze_layers=0, val_prompts=80, val_tokens=192, spec_prompts=16, spec_tokens=128,
                   spec_repeats=2, gptq=True, eval_every=100),
}


class DemoConfig(StageConfig):
    out: str = Field("runs/demo", description="run directory (resumable: a rerun skips finished stages)")
    budget: Literal["small", "default", "full"] = Field(
        "small", description="how much to run (small: about 10 minutes on 2 cores; BENCHMARKS.md has each "
                             "budget's time)")
    target: str = Field(DEFAULT_TARGET, description="target model: the embedded default, or a local causal-LM dir "
                                                    "with a chat template (or a pinned hub:ORG/NAME@REV)")
    draft_init: Optional[str] = Field(
        None, description="where the draft starts: a model dir or spec sharing the target's tokenizer "
                          "(from_pretrained, e.g. a smaller model of the target's family), or truncate:N / "
                          "truncate:i,j,k (the target's first N layers / those layers); default: the budget's "
                          "recipe for the embedded target, the first half of the target's layers for any other")
    freeze_layers: Optional[int] = Field(None, ge=0, description="the draft's first layers kept frozen in training "
                                                                 "(default: the budget's for the embedded "
                                                                 "target, 0 for any other)")
    device: str = Field("auto", description="the in-process stages' device: auto (cuda when available), cpu, "
                                            "cuda or cuda:N")
    manifest: Optional[str] = Field(None, description="data manifest (default: configs/manifest.shared.json "
                                                      "when ../shared is present, else the prompt corpus shipped "
                                                      "in the package)")
    eval_set: Optional[str] = Field(None, description="evaluation prompts, never trained on (default: ../shared/data/"
                                                      "dev/mt_bench.jsonl when present, else the packaged corpus's "
                                                      "held-out set)")
    threads: Optional[int] = Field(None, description="torch CPU threads for the in-process stages")
    audit: bool = Field(True, description="end with `specdraft audit`")


# ------------------------------------------------------------------------------------------- stages

def _stage(run_dir: Path, name: str, fingerprint: dict[str, Any], fn: Callable[[], Any]) -> Any:
    """Run ``fn`` unless a marker says it already ran with the same fingerprint."""
    marker = run_dir / ".stages" / f"{name}.json"
    if marker.is_file():
        saved = read_json(marker)
        if saved.get("fingerprint") == json.loads(json.dumps(fingerprint, default=str)):
            log.info("demo: %s done earlier, skipped", name)
            return saved.get("result")
    log.info("demo: %s ...", name)
    started = time.time()
    result = fn()
    atomic_write_json(marker, {"fingerprint": fingerprint, "result": result,
                               "seconds": round(time.time() - started, 1)})
    log.info("demo: %s finished in %.1fs", name, time.time() - started)
    return result


# the stages in the order the pipeline runs them (their markers' names)
STAGES = ["prompts", "traces", "validation", "train", "init", "pack", "export", "pack_self", "eval_init",
          "eval_lookup", "eval_self", "eval_trained", "speculate", "speculate_llama_cpp"]


def _default_manifest() -> str | None:
    shared = REPO_ROOT / "configs" / "manifest.shared.json"
    return str(shared) if SHARED_DATA.is_dir() and shared.is_file() else None


def _default_eval_set() -> tuple[str, str]:
    mt_bench = SHARED_DATA / "dev" / "mt_bench.jsonl"
    if mt_bench.is_file():
        return str(mt_bench), "MT-bench (../shared)"
    return str(heldout_path()), "the packaged corpus's held-out families"


def run_demo(cfg: DemoConfig, budget: Budget | None = None, budget_name: str | None = None) -> int:
    """The pipeline on ``cfg.target`` at ``cfg.budget`` (or an explicit ``budget``, as the reference rehearsal's);
    a target or draft start it cannot carry is refused before any stage runs (``check_pipeline_models``)."""
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    budget = budget or BUDGETS[cfg.budget]
    started = time.time()
    with stage_log(run_dir / "demo.log"):
        init_spec, frozen = draft_start(cfg, budget)
        models = check_pipeline_models(cfg.target, init_spec)
        for note in models.notes:
            log.info("demo: %s", note)
        done = {m.stem for m in (run_dir / ".stages").glob("*.json")}
        expected = plan(budget, [s for s in STAGES if s not in done], cfg.threads)
        for line in expected.lines():
            log.info("demo: %s", line)
        summary = _pipeline(cfg, budget, run_dir, init_spec, frozen, models)
        summary["plan"] = expected.to_json()
        summary["stage_seconds"] = {m.stem: read_json(m).get("seconds") for m in (run_dir / ".stages").glob("*.json")}
        summary["budget"] = budget_name or cfg.budget
        summary["wall_seconds"] = round(time.time() - started, 1)
        # a marker older than this invocation is a stage an earlier one finished (and this one skipped); whole
        # seconds, for file systems that keep coarse modification times
        markers = sorted((m.stat().st_mtime, m.stem) for m in (run_dir / ".stages").glob("*.json"))
        summary["stages_done_earlier"] = [name for mtime, name in markers if mtime < int(started)]
        # BENCHMARKS.md's figures are the embedded target's: quoted for it alone
        summary["embedded_target"] = cfg.target == DEFAULT_TARGET
        if summary["embedded_target"]:
            summary["budget_reference"] = benchmarks_block(BUDGETS_BLOCK)
            if summary.get("speculate_llama_cpp") is None:
                summary["llama_cpp_reference"] = benchmarks_block(LLAMA_CPP_BLOCK)
        summary.update(run_metadata())
        atomic_write_json(run_dir / "demo_summary.json", summary)
        table = summary_markdown(summary)
        atomic_write_text(run_dir / "demo_summary.md", table)
        print(table)
    return 0 if summary.get("audit_exit") in (None, 0) and summary.get("selfcheck_exit") in (None, 0) else 1


def draft_start(cfg: DemoConfig, budget: Budget) -> tuple[str, int]:
    """(the draft's init spec, its frozen layers): ``--draft-init`` with ``truncate:N`` made the target's, else
    the budget's recipe for the embedded target, else the first half of the target's layers."""
    embedded = cfg.target == DEFAULT_TARGET
    init = cfg.draft_init
    if init is None and embedded:
        init = budget.draft_init
    if init is None:
        layers = int(model_summary(cfg.target)["layers"])
        init = f"truncate:{max(1, layers // 2)}"
    if init.startswith("truncate:") and init.count(":") == 1:  # truncate:N names the target's layers
        init = "truncate:{target}:" + init.removeprefix("truncate:")
    init = init.replace("{target}", cfg.target)
    frozen = cfg.freeze_layers if cfg.freeze_layers is not None else (budget.freeze_layers if embedded else 0)
    return init, frozen


def _pipeline(cfg: DemoConfig, budget: Budget, run_dir: Path, init_spec: str, frozen: int,
              models: PipelineModels) -> dict[str, Any]:
    eval_set, eval_kind = (cfg.eval_set, "the --eval-set file") if cfg.eval_set else _default_eval_set()
    manifest = cfg.manifest or _default_manifest()

    prompts_cfg = PromptsConfig(manifest=manifest, out=str(run_dir / "prompts" / "prompts.jsonl"),
                                tokenizer=cfg.target, eval_set=[eval_set])
    _stage(run_dir, "prompts", prompts_cfg.to_json_dict(),
           lambda: {"total": build_prompts(prompts_cfg).total})

    traces_cfg = TracesConfig(target=cfg.target, prompts=run_dir / "prompts" / "prompts.jsonl",
                              out=run_dir / "traces" / "traces.jsonl", max_new_tokens=budget.trace_tokens,
                              limit=budget.trace_prompts, device=cfg.device)
    _stage(run_dir, "traces", traces_cfg.to_json_dict(), lambda: {"rows": run_traces(traces_cfg).rows})

    val_cfg = ValidationConfig(target=cfg.target, prompts=Path(eval_set),
                               out=run_dir / "validation" / "validation.jsonl",
                               max_new_tokens=budget.val_tokens, limit=budget.val_prompts, device=cfg.device)
    _stage(run_dir, "validation", val_cfg.to_json_dict(), lambda: {"rows": run_validation(val_cfg).rows})

    pack_cfg = PackConfig(checkpoint=str(run_dir / "draft"), out=str(run_dir / "model"), overwrite=True,
                          **({"fit": "gptq", "calibration": str(run_dir / "traces" / "traces.jsonl")}
                             if budget.gptq else {}))
    train_cfg = TrainConfig(traces=str(run_dir / "traces" / "traces.jsonl"), init=init_spec,
                            out=str(run_dir / "draft"), target=cfg.target, epochs=budget.epochs, lr=budget.lr,
                            freeze_layers=frozen, threads=cfg.threads, eval_every=budget.eval_every,
                            qat_group_size=pack_cfg.group_size if budget.qat else None)
    _stage(run_dir, "train", train_cfg.to_json_dict(), lambda: _train_result(run_train(train_cfg)))

    def write_init():
        source = save_init(init_spec, run_dir / "init")
        atomic_write_json(run_dir / "init" / "init_source.json", source)
        return {"init": init_spec}
    _stage(run_dir, "init", {"init": init_spec}, write_init)

    _stage(run_dir, "pack", pack_cfg.to_json_dict(), lambda: {"bytes": run_pack(pack_cfg).bytes})

    # The trained draft for llama.cpp (`llama-server -md`), or for transformers / vLLM where the GGUF writer does
    # not cover the architecture; the audit follows its record back to the pack.
    export_cfg = (ExportConfig(model_dir=str(run_dir / "model"), format="gguf",
                               out=str(run_dir / "export" / "draft.gguf"), overwrite=True) if models.gguf_export else
                  ExportConfig(model_dir=str(run_dir / "model"), format="hf", out=str(run_dir / "export" / "hf"),
                               overwrite=True))
    export = _stage(run_dir, "export", {**export_cfg.to_json_dict(), "pack": pack_cfg.to_json_dict(),
                               "train": train_cfg.to_json_dict()},
           lambda: _export_result(run_export(export_cfg)))

    # The reference draft no training makes: the target's own weights, packed (SELF_DRAFT_EMBEDDING).
    self_cfg = PackConfig(checkpoint=cfg.target, out=str(run_dir / "model_self"), overwrite=True,
                          embedding_encoding=SELF_DRAFT_EMBEDDING)
    _stage(run_dir, "pack_self", self_cfg.to_json_dict(), lambda: {"bytes": run_pack(self_cfg).bytes})

    validation = run_dir / "validation" / "validation.jsonl"
    reports: dict[str, dict] = {}
    # Acceptance at temperature for every drafter of the summary's table (the target loaded by each eval)
    for name, kwargs in (("init", {"model_dir": run_dir / "init"}), ("lookup", {"lookup": True}),
                         ("self", {"model_dir": run_dir / "model_self", "threads": cfg.threads})):
        ecfg = EvalConfig(validation=validation, out=run_dir / "eval" / name, device=cfg.device, target=cfg.target,
                          **kwargs)
        _stage(run_dir, f"eval_{name}", ecfg.to_json_dict(), lambda ecfg=ecfg: run_eval(ecfg))
        reports[name] = read_json(run_dir / "eval" / name / "report.json")

    # The trained draft is measured the way it ships: packed, behind the HTTP server.
    def eval_served():
        server = ServerProcess(run_dir / "model", run_dir / "eval" / "served_server.log",
                               ["--device", cfg.device, *(["--threads", str(cfg.threads)] if cfg.threads else [])])
        try:
            ok, detail = server.wait_ready(300)
            if not ok:
                raise RuntimeError(f"draft server did not start: {detail}")
            # at temperature: the distributions of the pack the server serves, loaded here as it runs it (the
            # compute its /health says)
            ecfg = EvalConfig(validation=validation, server=server.url, out=run_dir / "eval" / "trained",
                              pack_dir=run_dir / "model", target=cfg.target, device=cfg.device, threads=cfg.threads)
            exit_code = run_eval(ecfg)
            # The same server behind prompt lookup (the lookup runs here, in the client, never in the server).
            hcfg = EvalConfig(validation=validation, server=server.url, out=run_dir / "eval" / "trained_lookup",
                              hybrid_min_ngram=DEFAULT_HYBRID_MIN_NGRAM, pack_dir=run_dir / "model",
                              target=cfg.target, device=cfg.device, threads=cfg.threads)
            return max(exit_code, run_eval(hcfg))
        finally:
            server.stop()
    _stage(run_dir, "eval_trained", {"model": str(run_dir / "model"), "validation": str(validation),
                                     "train": train_cfg.to_json_dict(), "hybrid_min_ngram": DEFAULT_HYBRID_MIN_NGRAM,
                                     "temperatures": EvalConfig.model_fields["temperatures"].default},
           eval_served)
    reports["trained"] = read_json(run_dir / "eval" / "trained" / "report.json")
    reports["trained_lookup"] = read_json(run_dir / "eval" / "trained_lookup" / "report.json")

    # CPU time is steady on a shared machine when one thread runs the models
    clock = "cpu" if cfg.threads == 1 else "wall"
    spec_cfg = SpeculateConfig(target=cfg.target, draft=str(run_dir / "model"), prompts=Path(eval_set),
                               out=run_dir / "speculate", max_new_tokens=budget.spec_tokens, k=budget.spec_k,
                               num_prompts=budget.spec_prompts, threads=cfg.threads, repeats=budget.spec_repeats,
                               also_draft=[f"self={run_dir / 'model_self'}"],
                               draft_compile="on" if budget.compile_drafts else "off", clock=clock,
                               predict=budget.predict, device=cfg.device)
    _stage(run_dir, "speculate", {**spec_cfg.to_json_dict(), "train": train_cfg.to_json_dict(),
                                  "pack_self": self_cfg.to_json_dict()},
           lambda: run_speculate(spec_cfg))
    speculate = read_json(run_dir / "speculate" / "speculate.json")

    # The same prompts in llama.cpp, the engine CPU users decode with: the exported draft against the target's
    # own GGUF file, where the extra is installed and the target brings that file.
    llama_skipped = _llama_cpp_unavailable(cfg)
    speculate_llama = None
    if llama_skipped is None:
        llama_cfg = SpeculateConfig(engine="llama.cpp", target=cfg.target, draft=str(run_dir / "export" / "draft.gguf"),
                                    prompts=Path(eval_set), out=run_dir / "speculate_llama_cpp",
                                    max_new_tokens=budget.spec_tokens, k=budget.llama_k,
                                    num_prompts=budget.spec_prompts, threads=cfg.threads,
                                    repeats=budget.spec_repeats, full_precision=budget.llama_full_precision,
                                    clock=clock)
        _stage(run_dir, "speculate_llama_cpp", {**llama_cfg.to_json_dict(), "export": export_cfg.to_json_dict(),
                                                "pack": pack_cfg.to_json_dict(), "train": train_cfg.to_json_dict(),
                                                "llama_cpp_python": llama_cpp_version()},
               lambda: run_speculate(llama_cfg))
        speculate_llama = _speculate_summary(read_json(run_dir / "speculate_llama_cpp" / "speculate.json"))

    sc_cfg = SelfcheckConfig(model_dir=run_dir / "model", out=run_dir / "selfcheck", threads=cfg.threads)
    selfcheck_exit = run_selfcheck(sc_cfg)  # always rerun: it checks the files as they are now

    audit_exit = None
    if cfg.audit:
        audit_exit = run_audit(AuditConfig(run_dir=str(run_dir)))

    arch = read_json(run_dir / "model" / "architecture.json")
    arch_self = read_json(run_dir / "model_self" / "architecture.json")
    return {
        "budget": cfg.budget,
        "target": cfg.target,
        "manifest": manifest or "the prompt corpus shipped in the package",
        "eval_set": {"path": eval_set, "kind": eval_kind},
        "data": _data_facts(run_dir),
        "draft_init": init_spec,
        "frozen_layers": frozen,
        "models": models.to_json(),
        "hybrid_min_ngram": DEFAULT_HYBRID_MIN_NGRAM,
        "acceptance": {name: _acceptance(r) for name, r in reports.items()},
        "draft_latency": reports["trained"].get("latency"),
        "compute": _compute_choices(reports, speculate),
        "speculate": _speculate_summary(speculate),
        "speculate_llama_cpp": speculate_llama,
        "llama_cpp_not_measured": llama_skipped,
        "pack": {"bytes": arch["bytes"], "parameters": arch["parameters"]},
        "pack_self": {"bytes": arch_self["bytes"], "parameters": arch_self["parameters"]},
        "export": export,
        "selfcheck_exit": selfcheck_exit,
        "audit_exit": audit_exit,
    }


def _compute_choices(reports: dict[str, dict], speculate: dict) -> dict[str, Any]:
    """What each model-running step computed its draft in, and why (auto: measured on this machine at load)."""
    out = {f"eval {name}": compute_choice_of(report.get("drafter_source") or {}) for name, report in reports.items()}
    out.update({f"speculate {name}": source.get("compute_choice")
                for name, source in (speculate.get("drafter_sources") or {}).items()})
    return {where: {"compute": c["compute"], "prefill": c.get("prefill"), "reason": c["reason"]}
            for where, c in out.items() if c}


def _export_result(result) -> dict:
    record = read_json(result.record)
    out = Path(result.out)
    files = [f for f in out.rglob("*") if f.is_file()] if out.is_dir() else [out]
    return {"path": str(out), "format": record.get("format", "gguf"), "bytes": sum(f.stat().st_size for f in files),
            "exact": result.exact,
            "tensors": len(record.get("tensors", [])), "not_exact": len(record.get("not_exact", []))}


def _train_result(meta: dict) -> dict:
    return {"best": meta.get("best"), "steps": meta.get("steps")}


def _llama_cpp_unavailable(cfg: DemoConfig) -> dict[str, str] | None:
    """Why the llama.cpp speculation cannot run here and how to run it, or None when it can."""
    if not llama_cpp_available():
        return {"why": "llama-cpp-python is not installed",
                "how": "`make install-llama`, then `make demo` again (it skips the finished stages), measures it here"}
    if not cfg.target.startswith("embedded:"):
        return {"why": f"the target {cfg.target} brings no GGUF file of its own (only an embedded target does)",
                "how": "`specdraft speculate --engine llama.cpp --target-gguf FILE --draft RUN_DIR/export/draft.gguf` "
                       "measures it with the target's GGUF file"}
    return None


def _data_facts(run_dir: Path) -> dict[str, Any]:
    """What the draft saw: prompts kept and dropped, traces and their tokens, training steps, tokens and time."""
    stats = read_json(run_dir / "prompts" / "prompts.stats.json")
    traces = read_json(run_dir / "traces" / "traces.summary.json")
    meta = read_json(run_dir / "draft" / "train_meta.json")
    validation = read_json(run_dir / "validation" / "validation.summary.json")
    dropped: dict[str, int] = {}
    for corpus in stats.get("corpora", {}).values():
        for reason, n in (corpus.get("dropped") or {}).items():
            dropped[reason] = dropped.get(reason, 0) + n
    return {
        "prompts_read": sum(c.get("read", 0) for c in stats.get("corpora", {}).values()),
        "prompts_kept": stats.get("total"),
        "prompts_dropped": {k: v for k, v in dropped.items() if v},
        "corpora": len(stats.get("corpora", {})),
        "traces": traces.get("rows"),
        "trace_completion_tokens": traces.get("completion_tokens"),
        "train_examples": (meta.get("traces") or {}).get("train"),
        "heldout_examples": (meta.get("traces") or {}).get("heldout"),
        "train_steps": meta.get("steps"),
        # over every sitting of a resumed training (older records have only the last sitting's)
        "train_tokens": meta.get("train_tokens", meta.get("train_tokens_this_run")),
        "train_seconds": meta.get("train_seconds", meta.get("seconds_this_run")),
        "train_resumed_from_step": meta.get("resumed_from_step"),
        "eval_points": validation.get("points"),
        "eval_prompts": validation.get("prompts"),
    }


def _acceptance(report: dict) -> dict:
    keys = ("mean_accepted_pooled", "mean_accepted_per_prompt", "points")
    source = report.get("acceptance", report)
    section = report.get("acceptance_at_temperature") or {}
    return {**{k: source.get(k) for k in keys},
            "at_temperature": {key: row["mean_expected_accepted_pooled"]
                               for key, row in (section.get("temperatures") or {}).items()}}


def _speculate_summary(spec: dict) -> dict:
    """One engine's speculation report as the summary reads it: the engine and its baseline, each drafter's best
    k with its measured and predicted speed-up, the prediction's verdict, and a full-precision table alike."""
    config, prediction = spec.get("config") or {}, spec.get("prediction") or {}
    predicted = prediction.get("drafters") or {}
    passes = (prediction.get("costs") or {}).get("pass_seconds")
    costs = TargetCosts({int(n): s for n, s in passes.items()}) if passes else None
    out: dict[str, Any] = {
        "engine": spec.get("engine", "torch"), "exact_engine": spec.get("exact_engine", True),
        "target_dtype": config.get("dtype"), "target_file": (spec.get("target") or {}).get("gguf"),
        "llama_cpp_python": spec.get("llama_cpp_python"), "threads": spec.get("threads"),
        "baseline_tokens_per_s": spec.get("baseline", {}).get("tokens_per_s"), "prompts": spec.get("prompts"),
        "repeats": spec.get("repeats", 1), "max_new_tokens": config.get("max_new_tokens"),
        "clock": spec.get("clock"), "lossless": spec.get("lossless"),
        "drafters": {name: _drafter_summary(drafter, predicted.get(name) or {}, costs)
                     for name, drafter in spec.get("drafters", {}).items()},
        "prediction_verdict": prediction.get("verdict") or []}
    if spec.get("full_precision"):
        out["full_precision"] = _speculate_summary(spec["full_precision"])
    return out


def _drafter_summary(drafter: dict, predicted: dict[str, dict], costs: TargetCosts | None) -> dict:
    """A drafter at its best k (the fastest pooled over passes); ``predicted``: the prediction's rows by k, with
    the target's measured pass ``costs`` the most it could reach were every drafted token accepted (at its draft
    cost per token over k, as the prediction's verdict reckons it)."""
    best_k = drafter.get("best_k")
    best = drafter.get("per_k", {}).get(str(best_k), {})
    predictions = [row["predicted_speedup"] for row in predicted.values() if row.get("predicted_speedup") is not None]
    draft_costs = [row["draft_cost_per_token_vs_target_step"] for row in predicted.values()
                   if row.get("draft_cost_per_token_vs_target_step")]
    draft_cost = statistics.median(draft_costs) if draft_costs else None
    ceilings = [ceiling(costs, int(k), draft_cost) for k in predicted] if costs and draft_cost else []
    return {"best_k": best_k, "tokens_per_s": drafter.get("best_tokens_per_s"), "speedup": drafter.get("best_speedup"),
            "speedup_median": best.get("speedup_median", drafter.get("best_speedup")),
            "speedup_range": best.get("speedup_range"), "accepted_per_step": best.get("accepted_per_step"),
            "predicted_speedup": best.get("predicted_speedup"),
            "best_predicted_speedup": max(predictions) if predictions else None,
            "all_accepted_speedup": max(ceilings) if ceilings else None,
            "draft_cost_per_token": draft_cost,
            "equal_to_plain_greedy": best.get("equal_to_plain_greedy")}


# -------------------------------------------------------------------------------------------- summary

# What each drafter is, in one line (the names speculate gives them -> the eval reports' names)
DRAFTERS = {
    "trained": ("trained draft", "the draft after training, packed to 4 bits and served over HTTP (`POST /draft`)"),
    "trained_lookup": ("trained draft behind lookup", "prompt lookup where the context's last tokens occurred before, "
                                                      "the trained draft elsewhere"),
    "lookup": ("prompt lookup", "no model: copies what followed the context's last tokens where they occurred before"),
    "self": ("self-draft", "the target's own weights packed to 4 bits, untrained: the CPU reference"),
    "init": ("untrained init", "the draft before training (the target's layers it keeps, unchanged)"),
}
# The temperatures the acceptance table has a column for: eval's own (temperature 0 is the greedy column)
SUMMARY_TEMPERATURES = [temperature_key(t) for t in EvalConfig.model_fields["temperatures"].default if t > 0]
SPECULATE_NAMES = {"draft": "trained", "draft+lookup": "trained_lookup", "lookup": "lookup", "self": "self"}
# What each drafter is in llama.cpp (the names `speculate --engine llama.cpp` gives them)
LLAMA_CPP_DRAFTERS = {
    "draft": ("trained draft", "the trained draft as exported for llama.cpp (`RUN_DIR/export/draft.gguf`)"),
    "draft+lookup": ("trained draft behind lookup", "prompt lookup where it finds the context's last tokens, the "
                                                    "exported draft elsewhere"),
    "self": ("self-draft", "the target's own GGUF file (its 4-bit weights) as its draft"),
    "ngram": ("n-gram lookup", "llama-cpp-python's own prompt lookup (LlamaPromptLookupDecoding)"),
    "lookup": ("prompt lookup", "specdraft's prompt lookup, as in the table above"),
    "self-4bit": ("4-bit self-draft", "the target's own 4-bit file drafting for the target at F32"),
}
# BENCHMARKS.md's blocks the summary quotes: what each budget reaches, and the speed in llama.cpp
BUDGETS_BLOCK = "demo-budgets"
LLAMA_CPP_BLOCK = "llama-cpp-speed"


def benchmarks_block(name: str) -> str | None:
    """BENCHMARKS.md's text between ``<!-- name -->`` and ``<!-- /name -->`` (the one place those figures live),
    when the file and the block are here."""
    try:
        text = BENCHMARKS.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(rf"<!-- {re.escape(name)} -->\n(.*?)\n<!-- /{re.escape(name)} -->", text, re.S)
    return m.group(1).strip() if m else None


def _missing_block(name: str) -> str:
    return f"(No `{name}` block in a BENCHMARKS.md beside this installation: see the repository's BENCHMARKS.md.)"


def _label(spec: dict, name: str) -> str:
    if spec["engine"] == "llama.cpp":
        return LLAMA_CPP_DRAFTERS.get(name, (name,))[0]
    return DRAFTERS.get(SPECULATE_NAMES.get(name, ""), (name,))[0]


def _engine_name(spec: dict) -> str:
    if spec["engine"] == "llama.cpp":
        return "llama.cpp"
    return f"specdraft's own engine ({spec['engine']}, {spec.get('target_dtype')} target)"


def _baseline_name(spec: dict) -> str:
    return "llama.cpp's plain decoding" if spec["engine"] == "llama.cpp" else "its own plain greedy decoding"


def _pays(row: dict, repeats: int) -> bool:
    """Faster than the engine's plain decoding: the median, and over several passes the whole range, above 1x."""
    if not (row.get("speedup_median") or 0) > 1:
        return False
    return repeats <= 1 or not row.get("speedup_range") or row["speedup_range"][0] > 1


def _passes(spec: dict) -> str:
    """Over how many passes a drafter was seen to beat plain decoding."""
    repeats = spec.get("repeats", 1)
    return f" in each of the {repeats} passes" if repeats > 1 else " in its one pass (the machine's noise not measured)"


def _speed_findings(spec: dict) -> list[str]:
    """The fastest drafter in one engine, and which drafters (if any) beat its plain decoding."""
    rows, engine, baseline = spec["drafters"], _engine_name(spec), _baseline_name(spec)
    name, best = max(rows.items(), key=lambda kv: kv[1]["speedup_median"] or 0)
    rng = best.get("speedup_range")
    lines = [f"Fastest in {engine}: the {_label(spec, name)}, {best['speedup_median']:.2f}x {baseline} (k = "
             f"{best['best_k']}" + (f", range {rng[0]:.2f}x to {rng[1]:.2f}x" if rng else "") + ")."]
    paying = [f"the {_label(spec, n)}" for n, r in rows.items() if _pays(r, spec.get("repeats", 1))]
    if paying:
        named = paying[0] if len(paying) == 1 else ", ".join(paying[:-1]) + " and " + paying[-1]
        lines.append(f"In {engine} {named} beat{'s' if len(paying) == 1 else ''} {baseline}{_passes(spec)}.")
    else:
        lines.append(f"In {engine} no drafter beats {baseline}{_passes(spec)}.")
    return lines


def _trained_against_lookup(spec: dict) -> list[str]:
    """The trained draft, alone and behind lookup, against prompt lookup in speed, and whether each difference is
    bigger than the spread over passes."""
    rows = spec["drafters"]
    if "lookup" not in rows:
        return []
    lk = rows["lookup"]
    lk_low, lk_high = lk["speedup_range"] or (None, None)
    spread = f" over {spec['repeats']} passes" if spec.get("repeats", 1) > 1 else ""
    lines = []
    for name in ("draft", "draft+lookup"):
        if name not in rows:
            continue
        t = rows[name]
        t_low, t_high = t["speedup_range"] or (None, None)
        overlap = t_low is not None and lk_low is not None and t_low <= lk_high and lk_low <= t_high
        compare = ("level with" if overlap else "faster than" if t["speedup_median"] > lk["speedup_median"]
                   else "slower than")
        lines.append(f"In {_engine_name(spec)} the {_label(spec, name)} ({t['speedup_median']:.2f}x) is {compare} "
                     f"prompt lookup ({lk['speedup_median']:.2f}x)"
                     + (f": their ranges{spread} overlap, so the difference is within the noise of "
                        f"{spec.get('prompts')} prompts" if overlap else "") + ".")
    return lines


def _llama_cpp_findings(spec: dict) -> list[str]:
    """What the llama.cpp run says beyond its speed-ups: whether any drafter can pay there, measured and
    predicted from its costs, and the target at full precision."""
    rows, lines = spec["drafters"], []
    measured = {n: r["speedup_median"] or 0 for n, r in rows.items()}
    predicted = {n: r["best_predicted_speedup"] for n, r in rows.items() if r.get("best_predicted_speedup")}
    if predicted:
        top_measured, top_predicted = max(measured, key=measured.get), max(predicted, key=predicted.get)
        if max(measured.values()) <= 1 and max(predicted.values()) <= 1:
            lines.append(f"In llama.cpp no drafter can pay on this machine: every drafter's best speed-up, measured "
                         f"and predicted from the measured costs, is at most 1x (best measured: the "
                         f"{_label(spec, top_measured)}, {measured[top_measured]:.2f}x; best predicted: the "
                         f"{_label(spec, top_predicted)}, {predicted[top_predicted]:.2f}x).")
        else:
            lines.append(f"In llama.cpp the measured costs predict the most from the {_label(spec, top_predicted)}: "
                         f"{predicted[top_predicted]:.2f}x (measured {measured[top_predicted]:.2f}x).")
    full = spec.get("full_precision")
    for name, row in (full or {}).get("drafters", {}).items():
        pays = _pays(row, full.get("repeats", 1))
        lines.append(f"Against the target at F32 in llama.cpp the {_label(full, name)} gives "
                     f"{row['speedup_median']:.2f}x llama.cpp's plain decoding of the F32 file: "
                     + (f"it pays{_passes(full)}." if pays else "it does not pay."))
    return lines


def _trained_draft_costs(spec: dict) -> list[str]:
    """Where the trained draft does not pay in an engine: whether its draft cost leaves it any room to (the most
    it could reach with every drafted token accepted), or its acceptance falls short."""
    row = spec["drafters"].get("draft")
    if not row or _pays(row, spec.get("repeats", 1)) or row.get("all_accepted_speedup") is None:
        return []
    cost = (f"a drafted token costs it {row['draft_cost_per_token']:.2f}x a target step, so with every token "
            f"accepted it would reach at most {row['all_accepted_speedup']:.2f}x")
    if row["all_accepted_speedup"] <= 1:
        return [f"In {_engine_name(spec)} the trained draft cannot pay whatever it accepts: {cost}. A draft pays "
                "where its tokens cost a small share of a target step: a draft much smaller than its target, the "
                "premise of the GPU reference pair (README.md)."]
    return [f"In {_engine_name(spec)} it is the trained draft's acceptance that falls short: {cost}, and it keeps "
            f"{_fmt(row['accepted_per_step'], 2)} drafted tokens per step."]


def verdict(summary: dict) -> list[str]:
    """The findings in plain words, computed from what was measured: the fastest drafter in each engine and
    whether any beats that engine's plain decoding, the trained draft against its init and against lookup (and
    whether a difference in speed is bigger than the spread over passes), and what llama.cpp's measured costs
    say can pay there."""
    acc, lines = summary["acceptance"], []
    trained, init, lookup = (acc.get(n, {}).get("mean_accepted_pooled") for n in ("trained", "init", "lookup"))
    if trained is not None and init is not None:
        lines.append(f"Training moved the draft from {init:.2f} to {trained:.2f} accepted tokens of 16 "
                     f"({trained - init:+.2f}); prompt lookup accepts {lookup:.2f}." if lookup is not None else
                     f"Training moved the draft from {init:.2f} to {trained:.2f} accepted tokens of 16.")
    for spec in (summary.get("speculate"), summary.get("speculate_llama_cpp")):
        if spec and spec.get("drafters"):
            lines += _speed_findings(spec) + _trained_against_lookup(spec) + _trained_draft_costs(spec)
            if spec["engine"] == "llama.cpp":
                lines += _llama_cpp_findings(spec)
    return lines


def _speed_table(spec: dict) -> list[str]:
    """One engine's speed-ups: plain decoding first, then each drafter at its best k."""
    exact = spec.get("exact_engine", True)
    head = "| drafter | best k | speed-up (median) | range over passes | predicted | accepted per step |"
    rule = "|---|---|---|---|---|---|"
    if not exact:
        head, rule = head + " = plain greedy | what it is |", rule + "---|---|"
    lines = [head, rule, f"| {'plain decoding' if spec['engine'] == 'llama.cpp' else 'plain greedy'} | - | 1.00x "
                         f"({_fmt(spec.get('baseline_tokens_per_s'), 1)} tokens/s) | - | - | - |"
                         + ("" if exact else " - | - |")]
    for name, row in spec["drafters"].items():
        rng, predicted, equal = row.get("speedup_range"), row.get("predicted_speedup"), row.get("equal_to_plain_greedy")
        line = (f"| {_label(spec, name)} | {row['best_k']} | {_fmt(row['speedup_median'], 2)}x | "
                f"{f'{rng[0]:.2f}x to {rng[1]:.2f}x' if rng else '-'} | "
                f"{f'{predicted:.2f}x' if predicted is not None else '-'} | {_fmt(row['accepted_per_step'], 2)} |")
        if not exact:
            line += (f" {f'{equal:.0%}' if equal is not None else '-'} | "
                     f"{LLAMA_CPP_DRAFTERS.get(name, (name, '-'))[1]} |")
        lines.append(line)
    return lines


def _llama_cpp_section(summary: dict) -> list[str]:
    """Speed in llama.cpp: measured in this run, or quoted from BENCHMARKS.md with how to measure it here."""
    lines = ["## Speed in llama.cpp (the engine CPU users run)", ""]
    spec = summary.get("speculate_llama_cpp")
    if not spec:
        skipped = summary.get("llama_cpp_not_measured") or {}
        why = f"Not measured in this run: {skipped.get('why')}. {skipped.get('how')}."
        if not summary.get("embedded_target", True):
            return lines + [why]
        return lines + [why + " What it gave on a named machine (BENCHMARKS.md):", "",
                        summary.get("llama_cpp_reference") or _missing_block(LLAMA_CPP_BLOCK)]
    target = Path(spec["target_file"]).name if spec.get("target_file") else "the target's GGUF file"
    threads = spec.get("threads")
    lines += [f"llama-cpp-python {spec.get('llama_cpp_python')}, the target's own file `{target}`, "
              f"{threads} thread{'' if threads == 1 else 's'}; {spec.get('prompts')} prompts x "
              f"{spec.get('max_new_tokens')} tokens, {spec.get('repeats', 1)} pass(es), {spec.get('clock')} clock. "
              "Speed-up = tokens/s over llama.cpp's plain decoding of the same file in the same run; predicted = "
              "from the target's measured pass costs and a replay of each drafter "
              "(`speculate_llama_cpp/speculate.md`); = plain greedy = the share of outputs equal to llama.cpp's "
              "plain decoding (its multi-token passes may round differently from its one-token passes, by design).",
              ""] + _speed_table(spec)
    full = spec.get("full_precision")
    if full:
        f32 = Path(full["target_file"]).name if full.get("target_file") else "F32"
        lines += ["", f"The target at full precision (`{f32}`, llama.cpp's quantize of its own file) against its "
                      "own 4-bit file as its draft, same prompts:", ""] + _speed_table(full)
    if spec.get("prediction_verdict"):
        lines += ["", "What the measured costs predict (`drafting.prediction`):", ""]
        lines += [f"- {line}" for line in spec["prediction_verdict"]]
    return lines


def summary_markdown(summary: dict) -> str:
    acc, spec, data = summary["acceptance"], summary["speculate"], summary.get("data") or {}
    dropped = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in sorted(data.get("prompts_dropped", {}).items()))
    lines = [f"# specdraft demo ({summary['budget']} budget) -- target {summary['target']}", "",
             "## What the draft saw", "",
             f"- Data: {data.get('prompts_kept')} prompts kept of {data.get('prompts_read')} read from "
             f"{data.get('corpora')} corpora ({summary['manifest']})" + (f"; dropped: {dropped}" if dropped else "")
             + ".",
             f"- Traces: the target's greedy answers to {data.get('traces')} of them "
             f"({data.get('trace_completion_tokens')} tokens); {data.get('train_examples')} trained on, "
             f"{data.get('heldout_examples')} held out to pick the best checkpoint.",
             f"- Training: {data.get('train_steps')} steps over {data.get('train_tokens')} tokens in "
             f"{_fmt_seconds(data.get('train_seconds'))}{_describe_resume(data)}; the draft starts as "
             f"{_describe_init(summary)}.",
             f"- Evaluation: {data.get('eval_points')} points (a context and the target's next 16 tokens) from "
             f"{data.get('eval_prompts')} prompts of {summary['eval_set']['kind']} "
             f"({summary['eval_set']['path']}), never trained on.", "",
             "## Acceptance: how many of 16 drafted tokens the target keeps", "",
             "| drafter | accepted of 16 (pooled over points) | per-prompt mean | "
             + "".join(f"sampling at T = {key} | " for key in SUMMARY_TEMPERATURES) + "what it is |",
             "|---|---|---|" + "---|" * len(SUMMARY_TEMPERATURES) + "---|"]
    for name in ("init", "trained", "lookup", "trained_lookup", "self"):
        if name in acc:
            a = acc[name]
            what = DRAFTERS[name][1]
            if name == "init" and not summary["draft_init"].startswith("truncate:"):
                what = f"the draft before training: `{summary['draft_init']}` as loaded"
            at = a.get("at_temperature") or {}
            lines.append(f"| {DRAFTERS[name][0]} | {_fmt(a.get('mean_accepted_pooled'), 2)} | "
                         f"{_fmt(a.get('mean_accepted_per_prompt'), 2)} | "
                         + "".join(f"{_fmt(at[key], 2) if key in at else '-'} | " for key in SUMMARY_TEMPERATURES)
                         + f"{what} |")
    lines += ["", "Sampling at temperature T: the expected accepted length of speculative sampling (target and "
                  "draft warped alike), computed from their distributions along each point's greedy continuation "
                  "(`eval/*/report.md`); the trained draft's from the pack the server serves, loaded in process."]
    latency = summary.get("draft_latency") or {}
    lines += ["", "A 16-token draft over HTTP (eval clients, 8 concurrent): "
                  f"p50 {_fmt(latency.get('p50_ms'), 0)} ms, p99 {_fmt(latency.get('p99_ms'), 0)} ms."]
    choices = summary.get("compute") or {}
    if choices:
        lines += ["", "Draft compute (`--compute auto` measures the formats on this CPU at load and keeps the "
                      "fastest for each step's work):", ""]
        lines += [f"- {where}: **{c['compute']}**" + (f", {c['prefill']} prefill" if c["compute"] == "int4" else "")
                  + f" ({c['reason']})" for where, c in choices.items()]
    lines += ["",
              f"## Speed in {_engine_name(spec)}, against its own plain greedy decoding", "",
              f"{spec.get('prompts')} prompts x {spec.get('max_new_tokens')} tokens, {spec.get('repeats', 1)} "
              f"pass(es), {spec.get('clock')} clock; every output equal to plain greedy: "
              f"{'yes' if spec.get('lossless') else 'NO'}. Speed-up = tokens/s over specdraft's plain greedy "
              "decoding of the same target in the same loop and run; the median and range are over the passes; "
              "predicted = from the target's measured pass costs and a replay of each drafter "
              "(`speculate/speculate.md`).", ""] + _speed_table(spec)
    lines += [""] + _llama_cpp_section(summary)
    lines += ["", "## Verdict", ""] + [f"- {line}" for line in verdict(summary)]
    if summary.get("embedded_target", True):
        lines += ["", "## What the larger budgets reach", "",
                  "`make demo BUDGET=default` or `BUDGET=full` (figures from BENCHMARKS.md, with their machine):", "",
                  summary.get("budget_reference") or _missing_block(BUDGETS_BLOCK)]
    self_pack = summary.get("pack_self") or {}
    lines += ["", "## Files and checks", "",
              f"Pack: {summary['pack']['bytes']} bytes, {summary['pack']['parameters']} parameters (self-draft: "
              f"{self_pack.get('bytes')} bytes, {self_pack.get('parameters')} parameters). "
              f"{_describe_export(summary.get('export'))}"
              f"Selfcheck exit {summary['selfcheck_exit']}, audit exit {summary['audit_exit']}. "
              f"Wall time: {_fmt_seconds(summary.get('wall_seconds'))}{_describe_earlier(summary)}."]
    lines += _stage_times(summary)
    return "\n".join(lines) + "\n"


def _stage_times(summary: dict) -> list[str]:
    """Each stage's seconds beside what the machine probe expected of it before the run (``demo.plan``)."""
    took, expected_plan = summary.get("stage_seconds") or {}, summary.get("plan") or {}
    expected = expected_plan.get("expected_seconds") or {}
    if not took:
        return []
    speed = expected_plan.get("speed_vs_reference")
    lines = ["", "## Where the time went", "",
             (f"Expected from a probe of this machine before the first stage (it ran the probe {speed:.2f}x as fast "
              f"as the reference, {expected_plan.get('reference_machine')}; `demo/plan.py`):" if speed else
              "No reference run to expect from."), "",
             "| stage | expected | took |", "|---|---:|---:|"]
    for stage in STAGES:
        if stage in took:
            lines.append(f"| {stage} | {_fmt_seconds(expected[stage]) if stage in expected else '-'} | "
                         f"{_fmt_seconds(took[stage])} |")
    return lines


def _describe_export(export: dict | None) -> str:
    if not export:
        return ""
    exact = ("every tensor holds the pack's values exactly" if export.get("exact") else
             f"{export.get('not_exact')} of {export.get('tensors')} tensors not exactly the pack's values")
    gguf = export.get("format", "gguf") == "gguf"
    engines = "GGUF for llama.cpp" if gguf else "Hugging Face dir for transformers / vLLM"
    return (f"{engines}: `{export.get('path')}`, {export.get('bytes')} bytes, {exact} "
            "(docs/exports.md). ")


def _describe_resume(data: dict) -> str:
    step = data.get("train_resumed_from_step")
    return f" over its sittings (resumed at step {step} after an interruption)" if step else ""


def _describe_earlier(summary: dict) -> str:
    earlier = summary.get("stages_done_earlier")
    if not earlier:
        return ""
    return (f" for this invocation, which skipped {len(earlier)} stages an earlier one finished "
            f"({', '.join(earlier)}; their times are in demo.log)")


def _fmt(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else str(x)


def _describe_init(summary: dict) -> str:
    """``truncate:SPEC:0,1,...`` in words: how many of the target's layers the draft keeps, and which are frozen."""
    init, frozen = summary["draft_init"], summary.get("frozen_layers")
    if not init.startswith("truncate:"):
        return init
    layers = init.rpartition(":")[2].split(",")
    kept = f"the target's first {layers[0]} layers" if len(layers) == 1 else f"{len(layers)} of the target's layers"
    return kept + (f", the first {frozen} of them frozen" if frozen else "")


def _fmt_seconds(x) -> str:
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x:.0f} s" if x < 120 else f"{x / 60:.1f} min"
