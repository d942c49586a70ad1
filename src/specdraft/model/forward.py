"""Calling a transformers model's own forward, the pieces every decoder here shares.

The name of the cache argument (``cache_kwargs``), left-padded ids with per-row positions (``left_pad``,
``positions_from_mask``), a model's EOS and pad ids and device, and a batch-1 forward on top of a
``DynamicCache`` with its crop (``extend``, ``crop_cache``: the cached drafter, the torch target and
speculative decoding). The engines that use them live in ``simple_decode`` and ``slot_engine``; the
written-out forward is ``lean``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

import torch


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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (``crop(-n)`` removes n in every version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def extend(model, ids: Sequence[int], cache, start: int, logits_to_keep: int = 0):
    """Batch-1 forward of ``ids`` at positions start.. on top of ``cache`` (which holds positions < start)."""
    device = next(model.parameters()).device
    n = len(ids)
    return model(input_ids=torch.tensor([list(ids)], device=device),
                 attention_mask=torch.ones((1, start + n), dtype=torch.long, device=device),
                 position_ids=torch.arange(start, start + n, device=device)[None],
                 use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(model, cache)).logits
