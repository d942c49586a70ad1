"""`specdraft speculate`: lossless speculative decoding at batch 1, timed against plain decoding: greedy, or
sampled (``--temperature``, ``--top-p``, ``--top-k``, ``--seed``: drafts drawn from each drafter's distribution,
speculative sampling's acceptance rule, against plain sampling in the same loop; torch engine only).

The algorithm is ``drafting.speculative.speculative_generate``; ``drafting.timing`` runs it for every drafter
and k against plain greedy in the same loop and checks every output against plain greedy (a mismatch is an
error). This stage loads the target and the drafters its config asks for, each named by a spec
(``drafting.spec.DrafterSpec``, recorded in the report) -- an in-process draft keeps its KV cache across steps
(``CachedDraftModel``), or re-prefills (``ModelDrafter``); the draft server (``HTTPDrafter``); prompt lookup;
the draft behind lookup -- and writes ``speculate.json``, ``speculate.md`` (rendered from it by
``reports.speculate``) and a plot of tokens/s per k.

``--engine llama.cpp`` runs the same loop in llama.cpp (llama-cpp-python), the engine CPU users decode with:
the target's GGUF, drafts from GGUF files (``specdraft export`` output, the target's own file as its
self-draft), llama-cpp-python's n-gram drafter and prompt lookup, against llama.cpp's own plain decoding in the
same run; a full-precision copy of the target (F32, made by llama.cpp's quantize) with the 4-bit self-draft
as a second table. Every speed-up also comes predicted from measured costs (``drafting.prediction``).
"""

from __future__ import annotations

import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator

from specdraft.core import plots
from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, atomic_write_text, read_json, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.core.records import read_prompts
from specdraft.core.wire import MAX_DRAFT_TOKENS, MAX_TOP_ALTERNATIVES
from specdraft.drafting.base import Drafter
from specdraft.drafting.build import (
    BuiltDrafter,
    InProcessSettings,
    behind_lookup,
    in_process_drafter,
    llama_cpp_draft,
    load_in_process_draft,
)
from specdraft.drafting.calibration import DEFAULT_DRAFT_CONFIDENCE
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM
from specdraft.drafting.llamacpp import LlamaCppNgramDrafter
from specdraft.drafting.lookup import LookupDrafter
from specdraft.drafting.remote import HTTPDrafter
from specdraft.drafting.spec import LLAMA_CPP_RESERVED_NAMES, RESERVED_NAMES, DrafterSpec
from specdraft.drafting.timing import Prompt, run_speculation_bench
from specdraft.model.chat import encode_prompts
from specdraft.model.device import DEVICE_HELP, resolve_device
from specdraft.model.llamacpp import LlamaCppTarget, batched_against_sequential, llama_cpp_version, requantize
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.sampling import SamplingParams
from specdraft.model.specs import DEFAULT_TARGET, describe_source, embedded_gguf_path, load_model, load_tokenizer
from specdraft.model.targets import TargetModel, TorchTarget
from specdraft.quant.compute_choice import COMPUTE_HELP, ComputeSetting
from specdraft.reports.speculate import speculate_markdown

log = logging.getLogger(__name__)


