"""Batched greedy decoding with a KV cache, written once and used by traces, the draft server and eval.

The decode loop: ``iter_greedy`` (each prompt's result as soon as it is done), ``greedy_decode`` (all of
them, in input order), ``draft_batch`` / ``draft_rows`` (the draft server's exact rows, greedy or with per-row
``DraftSampling``) and ``prefill_group`` (which waiting prompts share one left-padded prefill). Every row keeps
its own positions (``cumsum(mask) - 1``), so a row decoded inside a left-padded batch sees exactly what it
would see alone.

Two engines share those rules:

* **slot engine** (the default, ``kv_cache="static"``; ``model.slot_engine``): a preallocated ``SlotCache``,
  one slot per batch row, written in place at each row's own column (no ``torch.cat`` per step). Rows that
  finish (EOS or the limit) leave their slot and waiting prompts are prefilled into the free slots (continuous
  batching), so the batch stays full instead of decoding padding until its longest row ends. Needs a model
  whose layers all use full attention through ``sdpa`` or ``eager`` (Llama, Qwen2/3, Mistral without a window,
  ...). Its decode steps run ``lean.LeanForward`` (the forward written out; bit-identical logits) where the
  model allows it.
* **dynamic engine** (``kv_cache="dynamic"``, and the fallback for any other model; ``model.simple_decode``):
  gpt-fast's small ``prefill`` / ``decode_step`` / ``keep_rows`` functions over a transformers
  ``DynamicCache``; one left-padded batch, finished rows dropped.

``model.simple_decode`` also holds the no-cache references (``naive_greedy``, ``naive_draft``) the engines are
tested against; ``model.generation`` what a row yields and how it samples; ``model.forward`` the shared pieces
around a model's forward (left padding, EOS / pad ids, ``extend``).
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator, Literal, Sequence

import torch

from specdraft.model.forward import eos_token_ids
from specdraft.model.generation import DraftSampling, Generation
from specdraft.model.simple_decode import greedy_dynamic
from specdraft.model.slot_engine import SlotDecoder, supports_slot_cache

KVCache = Literal["auto", "static", "dynamic"]
DEFAULT_PREFILL_TOKENS = 8192  # most prompt tokens (padding included) run through one prefill forward
DEFAULT_MAX_PADDING = 0.1  # most padding in a prefill group, as a fraction of its tokens


@torch.inference_mode()
def iter_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                batch_size: int | None = None, eos_ids: Iterable[int] | None = None, stop_at_eos: bool = True,
                order: Sequence[int] | None = None, kv_cache: KVCache = "auto", refill_min: int = 1,
                prefill_tokens: int = DEFAULT_PREFILL_TOKENS, max_padding: float = DEFAULT_MAX_PADDING,
                lean: bool = True, exact_rows: bool = False, top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
    """Greedy continuation of every prompt, yielded as ``(index, Generation)`` the moment a row finishes.

    At most ``batch_size`` rows decode together (all prompts when None). Prompts enter in ``order``
    (default: as given; sort by length to keep prefill padding small). With the slot engine a finished
    row's slot is refilled from the waiting prompts (once ``refill_min`` slots are free); prompts are
    prefilled in left-padded groups of at most ``prefill_tokens`` tokens with at most ``max_padding`` of
    them padding (see ``prefill_group``). The dynamic engine decodes consecutive groups of ``batch_size``
    instead. ``lean`` lets the slot engine's decode steps run ``lean.LeanForward`` where the model allows it
    (same logits, less overhead; False: always the model's own forward). ``exact_rows`` makes every row get
    the logits it gets alone, bit for bit, on the lean path with int4 weights: prompts of different lengths are
    prefilled apart (``max_padding`` 0) and decode steps attend row by row (one attention call per row).
    ``top_logprobs`` k > 0 adds the k most likely tokens and their log-probabilities at every generated position
    to each Generation (slot engine only).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    n = len(prompts)
    if n == 0:
        return
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of the prompt indices")
    batch_size = n if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    eos = set(eos_token_ids(model) if eos_ids is None else eos_ids) if stop_at_eos else set()
    if kv_cache == "auto":
        kv_cache = "static" if supports_slot_cache(model) else "dynamic"
    if kv_cache == "dynamic":
        if top_logprobs:
            raise ValueError("top_logprobs needs the slot engine (models with full attention in every layer)")
        for s in range(0, n, batch_size):
            group = order[s:s + batch_size]
            yield from zip(group, greedy_dynamic(model, [prompts[i] for i in group], max_new_tokens, eos))
        return
    if kv_cache != "static":
        raise ValueError(f"kv_cache must be auto, static or dynamic, not {kv_cache!r}")
    slots = min(batch_size, n)
    capacity = max(len(p) for p in prompts) + max_new_tokens
    if exact_rows:
        max_padding = 0.0
    decoder = SlotDecoder(model, slots, capacity, max_new_tokens, eos, lean=lean, row_attention=exact_rows,
                          top_logprobs=top_logprobs)
    waiting = deque(order)
    refill_min = max(1, min(refill_min, slots))
    while waiting or decoder.n:
        if waiting and (decoder.free >= refill_min or decoder.n == 0):
            group = prefill_group(waiting, [len(p) for p in prompts], decoder.free, prefill_tokens, max_padding)
            yield from decoder.admit(group, [prompts[i] for i in group])
            continue  # admit again while slots are free (a group may have been cut short)
        yield from decoder.step()


def prefill_group(waiting: deque, lengths: Sequence[int], free: int, max_tokens: int,
                  max_padding: float) -> list[int]:
    """Take the next prompts off ``waiting`` for one left-padded prefill forward: at most ``free`` of them,
    at most ``max_tokens`` tokens with padding, and padding at most ``max_padding`` of the group's tokens
    (on a CPU a padding token costs as much as a real one, while one more forward costs only a few)."""
    group = [waiting.popleft()]
    width, real = lengths[group[0]], lengths[group[0]]
    while waiting and len(group) < free:
        nxt = lengths[waiting[0]]
        w, n = max(width, nxt), len(group) + 1
        if w * n > max_tokens or w * n - (real + nxt) > max_padding * w * n:
            break
        group.append(waiting.popleft())
        width, real = w, real + nxt
    return group


@torch.inference_mode()
def greedy_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_ids: Iterable[int] | None = None, stop_at_eos: bool = True, *,
                  batch_size: int | None = None, kv_cache: KVCache = "auto", lean: bool = True,
                  exact_rows: bool = False) -> list[Generation]:
    """Greedy continuation of every prompt, stopping per row at EOS or the limit; results in input order.

    All prompts decode as one batch unless ``batch_size`` is given (then the batch is refilled as rows
    finish). Finished rows leave the batch, so the remaining rows do not pay for them.
    """
    results: list[Generation | None] = [None] * len(prompts)
    for i, gen in iter_greedy(model, prompts, max_new_tokens, batch_size=batch_size, eos_ids=eos_ids,
                              stop_at_eos=stop_at_eos, kv_cache=kv_cache, lean=lean, exact_rows=exact_rows):
        results[i] = gen
    return results  # type: ignore[return-value]


