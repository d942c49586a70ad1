"""`specdraft rehearse`: the reference path (a Qwen3 target, a draft from a smaller Qwen3) through every stage on
the real Qwen3 tokenizer and chat template, with Qwen3-shaped models small enough for 2 CPU cores.

It builds a Qwen3-shaped target (untied head, as Qwen3-8B) and a smaller "pretrained" Qwen3-shaped draft dir
(tied head, as Qwen3-1.7B) around ``../shared/models/qwen3-tokenizer`` (``model.reference``), runs the demo's
pipeline on them (``specdraft demo --target DIR --draft-init DIR``: prompts, traces, validation, train from the
draft dir, pack, GGUF export, evaluation, speculation), then checks what is Qwen3-specific and ends with the
audit. Each check is a row of ``rehearsal_summary.md`` (pass / fail, what was measured); the exit code is 0 only
when every row passes. The figures say nothing about real Qwen3 drafts: the models are stand-ins.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
import torch
from pydantic import Field

from specdraft.audit import AuditConfig, run_audit
from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, atomic_write_text, read_json, read_jsonl
from specdraft.core.layout import RunPaths
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.data.corpus import MANIFEST_FILE, corpus_dir, heldout_path
from specdraft.demo import Budget, DemoConfig, run_demo
from specdraft.drafting.llamacpp import LlamaCppDrafter
from specdraft.model.decode import draft_batch
from specdraft.model.llamacpp import INSTALL_HINT, llama_cpp_available, vocab_compatible, vocab_texts
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.loader import load_draft
from specdraft.model.reference import (
    DRAFT_SHAPE,
    QWEN3_EOS,
    QWEN3_VOCAB_ROWS,
    TARGET_SHAPE,
    FitRecipe,
    build_reference_draft,
    build_reference_target,
)
from specdraft.model.specs import load_config, tokenizer_from_dir
from specdraft.quant import qd4
from specdraft.server.process import ServerProcess
from specdraft.stages.export import ExportConfig, run_export

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
QWEN3_TOKENIZER_DIR = REPO_ROOT.parent / "shared" / "models" / "qwen3-tokenizer"
NON_THINKING_TAIL = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # the generation prompt, thinking off
# the agreement the GGUF export's greedy drafts must reach with the packed draft's (llama.cpp rounds activations)
FIRST_TOKEN_AGREEMENT = 0.95

# Sized for 2 cores: answers of about 20 tokens (one evaluation point each), a short training run from the
# draft dir (nothing frozen: nothing in it is pretrained), one speculation pass, no GPTQ/QAT, no torch.compile.
REHEARSAL_BUDGET = Budget(trace_prompts=160, trace_tokens=32, draft_init="", epochs=3, lr=2e-3, freeze_layers=0,
                          val_prompts=200, val_tokens=32, spec_prompts=4, spec_tokens=32, spec_k=[4, 16],
                          spec_repeats=1, compile_drafts=False, predict=False, llama_k=[4],
                          llama_full_precision=False)


class RehearseConfig(StageConfig):
    out: str = Field("runs/rehearsal", description="run directory (resumable: a rerun skips finished stages)")
    tokenizer: str = Field(str(QWEN3_TOKENIZER_DIR / "tokenizer"),
                           description="the Qwen3 tokenizer dir (tokenizer.json, tokenizer_config.json, "
                                       "chat_template.jinja; ../shared/models/qwen3-tokenizer/tokenizer)")
    llama_vocab: Optional[str] = Field(str(QWEN3_TOKENIZER_DIR / "ggml-vocab-qwen2.gguf"),
                                       description="llama.cpp's own GGUF of Qwen's vocabulary, against which the "
                                                   "export's regular tokens are compared (skipped when absent)")
    fit_steps: int = Field(FitRecipe.steps, ge=1, description="steps that teach the target the template's shape")
    device: str = Field("auto", description="the in-process stages' device: auto, cpu, cuda or cuda:N")
    threads: Optional[int] = Field(None, description="torch CPU threads for the in-process stages")


Check = dict[str, Any]


def run_rehearsal(cfg: RehearseConfig) -> int:
    run_dir = Path(cfg.out)
    tokenizer_dir = Path(cfg.tokenizer)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{tokenizer_dir}: no Qwen3 tokenizer there (tokenizer.json); the rehearsal needs "
                                "../shared/models/qwen3-tokenizer/tokenizer or --tokenizer DIR")
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.time()
    with stage_log(run_dir / "rehearsal.log"):
        target, draft = _reference_models(cfg, run_dir / "reference")
        # the packaged corpus and its held-out families, whatever ../shared holds (its MT-bench too): the target
        # was fitted to answer their kinds of request
        demo_exit = run_demo(DemoConfig(out=str(run_dir), target=str(target), draft_init=str(draft),
                                        manifest=str(MANIFEST_FILE), eval_set=str(heldout_path()),
                                        shared_data=None, device=cfg.device, threads=cfg.threads, audit=False),
                             budget=REHEARSAL_BUDGET, budget_name="rehearsal")
        checks = [_check(f"demo pipeline (exit {demo_exit})", lambda: _row(demo_exit == 0, "selfcheck and every "
                                                                           "stage of `specdraft demo` finished"))]
        checks += [_check(name, fn) for name, fn in (
            ("tokenizer and template", lambda: _tokenizer_check(target)),
            ("traces: non-thinking prompts, answers end at <|im_end|>", lambda: traces_check(run_dir)),
            ("draft init: from_pretrained of the draft dir", lambda: _init_check(run_dir, draft)),
            ("heads: target untied, draft tied", lambda: _heads_check(target, run_dir)),
            ("pack: 151,936-row embedding, bytes = estimate", lambda: _pack_check(run_dir)),
            ("serve: ids up to the embedding size", lambda: _serve_check(run_dir, cfg)),
            ("export: Hugging Face dir", lambda: _hf_export_check(run_dir)),
            ("export: GGUF qwen3 in llama.cpp", lambda: _llama_cpp_check(run_dir, cfg)),
            ("export: GGUF read by transformers (gguf_file=)", lambda: _transformers_gguf_check(run_dir)),
        )]
        audit_exit = run_audit(AuditConfig(run_dir=str(run_dir)))
        checks.append(_row(audit_exit == 0, f"`specdraft audit {run_dir}` exit {audit_exit}", name="audit"))
        summary = {"checks": checks, "passed": all(c["ok"] is not False for c in checks),
                   "demo_summary": str(run_dir / "demo_summary.md"), "wall_seconds": round(time.time() - started, 1),
                   "target": str(target), "draft_init": str(draft), **run_metadata()}
        atomic_write_json(run_dir / "rehearsal_summary.json", summary)
        table = summary_markdown(summary)
        atomic_write_text(run_dir / "rehearsal_summary.md", table)
        print(table)
    return 0 if summary["passed"] else 1


def _reference_models(cfg: RehearseConfig, where: Path) -> tuple[Path, Path]:
    """The target and draft dirs, built once per run dir (their ``reference_model.json`` says how)."""
    target, draft = where / "target", where / "draft"
    recipe = FitRecipe(steps=cfg.fit_steps)
    if not _made_as(target, TARGET_SHAPE, recipe.steps):
        prompts = [(row["category"], row["prompt"]) for f in sorted((corpus_dir() / "train").glob("*.jsonl"))
                   for row in _rows(f)]
        build_reference_target(target, cfg.tokenizer, prompts, TARGET_SHAPE, recipe, log=log.info)
    if not _made_as(draft, DRAFT_SHAPE, None):
        build_reference_draft(draft, cfg.tokenizer, DRAFT_SHAPE)
    return target, draft


def _made_as(model_dir: Path, shape, fit_steps: int | None) -> bool:
    """Whether ``model_dir`` holds a reference model of this shape and fit (its ``reference_model.json``)."""
    record = model_dir / "reference_model.json"
    if not record.is_file():
        return False
    made = read_json(record)
    return made.get("shape") == asdict(shape) and (made.get("fit") or {}).get("steps") == fit_steps


def _rows(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in read_jsonl(path)]


def _check(name: str, fn: Callable[[], Check]) -> Check:
    try:
        row = fn()
    except Exception as e:  # a check that cannot run is a failed row, and the others still run
        log.exception("rehearsal check %s", name)
        row = _row(False, f"{type(e).__name__}: {e}")
    return {"name": name, **row} if "name" not in row else row


def _row(ok: bool | None, detail: str, name: str | None = None, **facts: Any) -> Check:
    """A check's row: ``ok`` None is a skip (what it needs is not installed here), which fails nothing."""
    return {**({"name": name} if name else {}), "ok": None if ok is None else bool(ok), "detail": detail, **facts}


