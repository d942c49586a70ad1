"""`specdraft speculate`: lossless greedy speculative decoding at batch 1, timed against plain greedy.

One step: the drafter proposes k tokens for the current sequence; the target runs once on
[last token, d1..dk] with its KV cache and takes the argmax at every position (p0..pk); the longest
prefix of the draft with d_i == p_{i-1} is kept, plus the target's own next token p_n; the target's
cache is cropped back to the kept tokens. Every output token is a target argmax, so the output equals
the target's plain greedy decoding (``specdraft.decode.greedy_decode``); the stage checks that for every
prompt, drafter and k, and a mismatch is an error.

Drafters here are "proposers" with ``propose(context_ids, k) -> list[int]`` at batch 1:
``CachedDraftModel`` keeps the draft's own KV cache across steps (rolled back to the longest common
prefix with the new context), ``DrafterProposer`` wraps any batch drafter (``ModelDrafter`` re-prefilling
the whole context every step, ``HTTPDrafter``, ``LookupDrafter``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, field_validator

from .config import StageConfig
from .decode import cache_kwargs, eos_token_ids, greedy_decode
from .drafters import DEFAULT_HYBRID_MIN_NGRAM, lookup_draft
from .lean import CompiledSteps, lean_forward
from .metrics import accepted_length
from .models import DEFAULT_TARGET
from .provenance import atomic_write_json, atomic_write_text, run_metadata, sha256_file, stage_log, text_lines

log = logging.getLogger("specdraft.speculate")


# Where an in-process draft stops a step's draft, per rule (``SpeculateConfig.draft_stop``). "probability": the
# token's own top probability, the rule and threshold of transformers' assisted generation; "calibrated": the
# estimated probability that the whole draft so far is accepted (``AcceptanceCalibration``), a threshold chosen
# by simulating both rules on the self-draft's and the trained draft's drafts (BENCHMARKS.md, "Where a draft stops").
DEFAULT_DRAFT_CONFIDENCE = {"probability": 0.4, "calibrated": 0.6}


# the drafters build_proposers names itself; an also_draft must not take one of them
RESERVED_DRAFTER_NAMES = frozenset({"baseline", "draft", "draft-eager", "draft-hf", "draft-prob", "draft-reprefill",
                                    "draft+lookup", "lookup", "server"})


class SpeculateConfig(StageConfig):
    target: str = Field(DEFAULT_TARGET, description="target model spec (local dir | hub:ORG/NAME@REV | embedded:NAME)")
    draft: str = Field(description="drafter: a draft server URL (http://...), a model dir (packed QD04 or HF "
                                   "checkpoint) or 'lookup' (model-free prompt lookup)")
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
                        "cache, lean, compile, compute and confidence settings; repeatable")
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
        "on", description="in-process draft model: decode through specdraft.lean (the forward written out, same "
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
    draft_compute: Literal["float32", "bfloat16", "int4"] = Field(
        "int4", description="in-process draft's linear layers: int4 (the QD04 codes run by torch's CPU int4 "
                            "kernel, as the server runs them; about 3x faster per draft step than float32 on "
                            "the stand-in), bfloat16 or float32 (the target always runs as loaded)")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default)")
    warmup: bool = Field(True, description="one short untimed run of every configuration first")
    note: str | None = Field(None, description="a line for speculate.md, e.g. what the draft is")
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


# ----------------------------------------------------------------------------------------- proposers

class NoDraft:
    """Proposes nothing: the speculative loop then runs plain greedy, one target forward per token.
    The baseline timed against speculation (same loop, same cache handling, same run)."""

    name = "none"

    def reset(self) -> None:
        pass

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return []


class DrafterProposer:
    """Batch-1 view of a stateless batch drafter (``.draft(contexts, n)``)."""

    def __init__(self, drafter, name: str | None = None):
        self.drafter = drafter
        self.name = name or getattr(drafter, "name", type(drafter).__name__)

    def reset(self) -> None:
        pass

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        return list(self.drafter.draft([context], k)[0])[:k]


class HybridProposer:
    """Batch-1 ``drafters.HybridDrafter``: prompt lookup when the context's last ``min_ngram``+ tokens occurred
    before (no draft forward at all), the wrapped proposer otherwise. A kept draft cache stays correct across
    skipped steps: ``CachedDraftModel`` catches up on whatever the context gained since its last call."""

    def __init__(self, proposer, min_ngram: int = DEFAULT_HYBRID_MIN_NGRAM, name: str | None = None):
        if not 1 <= min_ngram <= 4:  # lookup_draft matches n-grams of 4 tokens at most
            raise ValueError(f"min_ngram must be in 1..4, got {min_ngram}")
        self.proposer, self.min_ngram = proposer, min_ngram
        self.name = name or f"{getattr(proposer, 'name', 'draft')}+lookup"
        self.lookup_steps = self.model_steps = 0

    def reset(self) -> None:
        self.proposer.reset()

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        copied = lookup_draft(context, k, min_ngram=self.min_ngram)
        if copied:
            self.lookup_steps += 1
            return copied
        self.model_steps += 1
        return self.proposer.propose(context, k)


def _crop_to(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (``crop(-n)`` removes n in every version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _forward(model, ids: Sequence[int], cache, start: int, logits_to_keep: int = 0):
    """Batch-1 forward of ``ids`` at positions start.. on top of ``cache`` (which holds positions < start)."""
    device = next(model.parameters()).device
    n = len(ids)
    return model(input_ids=torch.tensor([list(ids)], device=device),
                 attention_mask=torch.ones((1, start + n), dtype=torch.long, device=device),
                 position_ids=torch.arange(start, start + n, device=device)[None],
                 use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(model, cache)).logits


class AcceptanceCalibration:
    """How often the target keeps a drafted token, by the draft's own probability for it: per bin of that
    probability, P(kept | every earlier token of its draft kept), counted over the run.

    A draft's probability alone says little about acceptance: the self-draft (the target packed) has 98% of
    its tokens with p < 0.4 accepted, the trained 24-layer draft 14-54% (BENCHMARKS.md, "Where a draft stops").
    Each bin starts from its own probability, as if the draft were calibrated, worth ``prior_weight`` tokens.
    """

    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.kept = [(b + 0.5) / bins * prior_weight for b in range(bins)]
        self.seen = [prior_weight] * bins

    def _bin(self, probability: float) -> int:
        return min(int(probability * len(self.seen)), len(self.seen) - 1)

    def estimate(self, probability: float) -> float:
        b = self._bin(probability)
        return self.kept[b] / self.seen[b]

    def observe(self, probabilities: Sequence[float], kept: int, refused: bool) -> None:
        """One draft's outcome: its first ``kept`` tokens accepted, and the next one refused when ``refused``.
        Tokens after a refused one tell nothing: the target never saw their context."""
        for i, p in enumerate(probabilities[: kept + int(refused)]):
            b = self._bin(p)
            self.seen[b] += 1
            self.kept[b] += i < kept


class CachedDraftModel:
    """A draft LM that keeps its KV cache between steps.

    ``tokens`` lists the ids whose keys/values are in the cache. Each ``propose`` keeps the longest
    common prefix of ``tokens`` and the new context (the accepted part of the previous draft), crops
    the rest, feeds only the new tokens, then decodes k tokens greedily one at a time, fewer when ``stop``
    says so: "probability", after a token whose probability is below ``min_confidence``; "calibrated", once
    the estimated probability that every token drafted so far is accepted falls below it (the estimate per
    token from ``AcceptanceCalibration``, which learns from each new context how much of the previous draft
    the target kept). ``lean``: through ``lean.LeanForward`` where the model allows;
    ``compile``: its one-token steps through ``torch.compile`` (``lean.CompiledSteps``: faster; logits not
    bit-identical to eager -- harmless here, the target verifies every drafted token).
    """

    def __init__(self, model, name: str = "draft", lean: bool = True, min_confidence: float | None = None,
                 compile: bool = False, stop: Literal["probability", "calibrated"] = "probability"):
        self.model, self.name = model.eval(), name
        self.lean = lean_forward(model, compile=compile) if lean else None
        self.compiled = isinstance(self.lean, CompiledSteps)
        # Stopping short of k: each further token costs a draft step and is less likely to be accepted.
        self.min_confidence = min_confidence
        self.stop = stop
        # Kept across prompts (``reset``): it describes the draft against this target, not one sequence. None
        # without a threshold: a draft that always drafts k has nothing to decide with it.
        self.calibration = AcceptanceCalibration() if stop == "calibrated" and min_confidence else None
        self.reset()

    def _forward(self, ids: Sequence[int], start: int) -> torch.Tensor:
        """Last-position logits of ``ids`` fed at positions start..; steps and short catch-ups (the accepted
        drafts and the bonus token) take the lean forward, on the 4-bit codes of an int4 draft; the context's
        prefill takes the model's own (its dense path): the rule of ``server.engine.is_prefill``, called."""
        from .server.engine import is_prefill

        n = len(ids)
        device = next(self.model.parameters()).device
        positions = torch.arange(start, start + n, device=device)[None]  # [1, n]
        if self.lean is None or is_prefill({"position_ids": positions}):
            return _forward(self.model, ids, self.cache, start, logits_to_keep=1)
        # one new token sees every cached key (no mask); several need the causal pattern over the cache
        mask = None if n == 1 else (torch.arange(start + n, device=device) <= positions[0, :, None])[None, None]
        return self.lean(torch.tensor([list(ids)], device=device), positions, mask, self.cache)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.tokens: list[int] = []
        self.fed_tokens = 0  # context tokens run through the draft (prefill + catch-up), for the report
        self._last_draft: tuple[int, list[int], list[float]] | None = None  # (context length, tokens, probs)

    def _learn(self, context: list[int], common: int) -> None:
        """What the target did with the previous draft, read off the new context (which holds the target's
        greedy tokens after the previous one, whoever drafted them)."""
        start, draft, probs = self._last_draft
        self._last_draft = None
        if common < start:  # not a continuation of the context that draft was made for
            return
        after = context[start:]
        kept = accepted_length(draft, after)
        self.calibration.observe(probs, kept, refused=kept < min(len(draft), len(after)))

    def _stop_after(self, probs: list[float], still_kept: float) -> tuple[bool, float]:
        """(stop drafting, the estimated probability that every token so far is accepted); with a threshold."""
        if self.calibration is None:
            return probs[-1] < self.min_confidence, still_kept
        still_kept *= self.calibration.estimate(probs[-1])
        return still_kept < self.min_confidence, still_kept

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        context = list(context)
        common = 0
        for a, b in zip(self.tokens, context):
            if a != b:
                break
            common += 1
        if self.calibration is not None and self._last_draft is not None:
            self._learn(context, common)
        common = min(common, len(context) - 1)  # feed at least one token to get the next logits
        _crop_to(self.cache, common)
        del self.tokens[common:]
        feed = context[common:]
        logits = self._forward(feed, common)
        self.tokens.extend(feed)
        self.fed_tokens += len(feed)
        out, probs, still_kept = [int(logits[0, -1].argmax())], [], 1.0
        for _ in range(k - 1):
            if self.min_confidence:
                probs.append(_top_probability(logits))
                stop, still_kept = self._stop_after(probs, still_kept)
                if stop:
                    break
            logits = self._forward(out[-1:], len(self.tokens))
            self.tokens.append(out[-1])
            out.append(int(logits[0, -1].argmax()))
        if self.calibration is not None:
            if len(probs) < len(out):  # the last token's probability, not needed to decide
                probs.append(_top_probability(logits))
            self._last_draft = (len(context), out, probs)
        return out