@torch.inference_mode()
def draft_batch(model, contexts: Sequence[Sequence[int]], num_tokens: int, lean: bool = True) -> list[list[int]]:
    """Exactly ``num_tokens`` greedy tokens per context (no EOS stop): what the draft server returns.

    Each row gets exactly what it gets alone (``exact_rows``; int4 weights on the lean path): contexts of
    different lengths are prefilled apart and decode steps attend row by row."""
    return [g.tokens for g in greedy_decode(model, contexts, num_tokens, stop_at_eos=False, lean=lean,
                                            exact_rows=True)]


@torch.inference_mode()
def draft_rows(model, contexts: Sequence[Sequence[int]], num_tokens: int, sampling: Sequence[DraftSampling],
               lean: bool = True) -> list[Generation]:
    """``num_tokens`` draft tokens per context, each row as its ``sampling`` says (with its probabilities when
    asked): ``draft_batch`` with per-row settings. Exact rows, as the server's lanes: every row gets what it
    gets alone, a seeded sampled row included."""
    if len(sampling) != len(contexts):
        raise ValueError(f"{len(contexts)} contexts but {len(sampling)} sampling settings")
    if not contexts:
        return []
    decoder = SlotDecoder(model, len(contexts), max(map(len, contexts)) + num_tokens, num_tokens, eos=set(),
                          lean=lean, row_attention=True)
    lengths = [len(c) for c in contexts]
    waiting = deque(range(len(contexts)))
    results: dict[int, Generation] = {}
    while waiting:  # one slot per context: admission never waits for a step
        group = prefill_group(waiting, lengths, decoder.free, DEFAULT_PREFILL_TOKENS, 0.0)
        results.update(decoder.admit(group, [contexts[i] for i in group], [sampling[i] for i in group]))
    while decoder.n:
        results.update(decoder.step())
    return [results[i] for i in range(len(contexts))]
