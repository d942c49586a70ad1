"""`specdraft speculate`: lossless speculative decoding at batch 1, timed against plain decoding: greedy, or
sampled (``--temperature``, ``--top-p``, ``--top-k``, ``--seed``: drafts drawn from each drafter's distribution,
speculative sampling's acceptance rule, against plain sampling in the same loop; torch engine only).

The algorithm is ``drafting.speculative.speculative_generate``; ``drafting.timing`` runs it for every drafter
and k against plain greedy in the same loop and checks every output against plain greedy (a mismatch is an
error). This stage loads the target and the drafters -- an in-process draft keeps its KV cache across steps
(``CachedDraftModel``), or re-prefills (``ModelDrafter``); the draft server (``HTTPDrafter``); prompt lookup;
the draft behind lookup -- and writes ``speculate.json``, ``speculate.md`` and a plot of tokens/s per k.

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
from typing import Any, Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator
from transformers import AutoTokenizer

from specdraft.core import plots
from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, atomic_write_text, read_json, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.core.records import read_prompts
from specdraft.drafting.base import Drafter
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.calibration import DEFAULT_DRAFT_CONFIDENCE
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM, HybridDrafter
from specdraft.drafting.llamacpp import LlamaCppDrafter, LlamaCppNgramDrafter
from specdraft.drafting.lookup import LookupDrafter
from specdraft.drafting.remote import MAX_TOP_ALTERNATIVES, HTTPDrafter
from specdraft.drafting.timing import Prompt, run_speculation_bench
from specdraft.model.chat import encode_prompts
from specdraft.model.device import DEVICE_HELP, resolve_device
from specdraft.model.llamacpp import (
    LlamaCppTarget,
    batched_against_sequential,
    check_gguf_file,
    llama_cpp_version,
    requantize,
    vocab_compatible,
)
from specdraft.model.loader import load_draft
from specdraft.model.sampling import SamplingParams
from specdraft.model.specs import (
    DEFAULT_TARGET,
    describe_source,
    embedded_gguf_path,
    load_model,
    load_tokenizer,
    tokenizer_fingerprint,
)
from specdraft.model.targets import TargetModel, TorchTarget
from specdraft.quant.compute_choice import COMPUTE_HELP, SPECULATE_WORKLOAD, ComputeSetting

log = logging.getLogger(__name__)


# the drafters build_drafters names itself; an also_draft must not take one of them
RESERVED_DRAFTER_NAMES = frozenset({"baseline", "draft", "draft-eager", "draft-hf", "draft-prob", "draft-reprefill",
                                    "draft+lookup", "lookup", "server"})
# and the names the llama.cpp engine gives its own extra drafters
LLAMA_CPP_DRAFTER_NAMES = frozenset({"ngram", "self"})


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
                                  "transformers' assisted generation); 'both' times the second too, as '<name>-prob'")
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
            if not sep or not name or not path or name in RESERVED_DRAFTER_NAMES or name in names:
                raise ValueError(f"also_draft {item!r}: want NAME=DIR with a NAME used once and not one of "
                                 f"{sorted(RESERVED_DRAFTER_NAMES)}")
            names.append(name)
        return value

    @field_validator("k")
    @classmethod
    def _k_positive(cls, value: list[int]) -> list[int]:
        if not value or any(k < 1 or k > 64 for k in value):
            raise ValueError(f"k must be a non-empty list of ints in 1..64, got {value}")
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


def _check_tokenizer(draft_dir: Path, target_tokenizer) -> None:
    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_dir)
    except Exception as e:  # a dir without tokenizer files: nothing to compare
        log.warning("draft %s: no tokenizer to compare with the target's (%s)", draft_dir, e)
        return
    if tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(target_tokenizer):
        raise ValueError(f"draft {draft_dir}: its tokenizer differs from the target's (vocabulary hash "
                         "mismatch); a draft must share the target's token ids")


def build_drafters(config: SpeculateConfig, target_tokenizer) -> list[tuple[str, Drafter, dict]]:
    """(name, drafter, source) for the draft named in the config, plus the lookup peer baseline and every
    ``also_draft``."""
    out: list[tuple[str, Drafter, dict]] = []
    spec = config.draft
    lean = config.draft_lean != "off"
    compiled = lean and config.draft_compile != "off"
    if spec == "none":
        pass
    elif spec == "lookup":
        out.append(("lookup", LookupDrafter(), {"kind": "lookup"}))
    elif spec.startswith(("http://", "https://")):
        out.append(("server", HTTPDrafter(spec, concurrency=1, name="server"), {"kind": "http", "url": spec}))
    else:
        model, source = _in_process_draft(spec, f"--draft {spec!r}: not a URL, not 'lookup' and not a directory",
                                          config, target_tokenizer)
        if config.draft_cache in ("keep", "both"):
            out.append(_kept_cache(config, model, source, "draft", lean, compiled))
            if config.draft_stop == "both":
                out.append(_kept_cache(config, model, source, "draft-prob", lean, compiled, "probability"))
            if compiled and config.draft_compile == "both":
                out.append(_kept_cache(config, model, source, "draft-eager", True, False))
            if config.draft_lean == "both":
                out.append(_kept_cache(config, model, source, "draft-hf", False, False))
        if config.draft_cache in ("reprefill", "both"):
            name = "draft-reprefill" if config.draft_cache == "both" else "draft"
            out.append((name, ModelDrafter(model, name=name, max_batch_size=1), {**source, "draft_cache": "reprefill"}))
    if config.hybrid_min_ngram is not None and spec not in ("lookup", "none"):
        # Its own drafter instance (a separate draft cache), so the plain draft's rows stay untouched.
        base_name, base, base_source = out[0]
        if isinstance(base, CachedDraftModel):
            base = CachedDraftModel(base.model, base_name, lean=base.lean is not None,
                                    min_confidence=base.min_confidence, compile=base.compiled, stop=base.stop)
        out.append(("draft+lookup", HybridDrafter(base, config.hybrid_min_ngram, name="draft+lookup"),
                    {"kind": "hybrid", "min_ngram": config.hybrid_min_ngram, "draft": base_source}))
    if config.baseline_lookup and spec != "lookup":
        out.append(("lookup", LookupDrafter(), {"kind": "lookup"}))
    for item in config.also_draft:
        name, _, path = item.partition("=")
        model, source = _in_process_draft(path, f"--also-draft {name} {path!r}: not a directory", config,
                                          target_tokenizer)
        out.append(_kept_cache(config, model, source, name, lean, compiled))
        if config.draft_stop == "both":
            out.append(_kept_cache(config, model, source, f"{name}-prob", lean, compiled, "probability"))
    return out


def target_gguf_path(config: SpeculateConfig) -> Path:
    """--target-gguf, or the embedded target's own GGUF file."""
    if config.target_gguf is not None:
        return Path(config.target_gguf)
    if not config.target.startswith("embedded:"):
        raise ValueError(f"--engine llama.cpp with --target {config.target!r}: name the target's GGUF file with "
                         "--target-gguf (only an embedded target brings its own)")
    return embedded_gguf_path(config.target.removeprefix("embedded:"))