def _top_probability(logits: torch.Tensor) -> float:
    """Probability of the greedy token at the last position of [1, T, V] logits."""
    return float(torch.softmax(logits[0, -1].float(), -1).max())


# --------------------------------------------------------------------------------------- speculation

@dataclass
class SpecGeneration:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    steps: int = 0  # verify passes of the target (the prefill not counted)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accepted_per_step: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


class DrafterError(RuntimeError):
    pass


@torch.inference_mode()
def speculative_generate(target, proposer, prompt: Sequence[int], max_new_tokens: int, k: int,
                         eos_ids=None) -> SpecGeneration:
    """Greedy speculative decoding of one prompt; the tokens equal ``greedy_decode(target, [prompt], ...)``."""
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if k < 1:
        raise ValueError("k must be >= 1")
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    vocab = target.config.vocab_size
    eos = set(eos_token_ids(target) if eos_ids is None else eos_ids)
    proposer.reset()
    cache = DynamicCache(config=target.config)
    started = time.perf_counter()
    logits = _forward(target, prompt, cache, 0, logits_to_keep=1)
    gen = SpecGeneration(tokens=[int(logits[0, -1].argmax())], finish_reason="length")
    gen.verify_seconds += time.perf_counter() - started
    if gen.tokens[0] in eos:
        gen.finish_reason = "eos"
        return gen
    while len(gen.tokens) < max_new_tokens:
        # Drafting more than the tokens still wanted (minus the target's own bonus token) is wasted work.
        kk = min(k, max_new_tokens - len(gen.tokens) - 1)
        t0 = time.perf_counter()
        draft = proposer.propose(prompt + gen.tokens, kk)[:kk] if kk > 0 else []
        t1 = time.perf_counter()
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in draft):
            raise DrafterError(f"drafter {getattr(proposer, 'name', proposer)!r} proposed ids outside the "
                               f"target vocab (0..{vocab - 1}): {draft}")
        start = len(prompt) + len(gen.tokens) - 1  # the cache holds everything but the last token
        logits = _forward(target, [gen.tokens[-1]] + draft, cache, start)
        preds = logits[0].argmax(-1).tolist()  # preds[i]: target's next token after draft[:i]
        n = accepted_length(draft, preds)
        _crop_to(cache, start + 1 + n)
        gen.verify_seconds += time.perf_counter() - t1
        gen.draft_seconds += t1 - t0
        gen.steps += 1
        gen.drafted += len(draft)
        gen.accepted += n
        gen.accepted_per_step.append(n)
        for tok in draft[:n] + [preds[n]]:
            gen.tokens.append(tok)
            if tok in eos:
                gen.finish_reason = "eos"
                return gen
            if len(gen.tokens) >= max_new_tokens:
                break
    return gen


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if list(a) == list(b):
        return None
    return accepted_length(a, b)


