"""The model side of the server: a loaded draft (``load_engine``) and the lanes the scheduler runs it in.

Loading is ``model.loader.load_draft``; the compute formats are ``quant.linear``'s. A ``SlotLane`` is a
``model.slot_engine.SlotDecoder`` over the draft whose rows are keyed by request: every row attends to its own
columns only and the int4 kernel computes rows independently, so a request gets the tokens it gets alone, whoever
shares its iteration -- a sampled request too, drawing from its own seeded generator. With a prefix cache
(``model.prefix_cache``, one for both lanes) a lane prefills in blocks and copies in the cached prefix of a context:
the same bits with or without a hit. The server adds the lean decode forward (``model.lean``, built at load) and
hands freed memory back to the OS (``heap_trimmer``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from torch import nn

from specdraft.model.decode import draft_batch, draft_rows
from specdraft.model.generation import DraftSampling, Generation, RowSampler
from specdraft.model.lean import lean_forward, lean_unsupported
from specdraft.model.loader import load_draft
from specdraft.model.prefix_cache import PrefixCache
from specdraft.model.slot_engine import SlotDecoder
from specdraft.model.specs import text_config
from specdraft.quant.compute_choice import SERVE_WORKLOAD, ComputeSetting
from specdraft.quant.linear import Int4Prefill
from specdraft.server.scheduler import Draft, Lane

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- engine

@runtime_checkable
class DraftEngine(Protocol):
    """What the HTTP layer uses of a loaded draft: its facts for the request schema and ``/health``, and the
    lanes its scheduler runs. ``Engine`` is the real one; the tests' fakes declare the same."""

    name: str  # the model name returned in responses
    compute: str  # the compute format its linear layers run in
    compute_choice: dict[str, Any]  # that format and why: given, or measured at load (``/health`` shows it)
    vocab_size: int
    max_positions: int | None  # the model's positions (None: its config does not say)

    def lane(self, slots: int, capacity: int, num_draft: int, prefix_cache: PrefixCache | None = None) -> Lane:
        """``slots`` rows decoding together, each holding ``capacity`` tokens (context + ``num_draft``), reusing
        the blocks ``prefix_cache`` holds (None: every context prefilled whole)."""


@dataclass
class Engine:
    """A loaded draft model and what the HTTP layer needs to know about it (a ``DraftEngine``)."""

    model: nn.Module
    name: str
    compute: str
    vocab_size: int
    max_positions: int | None
    weights: str | None
    load_info: dict[str, Any] = field(default_factory=dict)
    lean: bool = True  # decode steps through specdraft.model.lean where the model allows it
    # the compute format and why (``model.loader.resolve_compute``: given, or measured at load)
    compute_choice: dict[str, Any] = field(default_factory=dict)

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return draft_batch(self.model, contexts, num_tokens, lean=self.lean)

    def sample(self, contexts: Sequence[Sequence[int]], num_tokens: int,
               sampling: Sequence[DraftSampling]) -> list[Generation]:
        """Drafts with per-row settings and probabilities, as the server's lanes decode them."""
        return draft_rows(self.model, contexts, num_tokens, sampling, lean=self.lean)

    def lane(self, slots: int, capacity: int, num_draft: int, prefix_cache: PrefixCache | None = None) -> "SlotLane":
        return SlotLane(self.model, slots, capacity, num_draft, lean=self.lean, prefix_cache=prefix_cache)

    def bytes_per_token(self) -> int:
        """Weight bytes one decode step reads at batch 1 (linear layers; the embedding row is negligible)."""
        return int(self.load_info.get("linear_weight_bytes", 0))


class SlotLane:
    """Rows of one KV cache (``SlotDecoder``, exact rows), keyed by the scheduler's request keys."""

    def __init__(self, model: nn.Module, slots: int, capacity: int, num_draft: int, lean: bool = True,
                 prefix_cache: PrefixCache | None = None):
        self.decoder = SlotDecoder(model, slots, capacity, num_draft, eos=set(), lean=lean, row_attention=True,
                                   prefix_cache=prefix_cache)
        self.slots, self.capacity = slots, capacity
        self.block_tokens = 0 if prefix_cache is None else prefix_cache.block_tokens

    @property
    def free(self) -> int:
        return self.decoder.free

    def cached(self, context: Sequence[int]) -> int:
        return self.decoder.reusable(context)

    def _drafts(self, finished: list[tuple[int, Generation]]) -> dict[int, Draft]:
        d = self.decoder
        out = {key: _draft_so_far(toks, sampler) for key, toks, sampler in zip(d.index, d.tokens, d.samplers)}
        out.update({key: Draft(gen.tokens, gen.probs, gen.alternative_ids, gen.alternative_probs,
                               stopped=gen.finish_reason == "confidence")
                    for key, gen in finished})
        return out

    def admit(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
              sampling: Sequence[DraftSampling]) -> dict[int, Draft]:
        drafts = self._drafts(self.decoder.admit(list(keys), list(contexts), list(sampling)))
        return {key: drafts[key] for key in keys}

    def prefill_chunk(self, key: int, context: Sequence[int], start: int, size: int,
                      sampling: DraftSampling) -> dict[int, Draft]:
        finished = self.decoder.prefill_chunk(key, context, start, size, sampling)
        if start + size < len(context):
            return {}
        return {key: self._drafts(finished)[key]}

    def step(self) -> dict[int, Draft]:
        return self._drafts(self.decoder.step())

    def release(self, keys: Sequence[int]) -> None:
        self.decoder.release(keys)


def _draft_so_far(tokens: list[int], sampler: RowSampler | None) -> Draft:
    if sampler is None:
        return Draft(list(tokens))
    report = sampler.report()
    return Draft(list(tokens), report["probs"], report["alternative_ids"], report["alternative_probs"])


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


def load_engine(model_dir: str | os.PathLike, weights: str | os.PathLike | None, compute: ComputeSetting,
                name: str | None = None, prefill: Int4Prefill = "bfloat16", lean: bool = True,
                device: str = "cpu") -> Engine:
    """The draft for serving (``model.loader.load_draft``; ``auto`` measured on the server's workload), its decode
    steps' lean forward built now (q/k/v fused once) so that the first request does not pay for it."""
    model, source = load_draft(model_dir, compute, weights=weights, prefill=prefill, device=device,
                               workload=SERVE_WORKLOAD, row_invariant=True)
    summary = source["compute_summary"]
    lean_reason = ("off (--no-lean)" if not lean else
                   f"off: {lean_unsupported(model)}" if lean_forward(model) is None else "on")
    info = {**source.get("load_info", {}), **summary, "lean_forward": lean_reason, "seconds": source["seconds"],
            "device": source["device"]}
    text = text_config(model.config)
    log.info("draft ready on %s: compute=%s (prefill %s; %s), %d linear layers from QD04 codes, %d quantised at "
             "load, %.1f MB of linear weights per token, lean decode %s, %.2fs", source["device"], summary["compute"],
             summary["prefill"], source["compute_choice"]["reason"], summary["from_codes"],
             summary["quantised_at_load"], summary["linear_weight_bytes"] / 1e6, lean_reason, source["seconds"])
    return Engine(model=model, name=name or Path(model_dir).resolve().name, compute=summary["compute"],
                  vocab_size=int(text.vocab_size), max_positions=getattr(text, "max_position_embeddings", None),
                  weights=source.get("weights"), load_info=info, lean=lean, compute_choice=source["compute_choice"])