class SpeculateConfig(StageConfig):
    target: str = Field(DEFAULT_TARGET, description="target model spec (local dir | hub:ORG/NAME@REV | embedded:NAME); "
                                                    "with --engine llama.cpp, its tokenizer and chat template")
    engine: Literal["torch", "llama.cpp"] = Field(
        "torch", description="where the target and the drafts run: specdraft's own engine (torch, float32 target "
                             "by default) or llama.cpp (llama-cpp-python, `pip install 'specdraft[llama]'`: "
                             "GGUF files, against llama.cpp's plain decoding)")
    target_gguf: Optional[Path] = Field(
        None, description="llama.cpp: the target's GGUF file (default: the embedded target's own file)")
    draft: str = Field(description="drafter: a draft server URL (http://...), a model dir (packed QD04 or HF "
                                   "checkpoint) or 'lookup' (model-free prompt lookup); with --engine llama.cpp, "
                                   "a draft GGUF file (`specdraft export --format gguf`), 'lookup' or 'none'")
    prompts: Path = Field(description="prompts file: prompts.jsonl ('prompt'), MT-bench ('turns'[0]) or "
                                      "validation/traces style ('context_ids' / 'prompt_ids', used as is)")
    out: Path = Field(Path("speculate_out"), description="output dir: speculate.json, speculate.md, PNG, log")
    max_new_tokens: int = Field(128, ge=1, le=4096, description="tokens generated per prompt")
    k: list[int] = Field([2, 4, 8, 16], description="draft tokens per step; each value is run (a sweep)",
                         json_schema_extra={"aliases": ["-k"]})
    num_prompts: int | None = Field(8, ge=1, description="use the first N prompts (null in a --config file: all)")
    baseline_lookup: bool = Field(True, description="also run the model-free lookup drafter as the peer baseline")
    also_draft: list[str] = Field(
        [], description="more in-process draft model dirs timed in the same run, each as NAME=DIR (e.g. "
                        "self=runs/demo/model_self: the target's own weights packed), with the main draft's "
                        "cache, lean, compile, compute and confidence settings; with --engine llama.cpp, "
                        "NAME=FILE.gguf; repeatable")
    self_draft: bool = Field(True, description="llama.cpp: also the target's own GGUF file as its draft ('self')")
    ngram_baseline: bool = Field(True, description="llama.cpp: also llama-cpp-python's n-gram drafter "
                                                   "(LlamaPromptLookupDecoding) as 'ngram'")
    full_precision: bool = Field(
        True, description="llama.cpp: a second table with the target at F32 (llama.cpp's quantize of the target "
                          "GGUF, kept in the output dir) against the target's own 4-bit file as its draft")
    predict: bool = Field(True, description="predict every speed-up from the target's measured pass costs and a "
                                            "replay of each drafter, beside the measured one")
    draft_cache: Literal["keep", "reprefill", "both"] = Field(
        "keep", description="in-process draft model: keep its KV cache across steps (rolled back to the "
                            "accepted prefix), re-prefill the whole context every step, or time both")
    draft_stop: Literal["calibrated", "probability", "both"] = Field(
        "calibrated", description="in-process draft model with a kept cache: where a step's draft stops short of "
                                  "k -- when the estimated probability that the whole draft so far is accepted, "
                                  "learnt during the run from what the target kept, falls below --draft-confidence "
                                  "('calibrated'), or after a token whose own probability does ('probability', "
                                  "transformers' assisted generation); 'both' times the second too, as "
                                  "'<name>-prob'. A draft server (--draft http://...) stops by 'probability' alone "
                                  "(its request's stop_confidence); with the other rules it drafts k")
    draft_confidence: float | None = Field(
        None, ge=0.0, le=1.0,
        description=f"the --draft-stop rule's threshold (null: each rule's default, {DEFAULT_DRAFT_CONFIDENCE}; "
                    "0: always k)")
    draft_lean: Literal["on", "off", "both"] = Field(
        "on", description="in-process draft model: decode through specdraft.model.lean (the forward written out, same "
                          "tokens) where it applies, through transformers' forward ('off'), or time both ('both' "
                          "adds 'draft-hf')")
    draft_compile: Literal["on", "off", "both"] = Field(
        "on", description="in-process lean draft: run its one-token steps through torch.compile (inductor; "
                          "faster steps; compiled during the first ones, a minute or two here with an empty "
                          "inductor cache; eager if compiling fails), eagerly ('off'), or time both ('both' adds "
                          "'draft-eager')")
    chat_template: bool = Field(True, description="wrap text prompts in the target's chat template "
                                                  "(add_generation_prompt)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="target dtype")
    draft_compute: ComputeSetting = Field(
        "auto", description="in-process draft's linear layers: " + COMPUTE_HELP + " (the target always runs as "
                            "loaded)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default)")
    device: str = Field("auto", description=f"the target's and the in-process drafts' {DEVICE_HELP}; int4 drafts "
                                            "off the CPU run in bfloat16")
    warmup: bool = Field(True, description="one short untimed run of every configuration first")
    repeats: int = Field(1, ge=1, le=100, description="passes over the prompts (each drafter and k also reports its "
                                                      "speed-up per pass: median and range)")
    note: str | None = Field(None, description="a line for speculate.md, e.g. what the draft is")
    temperature: float = Field(
        0.0, ge=0.0, allow_inf_nan=False,
        description="0: greedy (every output equal to plain greedy); > 0: speculative sampling at this temperature "
                    "(drafts drawn from each drafter's distribution, warped like the target's), against plain "
                    "sampling in the same loop; torch engine only")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="with --temperature: nucleus sampling for target and "
                                                          "drafts alike (1: off)")
    top_k: int = Field(0, ge=0, description="with --temperature: keep the top_k most likely tokens, target and "
                                            "drafts alike (0: off)")
    seed: int = Field(0, ge=0, description="with --temperature: seeds each run's generator (with the pass and the "
                                           "prompt; the same for every drafter)")
    hybrid_min_ngram: int | None = Field(
        DEFAULT_HYBRID_MIN_NGRAM, ge=1, le=4,
        description="with a draft model or server: also run it behind prompt lookup ('<name>+lookup'): lookup's "
                    "proposal wherever the context's last N (or more, up to 4) tokens occurred before, the draft "
                    "elsewhere (null: not run)")
    clock: Literal["wall", "cpu"] = Field(
        "wall", description="clock behind tokens/s, speedup and best k (both are recorded): wall, or this "
                            "process's CPU time (use cpu with --threads 1 on a machine shared with other "
                            "jobs; it does not count a draft server's time)")

    def stop_threshold(self, rule: str) -> float:
        """``draft_confidence``, or the stop rule's default when it is unset."""
        conf = self.draft_confidence
        return DEFAULT_DRAFT_CONFIDENCE[rule] if conf is None else conf

    @property
    def also_drafts(self) -> dict[str, str]:
        """``also_draft`` as {NAME: DIR}."""
        return dict(item.split("=", 1) for item in self.also_draft)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @model_validator(mode="after")
    def _sampling_supported(self):
        if self.temperature > 0 and self.engine == "llama.cpp":
            raise ValueError("--temperature > 0 with --engine llama.cpp: its target gives greedy tokens only (no "
                             "probabilities to accept sampled drafts with); use --engine torch or --temperature 0")
        if (self.temperature > 0 and self.draft.startswith(("http://", "https://"))
                and not 0 < self.top_k <= MAX_TOP_ALTERNATIVES):
            raise ValueError(f"--temperature > 0 with a draft server: the server answers at most "
                             f"{MAX_TOP_ALTERNATIVES} alternatives per token, so the draft's distribution is known "
                             "whole (and speculative sampling lossless) only with --top-k in "
                             f"1..{MAX_TOP_ALTERNATIVES}")
        return self

    @field_validator("also_draft")
    @classmethod
    def _named_dirs(cls, value: list[str]) -> list[str]:
        names = []
        for item in value:
            name, sep, path = item.partition("=")
            if not sep or not name or not path or name in RESERVED_NAMES or name in names:
                raise ValueError(f"also_draft {item!r}: want NAME=DIR with a NAME used once and not one of "
                                 f"{sorted(RESERVED_NAMES)}")
            names.append(name)
        return value

    @field_validator("k")
    @classmethod
    def _k_positive(cls, value: list[int]) -> list[int]:
        if not value or any(k < 1 or k > MAX_DRAFT_TOKENS for k in value):
            raise ValueError(f"k must be a non-empty list of ints in 1..{MAX_DRAFT_TOKENS}, got {value}")
        return sorted(set(value))