# ------------------------------------------------------------------------------------------- prompts

@dataclass
class Prompt:
    id: str
    ids: list[int]


def chat_prompt_ids(tokenizer, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of one user prompt: the traces stage's templating (``specdraft.traces.encode_prompts``:
    chat template with add_generation_prompt) so that speculation sees what the draft was trained on."""
    if chat_template:
        from .traces import encode_prompts

        return encode_prompts(tokenizer, [text])[0]
    return list(tokenizer(text)["input_ids"])


def load_prompts(path: str | os.PathLike, tokenizer, limit: int | None = None,
                 chat_template: bool = True) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such prompts file")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    vocab = len(tokenizer)
    for lineno, line in text_lines(path):
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        pid = str(obj.get("id", obj.get("question_id", lineno)))
        ids_field = next((f for f in ("context_ids", "prompt_ids") if f in obj), None)
        if ids_field:
            ids = obj[ids_field]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise ValueError(f"{where}: field {ids_field!r} must be a non-empty list of token ids "
                                 f"(integers in 0..{vocab - 1}, the target tokenizer's)")
            if "offset" in obj:
                pid = f"{pid}@{obj['offset']}"
        elif isinstance(obj.get("prompt"), str):
            ids = chat_prompt_ids(tokenizer, obj["prompt"], chat_template)
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            ids = chat_prompt_ids(tokenizer, obj["turns"][0], chat_template)
        else:
            raise ValueError(f"{where}: no prompt: expected 'prompt' (str), 'turns' (list of str), "
                             "'context_ids' or 'prompt_ids'")
        if ids_field and "offset" in obj:
            base = str(obj.get("id"))
            if base in seen:  # validation points: one speculation per prompt, from its first point
                continue
            seen.add(base)
        prompts.append(Prompt(pid, list(ids)))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# ------------------------------------------------------------------------------------------- drafters

def build_layer_truncated_draft(target_spec: str, num_layers: int, out_dir: str | os.PathLike) -> Path:
    """A stand-in draft: the target's first ``num_layers`` layers (+ its norm and head), as an HF dir."""
    from .models import load_model, load_tokenizer

    model, tokenizer = load_model(target_spec), load_tokenizer(target_spec)
    if not 1 <= num_layers <= len(model.model.layers):
        raise ValueError(f"num_layers must be in 1..{len(model.model.layers)}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    return out


def _check_tokenizer(draft_dir: Path, target_tokenizer) -> None:
    from transformers import AutoTokenizer

    from .models import tokenizer_fingerprint

    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_dir)
    except Exception as e:  # a dir without tokenizer files: nothing to compare
        log.warning("draft %s: no tokenizer to compare with the target's (%s)", draft_dir, e)
        return
    if tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(target_tokenizer):
        raise ValueError(f"draft {draft_dir}: its tokenizer differs from the target's (vocabulary hash "
                         "mismatch); a draft must share the target's token ids")