def _llama_cpp_draft(name: str, path: str | os.PathLike, target_gguf: Path, n_ctx: int, threads: int,
                     what: str) -> tuple[str, Drafter, dict]:
    """A GGUF draft in llama.cpp, refused (with llama.cpp's own reasons) when llama.cpp would not speculate
    with it for this target."""
    try:
        path = check_gguf_file(path)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    check = vocab_compatible(target_gguf, path)
    if not check["compatible"]:
        raise ValueError(f"{what} {path}: llama.cpp finds its vocabulary incompatible with the target's "
                         f"{target_gguf.name} ({check})")
    return (name, LlamaCppDrafter(path, n_ctx=n_ctx, threads=threads, name=name),
            {"kind": "llama.cpp", "gguf": str(path), "sha256": sha256_file(path)})


def build_llama_cpp_drafters(config: SpeculateConfig, target_gguf: Path, n_ctx: int,
                             threads: int) -> list[tuple[str, Drafter, dict]]:
    """(name, drafter, source) for --engine llama.cpp: the --draft GGUF (and behind lookup), the target's own
    file as its self-draft, every --also-draft GGUF, llama-cpp-python's n-gram drafter and prompt lookup."""
    out: list[tuple[str, Drafter, dict]] = []
    spec = config.draft
    if spec not in ("lookup", "none"):
        out.append(_llama_cpp_draft("draft", spec, target_gguf, n_ctx, threads, "--draft"))
        if config.hybrid_min_ngram is not None:
            _, behind, source = _llama_cpp_draft("draft", spec, target_gguf, n_ctx, threads, "--draft")
            out.append(("draft+lookup", HybridDrafter(behind, config.hybrid_min_ngram, name="draft+lookup"),
                        {"kind": "hybrid", "min_ngram": config.hybrid_min_ngram, "draft": source}))
    if config.self_draft:
        out.append(_llama_cpp_draft("self", target_gguf, target_gguf, n_ctx, threads, "the target's own file"))
    for item in config.also_draft:
        name, _, path = item.partition("=")
        if name in LLAMA_CPP_DRAFTER_NAMES:
            raise ValueError(f"--also-draft {item!r}: with --engine llama.cpp the name {name!r} is taken "
                             f"(the engine's own drafters: {sorted(LLAMA_CPP_DRAFTER_NAMES)})")
        out.append(_llama_cpp_draft(name, path, target_gguf, n_ctx, threads, f"--also-draft {name}"))
    if config.ngram_baseline:
        out.append(("ngram", LlamaCppNgramDrafter(), {"kind": "llama-cpp-python LlamaPromptLookupDecoding",
                                                      "max_ngram": 2}))
    if config.baseline_lookup or spec == "lookup":
        out.append(("lookup", LookupDrafter(), {"kind": "lookup"}))
    return out


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


