"""The simple decoders: gpt-fast's small functions over a transformers ``DynamicCache``, and the naive references.

``prefill`` runs the (left-padded) prompts, ``decode_step`` feeds one token per row, ``keep_rows`` drops the
finished ones and ``greedy_dynamic`` loops: the dynamic engine (``decode.iter_greedy`` with
``kv_cache="dynamic"``, and its fallback for models the slot engine cannot run). ``naive_greedy`` and
``naive_draft`` recompute the whole sequence every step with no cache and no padding: the references the fast
paths are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from transformers import DynamicCache

from specdraft.model.forward import (
    cache_kwargs,
    eos_token_ids,
    left_pad,
    model_device,
    pad_token_id,
    positions_from_mask,
)
from specdraft.model.generation import DraftSampling, Generation, RowSampler
from specdraft.model.sampling import sample_from, warp_probs


@dataclass
class DecodeState:
    """What one batch carries between steps: the cache, the 2-D mask and each row's next position."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] 1 = real token, 0 = left padding
    next_position: torch.Tensor  # [B] position id of the next token fed for each row
    rows: list[int] = field(default_factory=list)  # index of each live row in the caller's list


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


@torch.inference_mode()
def greedy_dynamic(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int]) -> list[Generation]:
    """One left-padded batch over a DynamicCache; finished rows leave the batch."""
    device = model_device(model)
    ids, mask = left_pad(prompts, pad_token_id(model), device)
    token, state = prefill(model, ids, mask)
    results: list[list[int]] = [[] for _ in prompts]
    finish: list[str] = ["length"] * len(prompts)
    while True:
        done = []
        for i, (row, tok) in enumerate(zip(state.rows, token.tolist())):
            results[row].append(tok)
            if tok in eos:
                finish[row] = "eos"
                done.append(i)
            elif len(results[row]) >= max_new_tokens:
                done.append(i)
        if len(done) == len(state.rows):
            break
        if done:
            gone = set(done)
            keep = torch.tensor([i for i in range(len(state.rows)) if i not in gone], device=device)
            token = token[keep]
            keep_rows(state, keep)
        token = decode_step(model, token, state)
    return [Generation(tokens=r, finish_reason=f) for r, f in zip(results, finish)]


@torch.inference_mode()
def naive_draft(model, prompt: Sequence[int], num_tokens: int, sampling: DraftSampling) -> Generation:
    """Reference for ``draft_rows``: one row, no cache, the full sequence recomputed every step; each token the
    argmax or drawn from ``warp_probs`` of the last position's logits with a generator seeded as the row's; a
    guided row takes, of the tokens its guides that agree with it so far propose, the most likely (the argmax where
    proposed, the first proposed on a tie) while that has at least ``guide_min_ratio`` of the top probability."""
    device = model_device(model)
    generator = RowSampler(sampling, device).generator  # None when greedy
    seq, out, probs = list(prompt), [], []
    live = [list(g) for g in sampling.guides if g]
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1]
        warped = warp_probs(logits, sampling.params)
        tok = int(logits.argmax()) if generator is None else int(sample_from(warped, generator))
        offered = [g[len(out)] for g in live if len(out) < len(g)]
        if offered:
            softmax = torch.softmax(logits.float(), -1)
            best = max(offered, key=lambda t: (float(softmax[t]), t == tok))
            if best == tok or float(softmax[best]) >= sampling.guide_min_ratio * float(softmax.max()):
                tok = best
                live = [g for g in live if len(out) < len(g) and g[len(out)] == best]
            else:
                live = []
        else:
            live = []
        out.append(tok)
        probs.append(1.0 if generator is None else float(warped[tok]))  # greedy: one-hot at the token taken
        seq.append(tok)
    return Generation(out, "length", probs=probs)


@torch.inference_mode()
def naive_greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int] | None = None,
                 stop_at_eos: bool = True) -> Generation:
    """Reference decoder: one row, no cache, no padding; the full sequence is recomputed every step."""
    device = model_device(model)
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


@torch.inference_mode()
def transformers_greedy(model, context: Sequence[int], n: int) -> list[int]:
    """n greedy tokens from transformers' own forward and ``DynamicCache`` (no EOS stop, as a draft is asked for n):
    a reference that shares no code with specdraft's decoders."""
    cache, ids, out = DynamicCache(), torch.tensor([list(context)]), []
    for _ in range(n):
        logits = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
        out.append(int(logits.argmax()))
        ids = torch.tensor([[out[-1]]])
    return out