def build_proposers(config: SpeculateConfig, target_tokenizer) -> list[tuple[str, Any, dict]]:
    """(name, proposer, source) for the draft named in the config, plus the lookup peer baseline and every
    ``also_draft``."""
    from .drafters import LookupDrafter, ModelDrafter
    from .evaluate import HTTPDrafter

    out: list[tuple[str, Any, dict]] = []
    spec = config.draft
    lean = config.draft_lean != "off"
    compiled = lean and config.draft_compile != "off"
    if spec == "lookup":
        out.append(("lookup", DrafterProposer(LookupDrafter()), {"kind": "lookup"}))
    elif spec.startswith(("http://", "https://")):
        http = HTTPDrafter(spec, concurrency=1)
        out.append(("server", DrafterProposer(http, "server"), {"kind": "http", "url": spec}))
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
            out.append((name, DrafterProposer(ModelDrafter(model, name=name, max_batch_size=1), name),
                        {**source, "draft_cache": "reprefill"}))
    if config.hybrid_min_ngram is not None and spec != "lookup":
        # Its own proposer instance (a separate draft cache), so the plain draft's rows stay untouched.
        base_name, base, base_source = out[0]
        if isinstance(base, CachedDraftModel):
            base = CachedDraftModel(base.model, base_name, lean=base.lean is not None,
                                    min_confidence=base.min_confidence, compile=base.compiled, stop=base.stop)
        out.append(("draft+lookup", HybridProposer(base, config.hybrid_min_ngram, "draft+lookup"),
                    {"kind": "hybrid", "min_ngram": config.hybrid_min_ngram, "draft": base_source}))
    if config.baseline_lookup and spec != "lookup":
        out.append(("lookup", DrafterProposer(LookupDrafter()), {"kind": "lookup"}))
    for item in config.also_draft:
        name, _, path = item.partition("=")
        model, source = _in_process_draft(path, f"--also-draft {name} {path!r}: not a directory", config,
                                          target_tokenizer)
        out.append(_kept_cache(config, model, source, name, lean, compiled))
        if config.draft_stop == "both":
            out.append(_kept_cache(config, model, source, f"{name}-prob", lean, compiled, "probability"))
    return out


