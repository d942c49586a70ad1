"""The model side of the server: a loaded draft (``load_engine``) whose ``draft`` runs ``draft_batch``.

Loading is ``model.loader.load_draft``; the compute formats are ``quant.linear``'s. The server adds the lean
decode forward (``model.lean``, built at load) and hands freed memory back to the OS after each step
(``heap_trimmer``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from specdraft.model.decode import draft_batch
from specdraft.model.lean import lean_forward, lean_unsupported
from specdraft.model.loader import load_draft
from specdraft.quant.linear import Compute

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- engine

@dataclass
class Engine:
    """A loaded draft model and what the HTTP layer needs to know about it."""

    model: nn.Module
    name: str
    compute: str
    vocab_size: int
    max_positions: int | None
    weights: str | None
    load_info: dict[str, Any] = field(default_factory=dict)
    lean: bool = True  # decode steps through specdraft.model.lean where the model allows it

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return draft_batch(self.model, contexts, num_tokens, lean=self.lean)

    def bytes_per_token(self) -> int:
        """Weight bytes one decode step reads at batch 1 (linear layers; the embedding row is negligible)."""
        return int(self.load_info.get("linear_weight_bytes", 0))


def heap_trimmer() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (frees every unused heap page back to the OS), or None without glibc.

    Each draft step allocates KV caches and activations sized by its batch and context lengths; glibc keeps
    the freed chunks as a high-water mark, so the RSS would climb with every new shape (bench/bench_memory.py
    measures both).
    """

    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols (libc is loaded): ctypes.util.find_library would spawn ldconfig, and the
        # audit's sandbox rightly counts a server that starts processes as a failure.
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def load_engine(model_dir: str | os.PathLike, weights: str | os.PathLike | None, compute: Compute,
                name: str | None = None, dense_prefill: bool = True, lean: bool = True) -> Engine:
    """The draft for serving (``model.loader.load_draft``), its decode steps' lean forward built now (q/k/v
    fused once) so that the first request does not pay for it."""
    model, source = load_draft(model_dir, compute, weights=weights, dense_prefill=dense_prefill)
    summary = source["compute_summary"]
    lean_reason = ("off (--no-lean)" if not lean else
                   f"off: {lean_unsupported(model)}" if lean_forward(model) is None else "on")
    info = {**source.get("load_info", {}), **summary, "lean_forward": lean_reason, "seconds": source["seconds"]}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    log.info("draft ready: compute=%s, %d linear layers from QD04 codes, %d quantised at load, "
             "%.1f MB of linear weights per token, lean decode %s, %.2fs", compute, summary["from_codes"],
             summary["quantised_at_load"], summary["linear_weight_bytes"] / 1e6, lean_reason, source["seconds"])
    return Engine(model=model, name=name or Path(model_dir).resolve().name, compute=compute,
                  vocab_size=int(text.vocab_size), max_positions=getattr(text, "max_position_embeddings", None),
                  weights=source.get("weights"), load_info=info, lean=lean)