def _verdict(ok: bool | None) -> str:
    return "SKIP" if ok is None else "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------------------ the checks

def _tokenizer_check(target: Path) -> Check:
    tok = tokenizer_from_dir(target)
    hello = tok.encode("Hello world")
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                       enable_thinking=False, tokenize=False)
    ok = (hello == [9707, 1879] and len(tok) == 151_669 and tok.eos_token_id == QWEN3_EOS
          and rendered.endswith(NON_THINKING_TAIL) and tok.bos_token is None)
    return _row(ok, f"{len(tok)} entries, 'Hello world' -> {hello}, eos {tok.eos_token} ({tok.eos_token_id}), "
                    f"no BOS: {tok.bos_token is None}, non-thinking generation prompt: "
                    f"{rendered.endswith(NON_THINKING_TAIL)}")


def traces_check(run_dir: Path) -> Check:
    tok = tokenizer_from_dir(run_dir / "reference" / "target")
    tail = tok(NON_THINKING_TAIL, add_special_tokens=False)["input_ids"]
    rows = _rows(run_dir / "traces" / "traces.jsonl")
    templated = sum(r["prompt_ids"][-len(tail):] == tail for r in rows)
    at_eos = [r for r in rows if r["finish_reason"] == "eos"]
    ends = sum(r["completion_ids"][-1] == QWEN3_EOS for r in at_eos)
    meta = read_json(RunPaths.from_run_dir(run_dir).traces_summary)
    ok = rows and templated == len(rows) and at_eos and ends == len(at_eos) and meta.get("chat_template") is True
    return _row(ok, f"{templated} of {len(rows)} prompts end with the empty think block; {len(at_eos)} answers "
                    f"finished at the end token ({ends} of them with <|im_end|> last), {len(rows) - len(at_eos)} at "
                    f"the token limit; traces.summary.json chat_template={meta.get('chat_template')}")


