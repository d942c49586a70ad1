"""Examples as padded tensors: what training and the layer search feed the model."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from specdraft.core.records import Example


def collate(examples: Sequence[Example], pad_id: int, device, top_logprobs: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 on prompt and padding); with ``top_logprobs``, the stored top-K
    ids and log-probabilities at the completion positions that have them (``top_mask``)."""
    width = max(len(ex.input_ids) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    k = max((len(ex.top_ids[0]) for ex in examples if ex.top_ids), default=0) if top_logprobs else 0
    top_ids = torch.zeros((len(examples), width, k), dtype=torch.long)  # [B, T, K]
    top_lps = torch.full((len(examples), width, k), -math.inf)  # [B, T, K]: -inf where a row keeps fewer
    top_mask = torch.zeros((len(examples), width), dtype=torch.bool)  # [B, T]
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        mask[row, :n] = 1
        labels[row, ex.prompt_len:n] = (ids[row, ex.prompt_len:n] if ex.targets is None
                                        else torch.tensor(ex.targets, dtype=torch.long))
        if k and ex.top_ids:
            kk = len(ex.top_ids[0])
            top_ids[row, ex.prompt_len:n, :kk] = torch.tensor(ex.top_ids, dtype=torch.long)
            top_lps[row, ex.prompt_len:n, :kk] = torch.tensor(ex.top_logprobs, dtype=torch.float32)
            top_mask[row, ex.prompt_len:n] = True
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
    if k:
        batch.update(top_ids=top_ids.to(device), top_logprobs=top_lps.to(device), top_mask=top_mask.to(device))
    return batch


def scored_positions(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions whose logits predict a labelled token (the next one). Only these carry a loss or
    a score, and in short traces most positions are prompt: passed as ``logits_to_keep``, the model runs its
    vocabulary head and the loss's softmax (a large share of a small draft's training step) at these positions
    alone, and returns their logits row by row, [N, V]."""
    scored = torch.zeros_like(labels, dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != -100
    return scored


def next_tokens(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``values`` ([B, T, ...], laid out like the labels: the entry at t belongs to the token at t) for the tokens
    the logits at ``scored_positions(labels)`` predict, in the same order: [N, ...]."""
    return values[:, 1:][labels[:, 1:] != -100]
