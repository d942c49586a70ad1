"""Drafters made from their specs' parts: an in-process draft model (loaded once, its tokenizer checked against the
target's) with its per-drafter settings, a GGUF draft in llama.cpp (refused where llama.cpp would not speculate
with it), and a drafter behind prompt lookup. Each comes with its source record, what a report says of it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from transformers import AutoTokenizer

from specdraft.core.io import sha256_file
from specdraft.drafting.base import Drafter
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.llamacpp import LlamaCppDrafter
from specdraft.drafting.spec import DrafterSpec
from specdraft.model.llamacpp import check_gguf_file, vocab_compatible
from specdraft.model.loader import load_draft
from specdraft.model.specs import tokenizer_fingerprint
from specdraft.quant.compute_choice import SPECULATE_WORKLOAD, ComputeSetting

log = logging.getLogger(__name__)


@dataclass
class BuiltDrafter:
    """A drafter of a run: what it is (``spec``, whose ``name`` keys the report), the drafter, and its source
    record."""

    spec: DrafterSpec
    drafter: Drafter
    source: dict[str, Any]

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class InProcessSettings:
    """How one in-process draft drafts: its KV cache kept across steps or the context re-prefilled every step,
    and with a kept cache the lean forward, torch.compile and where a step's draft stops short of k."""

    cache: Literal["keep", "reprefill"] = "keep"
    lean: bool = True
    compile: bool = False
    stop: Literal["calibrated", "probability"] = "calibrated"
    min_confidence: float | None = None

    def record(self) -> dict[str, Any]:
        """What the source record says of them."""
        if self.cache == "reprefill":
            return {"draft_cache": "reprefill"}
        return {"draft_cache": "keep", "lean": self.lean, "compile": self.compile, "stop": self.stop,
                "min_confidence": self.min_confidence}


def check_draft_tokenizer(draft_dir: Path, target_tokenizer) -> None:
    """Refuse a draft whose tokenizer differs from the target's (a dir without tokenizer files: a warning)."""
    try:
        draft_tok = AutoTokenizer.from_pretrained(draft_dir)
    except Exception as e:  # a dir without tokenizer files: nothing to compare
        log.warning("draft %s: no tokenizer to compare with the target's (%s)", draft_dir, e)
        return
    if tokenizer_fingerprint(draft_tok) != tokenizer_fingerprint(target_tokenizer):
        raise ValueError(f"draft {draft_dir}: its tokenizer differs from the target's (vocabulary hash "
                         "mismatch); a draft must share the target's token ids")


def load_in_process_draft(path: str | os.PathLike, not_a_dir: str, compute: ComputeSetting, device: str,
                          target_tokenizer) -> tuple[Any, dict[str, Any]]:
    """A draft model dir loaded for in-process drafting, with its source record (``not_a_dir``: the error when it
    is none)."""
    draft_dir = Path(path)
    if not draft_dir.is_dir():
        raise ValueError(not_a_dir)
    check_draft_tokenizer(draft_dir, target_tokenizer)
    model, source = load_draft(draft_dir, compute, device=device, workload=SPECULATE_WORKLOAD)
    return model, {"kind": "in-process", **source}


def in_process_drafter(model, name: str, settings: InProcessSettings) -> Drafter:
    """The drafter over a loaded draft model: ``CachedDraftModel`` with a kept cache, else ``ModelDrafter``."""
    if settings.cache == "reprefill":
        return ModelDrafter(model, name=name, max_batch_size=1)
    return CachedDraftModel(model, name, lean=settings.lean, min_confidence=settings.min_confidence,
                            compile=settings.compile, stop=settings.stop)


def llama_cpp_draft(path: str | os.PathLike, target_gguf: Path, n_ctx: int, threads: int, what: str,
                    name: str) -> tuple[Drafter, dict[str, Any]]:
    """A GGUF draft in llama.cpp, refused (with llama.cpp's own reasons) when llama.cpp would not speculate with it
    for this target; ``what``: how the error names it."""
    try:
        path = check_gguf_file(path)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    check = vocab_compatible(target_gguf, path)
    if not check["compatible"]:
        raise ValueError(f"{what} {path}: llama.cpp finds its vocabulary incompatible with the target's "
                         f"{target_gguf.name} ({check})")
    return (LlamaCppDrafter(path, n_ctx=n_ctx, threads=threads, name=name),
            {"kind": "llama.cpp", "gguf": str(path), "sha256": sha256_file(path)})


def behind_lookup(model_drafter: Drafter, model_source: dict[str, Any], min_ngram: int,
                  name: str) -> tuple[Drafter, dict[str, Any]]:
    """``model_drafter`` behind prompt lookup, with its source record. Give it a drafter of its own: a kept cache
    shared with another drafter would follow two sequences."""
    return (HybridDrafter(model_drafter, min_ngram, name=name),
            {"kind": "hybrid", "min_ngram": min_ngram, "draft": model_source})