def _in_process_draft(path: str, not_a_dir: str, config: SpeculateConfig, target_tokenizer) -> tuple[Any, dict]:
    """A draft model dir loaded for in-process drafting, with its source record (``not_a_dir``: the error
    when it is none)."""
    draft_dir = Path(path)
    if not draft_dir.is_dir():
        raise ValueError(not_a_dir)
    _check_tokenizer(draft_dir, target_tokenizer)
    model, source = load_draft(draft_dir, config.draft_compute, device=config.device, workload=SPECULATE_WORKLOAD)
    return model, {"kind": "in-process", **source}


def _kept_cache(config: SpeculateConfig, model, source: dict, name: str, lean: bool, compile: bool,
                stop: str | None = None) -> tuple[str, Drafter, dict]:
    """``stop``: the stop rule (None: the config's; with ``draft_stop`` "both", the calibrated one)."""
    stop = stop or ("calibrated" if config.draft_stop == "both" else config.draft_stop)
    conf = config.stop_threshold(stop)
    return (name, CachedDraftModel(model, name, lean=lean, min_confidence=conf, compile=compile, stop=stop),
            {**source, "draft_cache": "keep", "lean": lean, "compile": compile, "stop": stop,
             "min_confidence": conf})


def _draft_compute_text(report: dict[str, Any]) -> str:
    """What the in-process drafts computed in and why (``auto``: measured at load), from their source records."""
    cfg = report["config"]
    choices = [source.get("compute_choice") for source in (report.get("drafter_sources") or {}).values()
               if source.get("kind") == "in-process"]
    said = sorted({f"{c['compute']} ({c['reason']})" for c in choices if c})
    return "; ".join(said) if said else str(cfg["draft_compute"])


def _stop_rule_text(cfg: dict[str, Any]) -> str:
    """The in-process drafts' stop rule as a clause of the report's first line ('' when they always draft k)."""
    rule, threshold = cfg.get("draft_stop"), cfg.get("draft_confidence")
    if rule is None:  # a report from before the calibrated rule: its threshold alone, null meaning always k
        rule, threshold = "probability", threshold or 0.0

    def clause(rule: str) -> str:
        t = DEFAULT_DRAFT_CONFIDENCE[rule] if threshold is None else threshold
        if rule == "calibrated":
            return f"once the estimated probability that all of it is accepted (calibrated during the run) is < {t}"
        return f"after a token it gives p < {t}"

    if threshold == 0:
        return ""
    if rule == "both":
        return f"; an in-process draft stops a step's draft {clause('calibrated')} ('-prob': {clause('probability')})"
    return f"; an in-process draft stops a step's draft {clause(rule)}"