def _in_process_draft(path: str, not_a_dir: str, config: SpeculateConfig, target_tokenizer) -> tuple[Any, dict]:
    """A draft model dir loaded for in-process drafting, with its source record (``not_a_dir``: the error
    when it is none)."""
    from .evaluate import load_draft_model

    draft_dir = Path(path)
    if not draft_dir.is_dir():
        raise ValueError(not_a_dir)
    _check_tokenizer(draft_dir, target_tokenizer)
    model, source = load_draft_model(draft_dir, config.draft_compute)
    return model, {"kind": "in-process", **source}


def _kept_cache(config: SpeculateConfig, model, source: dict, name: str, lean: bool, compile: bool,
                stop: str | None = None) -> tuple[str, Any, dict]:
    """``stop``: the stop rule (None: the config's; with ``draft_stop`` "both", the calibrated one)."""
    stop = stop or ("calibrated" if config.draft_stop == "both" else config.draft_stop)
    conf = config.stop_threshold(stop)
    return (name, CachedDraftModel(model, name, lean=lean, min_confidence=conf, compile=compile, stop=stop),
            {**source, "draft_cache": "keep", "lean": lean, "compile": compile, "stop": stop,
             "min_confidence": conf})


# -------------------------------------------------------------------------------------------- stage

@dataclass
class _Totals:
    tokens: int = 0
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (at 1 thread: immune to other processes' load)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    mismatches: int = 0
    runs: int = 0
    lookup_steps: int | None = None  # hybrid proposers: steps prompt lookup answered (no draft forward)

    def add(self, gen, wall: float, cpu: float) -> None:
        self.runs += 1
        self.tokens += len(gen.tokens)
        self.seconds += wall
        self.cpu_seconds += cpu
        if isinstance(gen, SpecGeneration):
            self.steps += gen.steps
            self.drafted += gen.drafted
            self.accepted += gen.accepted
            self.draft_seconds += gen.draft_seconds

    def rates(self) -> dict[str, float]:
        return {"wall": self.tokens / self.seconds if self.seconds else 0.0,
                "cpu": self.tokens / self.cpu_seconds if self.cpu_seconds else 0.0}

    def summary(self, baseline: "_Totals", clock: str) -> dict[str, Any]:
        mine, base = self.rates(), baseline.rates()
        speed = {c: mine[c] / base[c] if base[c] else 0.0 for c in mine}
        return {
            "tokens": self.tokens, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
            "tokens_per_s": mine[clock], "speedup": speed[clock],
            "tokens_per_s_wall": mine["wall"], "speedup_wall": speed["wall"],
            "tokens_per_s_cpu": mine["cpu"], "speedup_cpu": speed["cpu"],
            "verify_steps": self.steps,
            "accepted_per_step": self.accepted / self.steps if self.steps else 0.0,
            # the prefill gives each run its first token; every other token came out of a verify step
            "tokens_per_step": (self.tokens - self.runs) / self.steps if self.steps else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            **({"lookup_step_share": self.lookup_steps / self.steps if self.steps else 0.0}
               if self.lookup_steps is not None else {}),
            "draft_time_share": self.draft_seconds / self.seconds if self.seconds else 0.0,
            "mismatches": self.mismatches,
        }


def _timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - w0, time.process_time() - c0


def run_speculation_bench(target, proposers: list[tuple[str, Any, dict]], prompts: Sequence[Prompt],
                          ks: Sequence[int], max_new_tokens: int, warmup: bool = True,
                          progress: bool = False, clock: str = "wall") -> dict[str, Any]:
    """Time plain greedy and every (drafter, k) on every prompt; check each output against greedy.

    Per prompt: ``greedy_decode`` at batch 1 gives the reference tokens (timed too, for information);
    then the baseline (the speculative loop with no drafts: one target forward per token) and every
    speculative run, in an order rotated from prompt to prompt so that machine noise spreads evenly.
    Both clocks are recorded; ``clock`` picks the one behind ``tokens_per_s``, ``speedup`` and best k.
    """
    eos = eos_token_ids(target)
    baseline = ("baseline", NoDraft(), 1)
    runs = [baseline] + [(name, prop, k) for name, prop, _ in proposers for k in ks]
    if warmup and prompts:
        warm = prompts[0].ids
        greedy_decode(target, [warm], min(8, max_new_tokens), eos_ids=eos)
        for _, prop, k in runs:
            speculative_generate(target, prop, warm, min(8, max_new_tokens), k, eos)
    reference = _Totals()
    totals = {(name, k): _Totals() for name, _, k in runs}
    rows, mismatches = [], []
    iterator = prompts
    if progress:
        from tqdm import tqdm
        iterator = tqdm(prompts, desc="speculate", unit="prompt")
    for i, prompt in enumerate(iterator):
        (ref,), wall, cpu = _timed(lambda: greedy_decode(target, [prompt.ids], max_new_tokens, eos_ids=eos))
        reference.add(ref, wall, cpu)
        row = {"id": prompt.id, "prompt_tokens": len(prompt.ids), "new_tokens": len(ref.tokens),
               "finish_reason": ref.finish_reason, "greedy_decode_seconds": wall, "runs": {}}
        shift = i % len(runs)
        for name, prop, k in runs[shift:] + runs[:shift]:
            looked_up = getattr(prop, "lookup_steps", None)
            gen, wall, cpu = _timed(lambda: speculative_generate(target, prop, prompt.ids, max_new_tokens, k, eos))
            tot = totals[(name, k)]
            tot.add(gen, wall, cpu)
            if looked_up is not None:
                tot.lookup_steps = (tot.lookup_steps or 0) + prop.lookup_steps - looked_up
            bad = first_mismatch(gen.tokens, ref.tokens)
            if bad is not None or gen.finish_reason != ref.finish_reason:
                tot.mismatches += 1
                mismatches.append({"prompt": prompt.id, "drafter": name, "k": k, "first_mismatch": bad,
                                   "greedy_tokens": len(ref.tokens), "speculative_tokens": len(gen.tokens)})
                log.error("MISMATCH prompt %s drafter %s k=%d: first differing token at %s", prompt.id, name, k, bad)
            key = "baseline" if name == "baseline" else f"{name}/k={k}"
            row["runs"][key] = {"seconds": wall, "cpu_seconds": cpu, "steps": gen.steps, "accepted": gen.accepted,
                                "drafted": gen.drafted}
        rows.append(row)
    base = totals[("baseline", 1)]
    results: dict[str, dict[str, Any]] = {}
    for name, _, _ in proposers:
        per_k = {str(k): totals[(name, k)].summary(base, clock) for k in ks}
        best_k = max(ks, key=lambda k: per_k[str(k)]["tokens_per_s"])
        results[name] = {"per_k": per_k, "best_k": best_k, "best_tokens_per_s": per_k[str(best_k)]["tokens_per_s"],
                         "best_speedup": per_k[str(best_k)]["speedup"]}
    base_rates, ref_rates = base.rates(), reference.rates()
    return {
        "clock": clock,
        "baseline": {"what": "plain greedy in the same loop (no drafts: one target forward per token), "
                             "alternated with the speculative runs",
                     "tokens": base.tokens, "seconds": base.seconds, "cpu_seconds": base.cpu_seconds,
                     "tokens_per_s": base_rates[clock], "tokens_per_s_wall": base_rates["wall"],
                     "tokens_per_s_cpu": base_rates["cpu"], "mismatches": base.mismatches},
        "greedy_decode": {"what": "specdraft.decode.greedy_decode at batch 1: the reference tokens",
                          "tokens": reference.tokens, "seconds": reference.seconds,
                          "tokens_per_s": ref_rates[clock], "tokens_per_s_wall": ref_rates["wall"],
                          "tokens_per_s_cpu": ref_rates["cpu"]},
        "drafters": results,
        "mismatches": mismatches,
        "lossless": not mismatches,
        "per_prompt": rows,
    }


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
    base = report["baseline"]
    lines = ["# Speculative decoding (greedy, lossless, batch 1)", "",
             f"Target `{cfg['target']}`, draft `{cfg['draft']}`, {report['prompts']} prompts, "
             f"max {cfg['max_new_tokens']} new tokens, target dtype {cfg['dtype']}, "
             f"draft compute {cfg['draft_compute']}, torch threads {report['threads']}"
             + _stop_rule_text(cfg)
             + ("; its decode steps compiled (torch.compile)" if cfg.get("draft_compile", "off") != "off"
                and cfg.get("draft_lean") != "off" else "") + ".", "",
             f"Clock: **{report['clock']}** (tokens/s, speedup and best k use it; the other is in the JSON"
             + ("; CPU time = this process's CPU seconds, at 1 thread immune to other processes' load"
                if report["clock"] == "cpu" else "") + ").", "",
             f"Plain greedy (same decode loop with no drafts, same run, alternated per prompt): "
             f"**{base['tokens_per_s']:.2f} tokens/s** ({base['tokens']} tokens; wall {base['tokens_per_s_wall']:.2f}"
             f", CPU {base['tokens_per_s_cpu']:.2f} tokens/s); `greedy_decode` (the reference): "
             f"{report['greedy_decode']['tokens_per_s']:.2f} tokens/s.", "",
             f"Output identical to plain greedy for every prompt, drafter and k: "
             f"**{'yes' if report['lossless'] else 'NO (' + str(len(report['mismatches'])) + ' mismatches)'}**.", "",
             "| drafter | k | tokens/s | speedup | speedup (wall) | speedup (CPU) | accepted drafts/step | "
             "tokens/step | acceptance | draft time |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in report["drafters"].items():
        for k, row in res["per_k"].items():
            mark = " **(best)**" if int(k) == res["best_k"] else ""
            lines.append(f"| {name} | {k}{mark} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
                         f"{row['speedup_wall']:.2f}x | {row['speedup_cpu']:.2f}x | "
                         f"{row['accepted_per_step']:.2f} | {row['tokens_per_step']:.2f} | "
                         f"{row['acceptance_rate']:.2f} | {row['draft_time_share']:.0%} |")
    lines += ["", "accepted drafts/step = draft tokens kept per target verify pass; tokens/step adds the target's "
              "own token; acceptance = accepted / drafted; draft time = share of wall time spent drafting."]
    for name, res in report["drafters"].items():
        shares = {k: row["lookup_step_share"] for k, row in res["per_k"].items() if "lookup_step_share" in row}
        if shares:
            lines.append(f"{name}: share of steps drafted by prompt lookup instead of the model: "
                         + ", ".join(f"k={k} {v:.0%}" for k, v in shares.items()) + ".")
    for name, error in report.get("compile_errors", {}).items():
        lines.append(f"{name}: torch.compile failed ({error}); its steps ran eagerly.")
    if report.get("plot"):
        lines += ["", f"![tokens/s per k]({report['plot']})"]
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def _compile_errors(proposers: list[tuple[str, Any, dict]]) -> dict[str, str]:
    """{drafter: why torch.compile failed} for compiled drafts that fell back to eager steps."""
    errors = {}
    for name, prop, _ in proposers:
        steps = getattr(getattr(prop, "proposer", prop), "lean", None)
        if isinstance(steps, CompiledSteps) and steps.error:
            errors[name] = steps.error
    return errors


def run_speculate(config: SpeculateConfig) -> int:
    from . import plots
    from .models import describe_source, load_model, load_tokenizer

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    with stage_log(out / "speculate.log"):
        if config.clock == "cpu" and torch.get_num_threads() != 1:
            log.warning("clock=cpu with %d torch threads: CPU seconds add up over threads, so tokens/s on that "
                        "clock is not a rate you would see; use --threads 1", torch.get_num_threads())
        if config.clock == "cpu" and config.draft.startswith(("http://", "https://")):
            log.warning("clock=cpu with a draft server: the server's CPU time is not counted")
        tokenizer = load_tokenizer(config.target)
        target = load_model(config.target, dtype=getattr(torch, config.dtype))
        prompts = load_prompts(config.prompts, tokenizer, config.num_prompts, config.chat_template)
        proposers = build_proposers(config, tokenizer)
        log.info("%d prompts, drafters %s, k %s, %d new tokens", len(prompts), [p[0] for p in proposers],
                 config.k, config.max_new_tokens)
        try:
            result = run_speculation_bench(target, proposers, prompts, config.k, config.max_new_tokens,
                                           warmup=config.warmup, progress=True, clock=config.clock)
        finally:
            for _, prop, _ in proposers:
                closer = getattr(getattr(prop, "drafter", None), "close", None)
                if closer:
                    closer()
        report: dict[str, Any] = {"config": config.to_json_dict(), "note": config.note, "prompts": len(prompts),
                                  "threads": torch.get_num_threads(), **result,
                                  "compile_errors": _compile_errors(proposers)}
        # the measurements first: a failure while rendering them must not lose a long run (rewritten below with
        # the rendered files' records)
        atomic_write_json(out / "speculate.json", report)
        report["plot"] = plots.plot_throughput_by_k(
            {name: {int(k): row["tokens_per_s"] for k, row in res["per_k"].items()}
             for name, res in result["drafters"].items()},
            result["baseline"]["tokens_per_s"], out / "speculate_tokens_per_s.png",
            ylabel=f"tokens/s ({config.clock} clock)").name
        atomic_write_text(out / "speculate.md", speculate_markdown(report))
        report["provenance"] = {
            **run_metadata(), "stage": "speculate",
            "target": describe_source(config.target),
            "drafters": {name: source for name, _, source in proposers},
            "prompts_sha256": sha256_file(config.prompts),
            "files": {n: sha256_file(out / n) for n in ("speculate.md", report["plot"])},
        }
        atomic_write_json(out / "speculate.json", report)
        base = result["baseline"]["tokens_per_s"]
        for name, res in result["drafters"].items():
            msg = (f"{name}: best k={res['best_k']} {res['best_tokens_per_s']:.2f} tok/s = "
                   f"{res['best_speedup']:.2f}x plain greedy ({base:.2f} tok/s, {config.clock} clock)")
            log.info(msg)
            print(msg)
        if result["mismatches"]:
            log.error("%d speculative runs differ from plain greedy: see %s", len(result["mismatches"]),
                      out / "speculate.json")
            print(f"ERROR: {len(result['mismatches'])} speculative outputs differ from plain greedy")
            return 1
    return 0
