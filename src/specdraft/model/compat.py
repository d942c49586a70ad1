"""Whether a target (and the draft's start) can go through the pipeline, decided before any stage runs.

``check_pipeline_models`` refuses what no stage could carry, with the reason: a model transformers does not know
as a decoder-only causal LM, a tokenizer without a chat template (every stage encodes prompts as the chat turn a
user sends, ``model.chat``), a draft start whose tokenizer is not the target's, an embedding smaller than the
tokenizer. What only narrows the pipeline is reported, not refused: a model the lean forward does not cover runs
through transformers' own forward (``model.lean``), one the GGUF writer does not cover is exported to Hugging
Face only (``model.export``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specdraft.model.chat import has_chat_template
from specdraft.model.export import GGUF_ARCHS
from specdraft.model.lean import lean_unsupported
from specdraft.model.specs import resolve_model, text_config, tokenizer_fingerprint, tokenizer_from_dir
from specdraft.model.truncate import parse_truncate_spec
from specdraft.quant.qd4 import meta_model


class UnsupportedModelError(ValueError):
    """A target or draft start the pipeline cannot carry; the message lists every reason."""


@dataclass
class PipelineModels:
    """What ``check_pipeline_models`` found: the facts the stages depend on, and what falls back."""

    target: str
    model_type: str
    vocab_rows: int
    tokenizer_entries: int
    draft_init: str | None
    lean_forward: bool
    gguf_export: bool
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_pipeline_models(target: str | os.PathLike, draft_init: str | None = None) -> PipelineModels:
    """Refuse (``UnsupportedModelError``) a target or ``draft_init`` the pipeline cannot carry; else the facts.

    ``draft_init``: a model spec or dir the draft starts from (``from_pretrained``) or a ``truncate:`` spec of the
    target (the target's own layers: its tokenizer by construction)."""
    path = resolve_model(target)
    problems: list[str] = []
    config = AutoConfig.from_pretrained(path)
    model_type = config.model_type
    text = text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        problems.append(f"{target}: an encoder-decoder model ({model_type}); specdraft drafts for decoder-only "
                        "causal LMs")
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        problems.append(f"{target}: model type {model_type!r} is not a causal LM that transformers' "
                        "AutoModelForCausalLM loads")
    tokenizer = tokenizer_from_dir(path)
    if not has_chat_template(tokenizer):
        problems.append(f"{target}: its tokenizer has no chat template; traces, validation and speculation encode "
                        "each prompt as the chat turn a user sends (with the generation prompt, thinking off). "
                        "Add one (chat_template.jinja or tokenizer_config.json's chat_template) or use the chat "
                        "model of the family")
    vocab_rows = int(getattr(text, "vocab_size", 0) or 0)
    if vocab_rows < len(tokenizer):
        problems.append(f"{target}: embedding of {vocab_rows} rows for a tokenizer of {len(tokenizer)} entries")

    if draft_init is not None and parse_truncate_spec(draft_init) is None:
        problems += _draft_problems(draft_init, tokenizer, target)

    if problems:
        raise UnsupportedModelError("the pipeline cannot run on this model:\n  - " + "\n  - ".join(problems))
    # the decode loop's own test, on the model this config builds (meta device: no weights, no memory)
    no_lean = lean_unsupported(meta_model(config).eval())
    gguf = model_type in GGUF_ARCHS
    notes = []
    if no_lean:
        notes.append(f"model type {model_type!r}: decode steps run through transformers' forward (the lean "
                     f"forward does not cover {no_lean})")
    if not gguf:
        notes.append(f"model type {model_type!r}: no GGUF export (the writer covers {', '.join(GGUF_ARCHS)}); "
                     "the Hugging Face export still applies")
    return PipelineModels(target=str(target), model_type=model_type, vocab_rows=vocab_rows,
                          tokenizer_entries=len(tokenizer), draft_init=draft_init, lean_forward=no_lean is None,
                          gguf_export=gguf, notes=notes)


def _draft_problems(draft_init: str, target_tokenizer, target: str | os.PathLike) -> list[str]:
    path = resolve_model(draft_init)
    config = AutoConfig.from_pretrained(path)
    text = text_config(config)
    problems = []
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        problems.append(f"draft start {draft_init}: model type {config.model_type!r} is not a causal LM that "
                        "transformers' AutoModelForCausalLM loads")
    draft_tokenizer = tokenizer_from_dir(path)
    draft_fp, target_fp = tokenizer_fingerprint(draft_tokenizer), tokenizer_fingerprint(target_tokenizer)
    if draft_fp != target_fp:
        problems.append(f"draft start {draft_init}: its tokenizer is not the target's ({len(draft_tokenizer)} "
                        f"entries, vocab sha256 {draft_fp[:12]}; {target}: {len(target_tokenizer)} entries, "
                        f"{target_fp[:12]}); a draft proposes the target's token ids, so both must share one "
                        "tokenizer")
    if int(getattr(text, "vocab_size", 0) or 0) < len(target_tokenizer):
        problems.append(f"draft start {draft_init}: embedding of {text.vocab_size} rows for the target's "
                        f"tokenizer of {len(target_tokenizer)} entries")
    return problems