def speculate_markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    llama = cfg.get("engine") == "llama.cpp"
    if llama:
        header = ["# Speculative decoding in llama.cpp (greedy, batch 1)", "",
                  f"Target `{(report.get('target') or {}).get('gguf', cfg['target'])}` "
                  f"in llama.cpp (llama-cpp-python {report.get('llama_cpp_python')}), draft `{cfg['draft']}`, "
                  f"{report['prompts']} prompts, max {cfg['max_new_tokens']} new tokens, {report['threads']} threads. "
                  "Baseline: llama.cpp's own plain decoding of the same file (one token per pass), in the same run.",
                  ""]
    elif report.get("sampling"):
        sampling = report["sampling"]
        header = [f"# Speculative sampling (temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
                  f"top-k {sampling['top_k']}, batch 1)", "",
                  f"Target `{cfg['target']}`, draft `{cfg['draft']}`, {report['prompts']} prompts, "
                  f"max {cfg['max_new_tokens']} new tokens, target dtype {cfg['dtype']}, "
                  f"draft compute {_draft_compute_text(report)}, torch threads {report['threads']}; "
                  f"seed {sampling['seed']}. "
                  "Every drafter's tokens are drawn from its own distribution under the same settings as the "
                  "target's; each is kept with probability min(1, p/q), a refused one replaced from "
                  "max(0, p - q): the output is distributed as plain sampling from the target.", "",
                  "Baseline: specdraft's own engine (torch) sampling the target plainly, one forward per token, in "
                  f"the same run (target dtype {cfg['dtype']}).", ""]
    else:
        header = ["# Speculative decoding (greedy, lossless, batch 1)", "",
                  f"Target `{cfg['target']}`, draft `{cfg['draft']}`, {report['prompts']} prompts, "
                  f"max {cfg['max_new_tokens']} new tokens, target dtype {cfg['dtype']}, "
                  f"draft compute {_draft_compute_text(report)}, torch threads {report['threads']}"
                  + _stop_rule_text(cfg)
                  + ("; its decode steps compiled (torch.compile)" if cfg.get("draft_compile", "off") != "off"
                     and cfg.get("draft_lean") != "off" else "") + ".", "",
                  "Baseline: specdraft's own engine (torch) decoding the target plainly, in the same run "
                  f"(target dtype {cfg['dtype']}).", ""]
    lines = header + [
        f"Clock: **{report['clock']}** (tokens/s, speedup and best k use it; the other is in the JSON"
        + ("; CPU time = this process's CPU seconds, at 1 thread immune to other processes' load"
           if report["clock"] == "cpu" else "") + ").", ""]
    lines += _results_markdown(report)
    full = report.get("full_precision")
    if full:
        lines += ["", "## Full-precision target", "",
                  f"The target at F32 (`{Path(full['target']['gguf']).name}`, llama.cpp's quantize of "
                  f"`{Path(full['target']['from']).name}`) against its own 4-bit file as its draft, same prompts "
                  "and k; the baseline is llama.cpp's plain decoding of the F32 file.", ""]
        lines += _results_markdown(full)
    for name, error in report.get("compile_errors", {}).items():
        lines.append(f"{name}: torch.compile failed ({error}); its steps ran eagerly.")
    if report.get("plot"):
        lines += ["", f"![tokens/s per k]({report['plot']})"]
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def _results_markdown(result: dict[str, Any]) -> list[str]:
    """One engine run's tables: the baseline, every drafter and k, the spread over passes, the prediction."""
    base, exact = result["baseline"], result.get("exact_engine", True)
    sampled = bool(result.get("sampling"))
    lines = [f"Plain {'sampling' if sampled else 'greedy'} (same decode loop with no drafts, same run, alternated "
             f"per prompt): **{base['tokens_per_s']:.2f} tokens/s** ({base['tokens']} tokens; wall "
             f"{base['tokens_per_s_wall']:.2f}, CPU {base['tokens_per_s_cpu']:.2f} tokens/s)"
             + ("." if sampled else f"; the reference decode: {result['greedy_decode']['tokens_per_s']:.2f} "
                                    "tokens/s."), ""]
    if sampled:
        lines.append("Sampled outputs differ from run to run by design; the sampler's output distribution is "
                     "checked against plain sampling in tests/drafting/test_speculative_sampling.py. Acceptance = "
                     "drafted tokens kept by the probabilistic rule.")
    elif exact:
        lines.append(f"Output identical to plain greedy for every prompt, drafter and k: "
                     f"**{'yes' if result['lossless'] else 'NO (' + str(len(result['mismatches'])) + ' mismatches)'}"
                     "**.")
    else:
        runs = sum(1 for row in result["per_prompt"] for key in row["runs"] if key != "baseline")
        lines.append(f"Outputs equal to the engine's plain greedy: **{runs - len(result['mismatches'])} of {runs}** "
                     "runs. This engine computes a pass over several tokens with other kernels than a one-token pass "
                     "(by design), so where the top two tokens are close a verify pass may choose the other one; "
                     "where outputs part is in the JSON (`mismatches`: prompt, drafter, k, first differing token).")
        consistency = result.get("engine_consistency")
        if consistency:
            gap = consistency["median_top2_gap_where_differs"]
            lines.append(f"Measured on the plain greedy outputs themselves (teacher-forced): passes of "
                         f"{consistency['pass_tokens']} tokens, as a verify pass at the largest k, pick another argmax "
                         f"than the one-token passes at **{consistency['argmax_differs']} of "
                         f"{consistency['positions']}** positions; the logits differ by up to "
                         f"{consistency['max_logit_difference']:.2f} (largest logit {consistency['logit_scale']:.1f})"
                         + (f", and where the argmax differs the top two were {gap:.3f} apart (median)"
                            if gap is not None else "") + ".")
    lines += ["", "| drafter | k | tokens/s | speedup | predicted | speedup (wall) | speedup (CPU) | "
                  "accepted drafts/step | tokens/step | acceptance | draft time |" + ("" if exact else " = plain |"),
              "|---|---|---|---|---|---|---|---|---|---|---|" + ("" if exact else "---|")]
    for name, res in result["drafters"].items():
        for k, row in res["per_k"].items():
            mark = " **(best)**" if int(k) == res["best_k"] else ""
            predicted = row.get("predicted_speedup")
            lines.append(f"| {name} | {k}{mark} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
                         + (f"{predicted:.2f}x" if predicted is not None else "-")
                         + f" | {row['speedup_wall']:.2f}x | {row['speedup_cpu']:.2f}x | "
                         f"{row['accepted_per_step']:.2f} | {row['tokens_per_step']:.2f} | "
                         f"{row['acceptance_rate']:.2f} | {row['draft_time_share']:.0%} |"
                         + ("" if exact else f" {row.get('equal_to_plain_greedy', 0):.0%} |"))
    lines += ["", "accepted drafts/step = draft tokens kept per target verify pass; tokens/step adds the target's "
              "own token; acceptance = accepted / drafted; draft time = share of wall time spent drafting; "
              "predicted = the speed-up predicted from measured costs (below), before this table was measured."]
    for name, res in result["drafters"].items():
        shares = {k: row["lookup_step_share"] for k, row in res["per_k"].items() if "lookup_step_share" in row}
        if shares:
            lines.append(f"{name}: share of steps drafted by prompt lookup instead of the model: "
                         + ", ".join(f"k={k} {v:.0%}" for k, v in shares.items()) + ".")
    if result.get("repeats", 1) > 1:
        lines += ["", f"Speed-up in each of the {result['repeats']} passes over the prompts (each against the plain "
                      "greedy of the same pass): median and range, at each drafter's best k.", ""]
        for name, res in result["drafters"].items():
            row = res["per_k"][str(res["best_k"])]
            low, high = row["speedup_range"]
            lines.append(f"- {name} (k = {res['best_k']}): median {row['speedup_median']:.2f}x, range "
                         f"{low:.2f}x to {high:.2f}x")
    if result.get("prediction"):
        lines += [""] + prediction_markdown(result["prediction"])
    return lines