def load_prompts(path: str | os.PathLike, tokenizer, limit: int | None = None,
                 chat_template: bool = True) -> list[Prompt]:
    """The prompts of a prompts / MT-bench file as the target's token ids (chat-templated like the traces, so
    speculation sees what the draft was trained on), or a validation / traces file's token ids as they are
    (one speculation per prompt, from its first point)."""
    records = read_prompts(path, token_ids_allowed=True, vocab=len(tokenizer))[:limit]
    texts = [r.text for r in records if r.ids is None]
    encoded = iter(encode_prompts(tokenizer, texts, chat_template) if texts else [])
    return [Prompt(r.id if r.offset is None else f"{r.id}@{r.offset}", r.ids if r.ids is not None else next(encoded))
            for r in records]


def drafter_specs(config: SpeculateConfig) -> list[DrafterSpec]:
    """The drafters the config asks for, in the report's order: the ``--draft`` (with its side-by-side variants),
    it behind lookup, the lookup peer baseline and every ``--also-draft``; in llama.cpp also the target's own
    file and llama-cpp-python's n-gram drafter."""
    if config.engine == "llama.cpp":
        return _llama_cpp_specs(config)
    draft, specs = config.draft, []
    if draft == "lookup":
        specs.append(DrafterSpec("lookup"))
    elif draft.startswith(("http://", "https://")):
        specs.append(DrafterSpec("server"))
    elif draft != "none":
        specs += [DrafterSpec("draft", variant=v) for v in _draft_variants(config)]
    if config.hybrid_min_ngram is not None and draft not in ("lookup", "none"):
        specs.append(DrafterSpec(specs[0].role, behind_lookup=True))
    if config.baseline_lookup and draft != "lookup":
        specs.append(DrafterSpec("lookup"))
    for name in config.also_drafts:
        # an --also-draft named self is the self-draft: the target's own weights, packed
        role, alias = ("self", None) if name == "self" else ("named", name)
        specs.append(DrafterSpec(role, alias=alias))
        if config.draft_stop == "both":
            specs.append(DrafterSpec(role, alias=alias, variant="prob"))
    return specs


