"""Batched greedy decoding with a KV cache, written once and used by traces, the draft server and eval.

The shape follows gpt-fast: ``prefill`` runs the (left-padded) prompts, ``decode_step`` feeds one token
per row, ``greedy_decode`` loops. Every row keeps its own positions (``cumsum(mask) - 1``), so a row
decoded inside a left-padded batch sees exactly what it would see alone. ``naive_greedy`` recomputes the
whole sequence every step with no cache and no padding: the reference the fast path is tested against.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from transformers import DynamicCache


@dataclass
class DecodeState:
    """What one batch carries between steps: the cache, the 2-D mask and each row's next position."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] 1 = real token, 0 = left padding
    next_position: torch.Tensor  # [B] position id of the next token fed for each row
    rows: list[int] = field(default_factory=list)  # index of each live row in the caller's list


@functools.lru_cache(maxsize=None)
def _cache_arg(model_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """transformers renamed ``past_key_values`` to ``cache``; pass whichever this model's forward takes."""
    return {_cache_arg(type(model)): cache}


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: str | torch.device = "cpu"):
    """[B, T] ids and mask with every sequence right-aligned (left padding)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every sequence needs at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
    """Run the prompts; return each row's first greedy token and the state to continue from."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask), use_cache=True, logits_to_keep=1,
                **cache_kwargs(model, cache))
    next_token = out.logits[:, -1, :].argmax(-1)  # [B]
    state = DecodeState(cache=cache, attention_mask=attention_mask,
                        next_position=attention_mask.sum(-1), rows=list(range(input_ids.shape[0])))
    return next_token, state


@torch.inference_mode()
def decode_step(model, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Feed one token per row ([B]); return the next greedy token per row ([B])."""
    state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones((token.shape[0], 1))], -1)
    out = model(input_ids=token[:, None], attention_mask=state.attention_mask,
                position_ids=state.next_position[:, None], use_cache=True, **cache_kwargs(model, state.cache))
    state.next_position = state.next_position + 1
    return out.logits[:, -1, :].argmax(-1)


def keep_rows(state: DecodeState, keep: torch.Tensor) -> None:
    """Drop finished rows from the batch (cache, mask and positions), and trim all-padding columns."""
    state.cache.batch_select_indices(keep)
    state.attention_mask = state.attention_mask[keep]
    state.next_position = state.next_position[keep]
    state.rows = [state.rows[i] for i in keep.tolist()]
    # Columns that are padding for every remaining row carry no information: cut them from the front.
    live = state.attention_mask.any(0).nonzero()
    first = int(live[0]) if live.numel() else 0
    if first > 0:
        state.attention_mask = state.attention_mask[:, first:]
        _crop_left(state.cache, first)


def _crop_left(cache: DynamicCache, n: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, n:, :]
        layer.values = layer.values[:, :, n:, :]


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"


def eos_token_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def pad_token_id(model) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None) or model.config.pad_token_id
    if pad is None:
        pad = next(iter(eos_token_ids(model)), 0)
    return int(pad)


@torch.inference_mode()
def greedy_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_ids: Iterable[int] | None = None, stop_at_eos: bool = True) -> list[Generation]:
    """Greedy continuation of every prompt (one left-padded batch), stopping per row at EOS or the limit.

    Finished rows leave the batch, so the remaining rows do not pay for them.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = next(model.parameters()).device
    eos = set(eos_token_ids(model) if eos_ids is None else eos_ids) if stop_at_eos else set()
    ids, mask = left_pad(prompts, pad_token_id(model), device)
    token, state = prefill(model, ids, mask)
    results: list[list[int]] = [[] for _ in prompts]
    finish: list[str] = ["length"] * len(prompts)
    for step in range(max_new_tokens):
        done = []
        for i, row in enumerate(state.rows):
            tok = int(token[i])
            results[row].append(tok)
            if tok in eos:
                finish[row] = "eos"
                done.append(i)
            elif len(results[row]) >= max_new_tokens:
                done.append(i)
        if len(done) == len(state.rows):
            break
        if done:
            keep = torch.tensor([i for i in range(len(state.rows)) if i not in set(done)], device=device)
            token = token[keep]
            keep_rows(state, keep)
        token = decode_step(model, token, state)
    return [Generation(tokens=r, finish_reason=f) for r, f in zip(results, finish)]


@torch.inference_mode()
def draft_batch(model, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
    """Exactly ``num_tokens`` greedy tokens per context (no EOS stop): what the draft server returns."""
    return [g.tokens for g in greedy_decode(model, contexts, num_tokens, stop_at_eos=False)]


@torch.inference_mode()
def naive_greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int] | None = None,
                 stop_at_eos: bool = True) -> Generation:
    """Reference decoder: one row, no cache, no padding; the full sequence is recomputed every step."""
    device = next(model.parameters()).device
    eos = set(eos_token_ids(model) if eos_ids is None else eos_ids) if stop_at_eos else set()
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            return Generation(out, "eos")
    return Generation(out, "length")