def prediction_markdown(prediction: dict[str, Any]) -> list[str]:
    """The predicted speed-ups beside the measured ones, the costs they come from, and the verdict."""
    costs = prediction["costs"]
    passes = ", ".join(f"{n}: {1000 * s:.1f} ms" for n, s in costs["pass_seconds"].items()
                       if int(n) in (1, 2, 3, 5, 9, 17) or n == max(costs["pass_seconds"], key=int))
    lines = ["### Predicted from measured costs", "",
             f"Target passes ({prediction['engine']}, median seconds by tokens in the pass) {passes}. "
             "speed-up(k) = E_k c_1 / (c_v(k+1) + c_d(k)): E_k tokens per step from the drafter's acceptance per "
             "position, c_d its draft seconds per step (a replay of the drafter over the target's greedy output), "
             "c_v the pass over the drafted tokens + 1 (drafting.prediction).", "",
             "| drafter | k | predicted | measured | predicted / measured | tokens/step | draft cost per token "
             "(target steps) | acceptance at positions 1, 2, 4, k |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in prediction["drafters"].items():
        for k, row in rows.items():
            acc = row["acceptance_per_position"]
            picks = ", ".join(f"{acc[i - 1]:.2f}" for i in sorted({1, 2, 4, int(k)}) if i <= len(acc))
            ratio = row.get("predicted_over_measured")
            lines.append(f"| {name} | {k} | {row['predicted_speedup']:.2f}x | {row.get('measured_speedup', 0):.2f}x | "
                         + (f"{ratio:.2f}" if ratio else "-") + f" | {row['tokens_per_step']:.2f} | "
                         f"{row['draft_cost_per_token_vs_target_step']:.2f} | {picks} |")
    lines += [""] + [f"- {line}" for line in prediction["verdict"]]
    return lines


def _compile_errors(drafters: list[tuple[str, Drafter, dict]]) -> dict[str, str]:
    """{drafter: why torch.compile failed} for compiled drafts that fell back to eager steps."""
    return {name: drafter.compile_error for name, drafter, _ in drafters if drafter.compile_error}


def _load_target(config: SpeculateConfig, tokenizer, prompts: list[Prompt], stack: ExitStack
                 ) -> tuple[TargetModel, list[tuple[str, Drafter, dict]], dict[str, Any]]:
    """The target, the drafters and the target's source record, for the configured engine (all closed by
    ``stack``)."""
    if config.engine == "torch":
        model = load_model(config.target, dtype=getattr(torch, config.dtype), device=resolve_device(config.device))
        drafters = build_drafters(config, tokenizer)
        stack.callback(_close_all, drafters)
        return TorchTarget(model), drafters, describe_source(config.target)
    gguf, threads, n_ctx = target_gguf_path(config), _llama_threads(config), _context_size(config, prompts)
    target = LlamaCppTarget(gguf, n_ctx=n_ctx, threads=threads)
    stack.callback(target.close)
    drafters = build_llama_cpp_drafters(config, gguf, n_ctx, threads)
    stack.callback(_close_all, drafters)
    return target, drafters, {"engine": "llama.cpp", "gguf": str(gguf), "sha256": sha256_file(gguf),
                              "tokenizer": describe_source(config.target)}


def _close_all(drafters: list[tuple[str, Drafter, dict]]) -> None:
    for _, drafter, _ in drafters:
        drafter.close()


def _llama_threads(config: SpeculateConfig) -> int:
    return config.threads or os.cpu_count() or 1


def _context_size(config: SpeculateConfig, prompts: list[Prompt]) -> int:
    return max(len(p.ids) for p in prompts) + config.max_new_tokens + max(config.k) + 8


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
        drafters = [_llama_cpp_draft("self-4bit", gguf, f32, n_ctx, threads, "the target's own file")]
        stack.callback(_close_all, drafters)
        result = run_speculation_bench(target, drafters, prompts, config.k, config.max_new_tokens,
                                       warmup=config.warmup, progress=True, clock=config.clock,
                                       repeats=config.repeats, predict=config.predict)
        result["engine_consistency"] = engine_consistency(target, prompts, config.max_new_tokens, max(config.k) + 1)
    return {"target": {"gguf": str(f32), "sha256": sha256_file(f32), "from": str(gguf)},
            "drafter_sources": {name: source for name, _, source in drafters}, **result}


def run_speculate(config: SpeculateConfig) -> int:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    with stage_log(out / "speculate.log"), ExitStack() as stack:
        if config.clock == "cpu" and torch.get_num_threads() != 1:
            log.warning("clock=cpu with %d torch threads: CPU seconds add up over threads, so tokens/s on that "
                        "clock is not a rate you would see; use --threads 1", torch.get_num_threads())
        if config.clock == "cpu" and config.draft.startswith(("http://", "https://")):
            log.warning("clock=cpu with a draft server: the server's CPU time is not counted")
        tokenizer = load_tokenizer(config.target)
        prompts = load_prompts(config.prompts, tokenizer, config.num_prompts, config.chat_template)
        target, drafters, target_source = _load_target(config, tokenizer, prompts, stack)
        log.info("%s engine: %d prompts, drafters %s, k %s, %d new tokens", config.engine, len(prompts),
                 [d[0] for d in drafters], config.k, config.max_new_tokens)
        result = run_speculation_bench(target, drafters, prompts, config.k, config.max_new_tokens,
                                       warmup=config.warmup, progress=True, clock=config.clock,
                                       repeats=config.repeats, predict=config.predict, sampling=config.sampling,
                                       seed=config.seed)
        threads = _llama_threads(config) if config.engine == "llama.cpp" else torch.get_num_threads()
        report: dict[str, Any] = {"config": config.to_json_dict(), "note": config.note, "prompts": len(prompts),
                                  "threads": threads, "target": target_source, **result,
                                  "drafter_sources": {name: source for name, _, source in drafters},
                                  "compile_errors": _compile_errors(drafters)}
        if config.engine == "llama.cpp":
            report["llama_cpp_python"] = llama_cpp_version()
            report["engine_consistency"] = engine_consistency(target, prompts, config.max_new_tokens, max(config.k) + 1)
            stack.close()  # the main table's models out of memory before the full-precision target loads
            if config.full_precision:
                atomic_write_json(out / "speculate.json", report)
                report["full_precision"] = _full_precision(config, prompts, out)
        # the measurements first: a failure while rendering them must not lose a long run (rewritten below with
        # the rendered files' records)
        atomic_write_json(out / "speculate.json", report)
        report["plot"] = plots.plot_throughput_by_k(
            {name: {int(k): row["tokens_per_s"] for k, row in res["per_k"].items()}
             for name, res in result["drafters"].items()},
            result["baseline"]["tokens_per_s"], out / "speculate_tokens_per_s.png",
            ylabel=f"tokens/s ({config.clock} clock, {config.engine})").name
        atomic_write_text(out / "speculate.md", speculate_markdown(report))
        report["provenance"] = {
            **run_metadata(), "stage": "speculate",
            "target": target_source,
            "drafters": {name: source for name, _, source in drafters},
            "prompts_sha256": sha256_file(config.prompts),
            "files": {n: sha256_file(out / n) for n in ("speculate.md", report["plot"])},
        }
        atomic_write_json(out / "speculate.json", report)
        base = result["baseline"]["tokens_per_s"]
        for name, res in result["drafters"].items():
            plain = "sampling" if config.temperature else "greedy"
            msg = (f"{name}: best k={res['best_k']} {res['best_tokens_per_s']:.2f} tok/s = "
                   f"{res['best_speedup']:.2f}x plain {plain} ({base:.2f} tok/s, {config.clock} clock, "
                   f"{config.engine})")
            log.info(msg)
            print(msg)
        if result["mismatches"] and result["exact_engine"]:
            log.error("%d speculative runs differ from plain greedy: see %s", len(result["mismatches"]),
                      out / "speculate.json")
            print(f"ERROR: {len(result['mismatches'])} speculative outputs differ from plain greedy")
            return 1
    return 0