def _draft_variants(config: SpeculateConfig) -> list[str | None]:
    """The in-process --draft's variants timed side by side (None: the draft as configured)."""
    out: list[str | None] = []
    if config.draft_cache in ("keep", "both"):
        out.append(None)
        if config.draft_stop == "both":
            out.append("prob")
        if config.draft_lean != "off" and config.draft_compile == "both":
            out.append("eager")
        if config.draft_lean == "both":
            out.append("hf")
    if config.draft_cache in ("reprefill", "both"):
        out.append("reprefill" if config.draft_cache == "both" else None)
    return out


def _llama_cpp_specs(config: SpeculateConfig) -> list[DrafterSpec]:
    specs = []
    if config.draft not in ("lookup", "none"):
        specs.append(DrafterSpec("draft", "llama.cpp"))
        if config.hybrid_min_ngram is not None:
            specs.append(DrafterSpec("draft", "llama.cpp", behind_lookup=True))
    if config.self_draft:
        specs.append(DrafterSpec("self", "llama.cpp"))
    for item in config.also_draft:
        name = item.partition("=")[0]
        if name in LLAMA_CPP_RESERVED_NAMES:
            raise ValueError(f"--also-draft {item!r}: with --engine llama.cpp the name {name!r} is taken "
                             f"(the engine's own drafters: {sorted(LLAMA_CPP_RESERVED_NAMES)})")
        specs.append(DrafterSpec("named", "llama.cpp", alias=name))
    if config.ngram_baseline:
        specs.append(DrafterSpec("ngram", "llama.cpp"))
    if config.baseline_lookup or config.draft == "lookup":
        specs.append(DrafterSpec("lookup", "llama.cpp"))
    return specs


def in_process_settings(config: SpeculateConfig, spec: DrafterSpec) -> InProcessSettings:
    """How an in-process drafter of ``spec`` drafts: the config's settings, changed in the one its variant
    changes (an --also-draft always keeps its cache)."""
    if spec.variant == "reprefill" or (spec.role == "draft" and not spec.variant and config.draft_cache == "reprefill"):
        return InProcessSettings(cache="reprefill")
    lean = {"eager": True, "hf": False}.get(spec.variant, config.draft_lean != "off")
    compiled = lean and spec.variant not in ("eager", "hf") and config.draft_compile != "off"
    stop = "calibrated" if config.draft_stop == "both" else config.draft_stop
    stop = "probability" if spec.variant == "prob" else stop
    return InProcessSettings("keep", lean, compiled, stop, config.stop_threshold(stop))


def server_stop_confidence(config: SpeculateConfig) -> float | None:
    """The draft server's ``stop_confidence``: the probability rule's threshold when --draft-stop asks for that rule
    (0: none). The calibrated rule learns acceptance rates from what the target kept, which the stateless server
    never sees, so with it (the default) the server drafts k tokens as it always did."""
    if config.draft_stop != "probability":
        return None
    return config.stop_threshold("probability") or None