def _init_check(run_dir: Path, draft: Path) -> Check:
    source = read_json(run_dir / "init" / "init_source.json")
    config = load_config(run_dir / "init")
    ok = ("truncate_layers" not in source and source.get("init") == str(draft)
          and config.num_hidden_layers == DRAFT_SHAPE.layers and config.hidden_size == DRAFT_SHAPE.hidden)
    return _row(ok, f"init {source.get('init')}: {config.num_hidden_layers} layers, hidden {config.hidden_size} "
                    f"(the target: {TARGET_SHAPE.layers}, {TARGET_SHAPE.hidden}), no layer cut")


def _heads_check(target: Path, run_dir: Path) -> Check:
    t, d = load_config(target), load_config(run_dir / "model")
    names_self = {e.name for e in qd4.read_qd4_header(run_dir / "model_self" / "draft.qd4").entries}
    names_draft = {e.name for e in qd4.read_qd4_header(run_dir / "model" / "draft.qd4").entries}
    ok = (not t.tie_word_embeddings and d.tie_word_embeddings and "lm_head.weight" in names_self
          and "lm_head.weight" not in names_draft)
    return _row(ok, f"target tie_word_embeddings={t.tie_word_embeddings} (its pack stores lm_head: "
                    f"{'lm_head.weight' in names_self}); draft tie_word_embeddings={d.tie_word_embeddings} (its "
                    f"pack stores the embedding once: {'lm_head.weight' not in names_draft})")


def _pack_check(run_dir: Path) -> Check:
    model_dir = run_dir / "model"
    arch = read_json(model_dir / "architecture.json")
    header = qd4.read_qd4_header(model_dir / "draft.qd4")
    embed = header.entry("model.embed_tokens.weight")
    recipe = read_json(model_dir / "pack_recipe.json")
    estimate = qd4.estimate_packed_bytes(load_config(model_dir), header.group_size,
                                         embedding_encoding=recipe.get("config", {}).get("embedding_encoding", "q4g"))
    size = (model_dir / "draft.qd4").stat().st_size
    ok = embed.shape[0] == QWEN3_VOCAB_ROWS and size == arch["bytes"] == estimate
    return _row(ok, f"embedding {list(embed.shape)} as {embed.encoding}; draft.qd4 {size:,} bytes, "
                    f"architecture.json {arch['bytes']:,}, estimate {estimate:,}")


def _serve_check(run_dir: Path, cfg: RehearseConfig) -> Check:
    """The last embedding row is a valid id (Qwen3's padding rows are rows of the model); one past it is a 422
    that names the field."""
    server = ServerProcess(run_dir / "model", run_dir / "rehearsal" / "serve_ids.log",
                           ["--device", cfg.device, *(["--threads", str(cfg.threads)] if cfg.threads else [])])
    try:
        ok, detail = server.wait_ready(300)
        if not ok:
            return _row(False, f"the server did not start: {detail}")
        top = QWEN3_VOCAB_ROWS - 1
        last = httpx.post(f"{server.url}/draft", json={"token_ids": [QWEN3_EOS - 1, top]}, timeout=60)
        past = httpx.post(f"{server.url}/draft", json={"token_ids": [QWEN3_EOS - 1, top + 1]}, timeout=60)
        message = json.dumps(past.json())
        ok = (last.status_code == 200 and len(last.json()["draft_ids"]) == 16 and past.status_code == 422
              and "token_ids" in message)
        return _row(ok, f"id {top} (the last embedding row): HTTP {last.status_code}; id {top + 1}: HTTP "
                        f"{past.status_code}: {past.json().get('message')}")
    finally:
        server.stop()