def _build(specs: list[DrafterSpec], min_ngram: int | None,
           model_drafter: Callable[[DrafterSpec], tuple[Drafter, dict]]) -> list[BuiltDrafter]:
    """Prompt lookup and the drafters behind it, any engine; ``model_drafter`` makes the others."""
    def build(spec: DrafterSpec) -> tuple[Drafter, dict]:
        if spec.role == "lookup":
            return LookupDrafter(), {"kind": "lookup"}
        if spec.behind_lookup:  # a drafter of its own behind lookup: a kept cache follows one sequence
            return behind_lookup(*build(DrafterSpec(spec.role, spec.engine)), min_ngram, name=spec.name)
        return model_drafter(spec)

    return [BuiltDrafter(spec, *build(spec)) for spec in specs]


def build_drafters(config: SpeculateConfig, target_tokenizer) -> list[BuiltDrafter]:
    """The torch engine's drafters of ``drafter_specs(config)``; each draft model loaded once, shared by its
    variants."""
    loaded: dict[str, tuple[Any, dict]] = {}

    def model_drafter(spec: DrafterSpec) -> tuple[Drafter, dict]:
        if spec.role == "server":
            stop = server_stop_confidence(config)
            return (HTTPDrafter(config.draft, concurrency=1, name=spec.name, stop_confidence=stop),
                    {"kind": "http", "url": config.draft, "stop_confidence": stop})
        key = spec.alias or spec.role  # the --draft, or an --also-draft's NAME
        if key not in loaded:
            path = config.draft if key == "draft" else config.also_drafts[key]
            not_a_dir = (f"--draft {path!r}: not a URL, not 'lookup' and not a directory" if key == "draft"
                         else f"--also-draft {key} {path!r}: not a directory")
            loaded[key] = load_in_process_draft(path, not_a_dir, config.draft_compute, config.device,
                                                target_tokenizer)
        model, source = loaded[key]
        settings = in_process_settings(config, spec)
        return in_process_drafter(model, spec.name, settings), {**source, **settings.record()}

    return _build(drafter_specs(config), config.hybrid_min_ngram, model_drafter)


def build_llama_cpp_drafters(config: SpeculateConfig, target_gguf: Path, n_ctx: int,
                             threads: int) -> list[BuiltDrafter]:
    """The llama.cpp engine's drafters of ``drafter_specs(config)``: GGUF files with their KV cache kept across
    steps, llama-cpp-python's n-gram drafter and prompt lookup."""
    def model_drafter(spec: DrafterSpec) -> tuple[Drafter, dict]:
        if spec.role == "ngram":
            return LlamaCppNgramDrafter(), {"kind": "llama-cpp-python LlamaPromptLookupDecoding", "max_ngram": 2}
        path, what = {"draft": (config.draft, "--draft"), "self": (target_gguf, "the target's own file"),
                      "named": (config.also_drafts.get(spec.alias), f"--also-draft {spec.alias}")}[spec.role]
        return llama_cpp_draft(path, target_gguf, n_ctx, threads, what, name=spec.name)

    return _build(drafter_specs(config), config.hybrid_min_ngram, model_drafter)


def target_gguf_path(config: SpeculateConfig) -> Path:
    """--target-gguf, or the embedded target's own GGUF file."""
    if config.target_gguf is not None:
        return Path(config.target_gguf)
    if not config.target.startswith("embedded:"):
        raise ValueError(f"--engine llama.cpp with --target {config.target!r}: name the target's GGUF file with "
                         "--target-gguf (only an embedded target brings its own)")
    return embedded_gguf_path(config.target.removeprefix("embedded:"))


def full_precision_gguf(source: Path, out_dir: Path, threads: int) -> Path:
    """The target GGUF requantised to F32 by llama.cpp, kept in ``out_dir`` and reused while its source's
    sha256 is the one recorded beside it."""
    out = out_dir / f"{source.stem}.F32.gguf"
    record = out.with_name(out.name + ".json")
    source_sha = sha256_file(source)
    if out.is_file() and record.is_file() and read_json(record).get("source_sha256") == source_sha:
        return out
    requantize(source, out, "F32", threads)
    atomic_write_json(record, {"source": str(source), "source_sha256": source_sha, "file_type": "F32",
                               "made_by": "llama_model_quantize (llama-quantize --allow-requantize)",
                               "sha256": sha256_file(out)})
    return out


def _load_target(config: SpeculateConfig, tokenizer, prompts: list[Prompt], stack: ExitStack
                 ) -> tuple[TargetModel, list[BuiltDrafter], dict[str, Any]]:
    """The target, the drafters and the target's source record, for the configured engine (all closed by
    ``stack``)."""
    if config.engine == "torch":
        model = load_model(config.target, dtype=getattr(torch, config.dtype), device=resolve_device(config.device))
        drafters = build_drafters(config, tokenizer)
        stack.callback(_close_all, drafters)
        return TorchTarget(model), drafters, describe_source(config.target)
    problem = engine_problem()  # in a child first: an engine that dies of an instruction would take this process along
    if problem:
        raise RuntimeError(problem)
    gguf, threads, n_ctx = target_gguf_path(config), _llama_threads(config), _context_size(config, prompts)
    target = LlamaCppTarget(gguf, n_ctx=n_ctx, threads=threads)
    stack.callback(target.close)
    drafters = build_llama_cpp_drafters(config, gguf, n_ctx, threads)
    stack.callback(_close_all, drafters)
    return target, drafters, {"engine": "llama.cpp", "gguf": str(gguf), "sha256": sha256_file(gguf),
                              "tokenizer": describe_source(config.target)}


def _close_all(drafters: list[BuiltDrafter]) -> None:
    for built in drafters:
        built.drafter.close()


def _llama_threads(config: SpeculateConfig) -> int:
    return config.threads or os.cpu_count() or 1


def _context_size(config: SpeculateConfig, prompts: list[Prompt]) -> int:
    return max(len(p.ids) for p in prompts) + config.max_new_tokens + max(config.k) + 8


def _bench(config: SpeculateConfig, target: TargetModel, drafters: list[BuiltDrafter],
           prompts: list[Prompt]) -> dict[str, Any]:
    """Every drafter and k timed against plain decoding (``drafting.timing``), with the drafters' specs and
    sources."""
    result = run_speculation_bench(target, [(d.name, d.drafter) for d in drafters], prompts, config.k,
                                   config.max_new_tokens, warmup=config.warmup, progress=True, clock=config.clock,
                                   repeats=config.repeats, predict=config.predict, sampling=config.sampling,
                                   seed=config.seed)
    return {**result, "drafter_specs": {d.name: d.spec.to_json() for d in drafters},
            "drafter_sources": {d.name: d.source for d in drafters}}