def _hf_export_check(run_dir: Path) -> Check:
    out = run_dir / "export" / "hf"
    result = run_export(ExportConfig(model_dir=str(run_dir / "model"), format="hf", out=str(out), overwrite=True))
    config = load_config(out)
    ok = result.record.is_file() and config.model_type == "qwen3" and config.vocab_size == QWEN3_VOCAB_ROWS
    return _row(ok, f"{out}: model_type {config.model_type}, vocab {config.vocab_size}, record "
                    f"{result.record.name}")


def _greedy_drafts(run_dir: Path, limit: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """(contexts, the packed draft's 16-token greedy drafts) on the rehearsal's evaluation points."""
    points = _rows(run_dir / "validation" / "validation.jsonl")[:limit]
    contexts = [p["context_ids"] for p in points]
    model, _ = load_draft(run_dir / "model", "float32")
    return contexts, draft_batch(model, contexts, 16)


def _llama_cpp_check(run_dir: Path, cfg: RehearseConfig) -> Check:
    if not llama_cpp_available():
        return _row(None, f"llama-cpp-python is not installed ({INSTALL_HINT})")
    problem = engine_problem()
    if problem:
        return _row(False, problem)
    draft_gguf = run_dir / "export" / "draft.gguf"
    # the target's tokenizer as llama.cpp reads it: the target's own weights (packed) exported to GGUF
    target_gguf = run_dir / "export" / "target_self.gguf"
    run_export(ExportConfig(model_dir=str(run_dir / "model_self"), format="gguf", out=str(target_gguf),
                            overwrite=True))
    compat = vocab_compatible(target_gguf, draft_gguf)
    contexts, ours = _greedy_drafts(run_dir)
    drafter = LlamaCppDrafter(draft_gguf, n_ctx=max(map(len, contexts)) + 64, threads=cfg.threads)
    try:
        theirs = [drafter.draft_one(c, 16) for c in contexts]
    finally:
        drafter.close()
    first = sum(a[0] == b[0] for a, b in zip(ours, theirs)) / len(ours)
    identical = sum(a == b for a, b in zip(ours, theirs))
    regular = ""
    ok_vocab = True
    if cfg.llama_vocab and Path(cfg.llama_vocab).is_file():
        # llama.cpp's own conversion of Qwen's tokenizer names ids past 151,645 as placeholders: compare the rest
        mine, reference = vocab_texts(draft_gguf), vocab_texts(cfg.llama_vocab)
        n = QWEN3_EOS + 1
        differ = sum(a != b for a, b in zip(mine[:n], reference[:n]))
        ok_vocab = differ == 0 and len(mine) == QWEN3_VOCAB_ROWS
        regular = (f"; ids 0..{n - 1} against llama.cpp's {Path(cfg.llama_vocab).name}: {differ} token texts "
                   f"differ; {len(mine)} tokens")
    ok = compat["compatible"] and first >= FIRST_TOKEN_AGREEMENT and ok_vocab
    return _row(ok, f"llama.cpp's draft/target vocabulary check: compatible={compat['compatible']} "
                    f"(eos {compat['eos']}, {compat['n_tokens']} tokens){regular}; greedy drafts on "
                    f"{len(ours)} evaluation points: first token agrees on {first:.1%} (need "
                    f"{FIRST_TOKEN_AGREEMENT:.0%}), {identical} identical in all 16",
                first_token_agreement=round(first, 4), identical=identical, points=len(ours))


def _transformers_gguf_check(run_dir: Path) -> Check:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(run_dir / "export", gguf_file="draft.gguf",
                                                  dtype=torch.float32).eval()
    ours, _ = load_draft(run_dir / "model", "float32")
    a, b = theirs.state_dict(), ours.state_dict()
    equal = sum(torch.equal(a[k], b[k]) for k in b if k in a)
    contexts, drafts = _greedy_drafts(run_dir, limit=16)
    same = sum(x == y for x, y in zip(draft_batch(theirs, contexts, 16), drafts))
    ok = equal == len(b) and same == len(contexts)
    return _row(ok, f"{equal} of {len(b)} tensors bit-equal to the packed draft's float32 weights; greedy drafts "
                    f"identical on {same} of {len(contexts)} points")


# ------------------------------------------------------------------------------------------------ the summary

def summary_markdown(summary: dict) -> str:
    lines = ["# specdraft reference rehearsal: Qwen3-shaped models on the real Qwen3 tokenizer", "",
             f"Target `{summary['target']}`, draft started from `{summary['draft_init']}` (Qwen3-shaped, random "
             "weights: the figures say nothing about real Qwen3 drafts). Acceptance and speed: "
             f"`{summary['demo_summary']}`.", "", "| check | result | what was measured |", "|---|---|---|"]
    lines += [f"| {c['name']} | {_verdict(c['ok'])} | {c['detail']} |" for c in summary["checks"]]
    lines += ["", f"**{'PASS' if summary['passed'] else 'FAIL'}** in {summary['wall_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"