def engine_consistency(target: LlamaCppTarget, prompts: list[Prompt], max_new_tokens: int,
                       pass_tokens: int) -> dict[str, Any]:
    """llama.cpp's verify-pass logits (passes of ``pass_tokens``) against its one-token (plain) logits on each
    prompt's plain greedy output, pooled over the prompts: why speculative outputs part from plain greedy in this
    engine, where they do."""
    rows = [batched_against_sequential(target.model, p.ids, target.greedy(p.ids, max_new_tokens).tokens, pass_tokens)
            for p in prompts]
    gaps = sorted(g for r in rows for g in r["top2_gap_where_differs"])
    return {"pass_tokens": pass_tokens, "positions": sum(r["positions"] for r in rows),
            "argmax_differs": sum(r["argmax_differs"] for r in rows),
            "max_logit_difference": max((r["max_logit_difference"] for r in rows), default=0.0),
            "logit_scale": max((r["logit_scale"] for r in rows), default=0.0),
            "median_top2_gap_where_differs": gaps[len(gaps) // 2] if gaps else None}


def _full_precision(config: SpeculateConfig, prompts: list[Prompt], out: Path) -> dict[str, Any]:
    """The F32 target against the target's own 4-bit file as its draft, timed like the main table."""
    gguf, threads, n_ctx = target_gguf_path(config), _llama_threads(config), _context_size(config, prompts)
    f32 = full_precision_gguf(gguf, out, threads)
    with ExitStack() as stack:
        target = LlamaCppTarget(f32, n_ctx=n_ctx, threads=threads, name="target-F32")
        stack.callback(target.close)
        spec = DrafterSpec("self-4bit", "llama.cpp")
        drafters = [BuiltDrafter(spec, *llama_cpp_draft(gguf, f32, n_ctx, threads, "the target's own file",
                                                        name=spec.name))]
        stack.callback(_close_all, drafters)
        result = _bench(config, target, drafters, prompts)
        result["engine_consistency"] = engine_consistency(target, prompts, config.max_new_tokens, max(config.k) + 1)
    return {"target": {"gguf": str(f32), "sha256": sha256_file(f32), "from": str(gguf)}, **result}


def _warn_about_the_clock(config: SpeculateConfig) -> None:
    if config.clock == "cpu" and torch.get_num_threads() != 1:
        log.warning("clock=cpu with %d torch threads: CPU seconds add up over threads, so tokens/s on that "
                    "clock is not a rate you would see; use --threads 1", torch.get_num_threads())
    if config.clock == "cpu" and config.draft.startswith(("http://", "https://")):
        log.warning("clock=cpu with a draft server: the server's CPU time is not counted")


def _measure(config: SpeculateConfig, out: Path, stack: ExitStack) -> dict[str, Any]:
    """The report's measurements: the main table, and in llama.cpp the engine's consistency and the
    full-precision table (the main table's models closed first)."""
    tokenizer = load_tokenizer(config.target)
    prompts = load_prompts(config.prompts, tokenizer, config.num_prompts, config.chat_template)
    target, drafters, target_source = _load_target(config, tokenizer, prompts, stack)
    log.info("%s engine: %d prompts, drafters %s, k %s, %d new tokens", config.engine, len(prompts),
             [d.name for d in drafters], config.k, config.max_new_tokens)
    result = _bench(config, target, drafters, prompts)
    threads = _llama_threads(config) if config.engine == "llama.cpp" else torch.get_num_threads()
    report: dict[str, Any] = {"config": config.to_json_dict(), "note": config.note, "prompts": len(prompts),
                              "threads": threads, "target": target_source, **result,
                              "compile_errors": {d.name: d.drafter.compile_error for d in drafters
                                                 if d.drafter.compile_error}}
    if config.engine == "llama.cpp":
        report["llama_cpp_python"] = llama_cpp_version()
        report["engine_consistency"] = engine_consistency(target, prompts, config.max_new_tokens, max(config.k) + 1)
        stack.close()  # the main table's models out of memory before the full-precision target loads
        if config.full_precision:
            atomic_write_json(out / "speculate.json", report)
            report["full_precision"] = _full_precision(config, prompts, out)
    return report


def _render(config: SpeculateConfig, report: dict[str, Any], out: Path) -> None:
    """The plot and speculate.md, then the provenance with their sha256 (the report rewritten)."""
    report["plot"] = plots.plot_throughput_by_k(
        {name: {int(k): row["tokens_per_s"] for k, row in res["per_k"].items()}
         for name, res in report["drafters"].items()},
        report["baseline"]["tokens_per_s"], out / "speculate_tokens_per_s.png",
        ylabel=f"tokens/s ({config.clock} clock, {config.engine})").name
    atomic_write_text(out / "speculate.md", speculate_markdown(report))
    report["provenance"] = {
        **run_metadata(), "stage": "speculate",
        "target": report["target"],
        "drafters": report["drafter_sources"],
        "prompts_sha256": sha256_file(config.prompts),
        "files": {n: sha256_file(out / n) for n in ("speculate.md", report["plot"])},
    }
    atomic_write_json(out / "speculate.json", report)


def run_speculate(config: SpeculateConfig) -> int:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    with stage_log(out / "speculate.log"), ExitStack() as stack:
        _warn_about_the_clock(config)
        report = _measure(config, out, stack)
        # the measurements first: a failure while rendering them must not lose a long run (rewritten with the
        # rendered files' records)
        atomic_write_json(out / "speculate.json", report)
        _render(config, report, out)
        base = report["baseline"]["tokens_per_s"]
        for name, res in report["drafters"].items():
            plain = "sampling" if config.temperature else "greedy"
            msg = (f"{name}: best k={res['best_k']} {res['best_tokens_per_s']:.2f} tok/s = "
                   f"{res['best_speedup']:.2f}x plain {plain} ({base:.2f} tok/s, {config.clock} clock, "
                   f"{config.engine})")
            log.info(msg)
            print(msg)
        if report["mismatches"] and report["exact_engine"]:
            log.error("%d speculative runs differ from plain greedy: see %s", len(report["mismatches"]),
                      out / "speculate.json")
            print(f"ERROR: {len(report['mismatches'])} speculative outputs differ from plain greedy")
            return 1
    return 0
