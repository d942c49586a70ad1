"""Simulated acceptance: what greedy drafts of a model would accept on the target's own greedy traces, read off one
teacher-forced forward pass per sequence.

Since a trace's completion is the target's greedy continuation, a k-token greedy draft from offset o accepts exactly
the leading run of positions o.. where the draft's teacher-forced argmax equals the completion token: no drafting
loop, and every offset of a sequence scored at once. The counts go through ``AcceptanceStats``, as in
``specdraft eval``; `train` scores its held-out traces with it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.core.records import Example
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.drafting.metrics import AcceptanceStats
from specdraft.model.batching import collate, scored_positions


@torch.no_grad()
def simulated_acceptance(model, examples: Sequence[Example], k: int = DRAFT_TOKENS, pad_id: int = 0,
                         batch_size: int = 8) -> AcceptanceStats:
    """Mean accepted length of k-token greedy drafts at offsets 0, k, 2k, ... of each completion."""
    stats = AcceptanceStats(k=k)
    device = next(model.parameters()).device
    model_was_training = model.training
    model.eval()
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = collate(chunk, pad_id, device)
        scored = scored_positions(batch["labels"])  # [B, T]
        preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      logits_to_keep=scored).logits.argmax(-1)  # [N]
        for ex, row_preds in zip(chunk, preds.split(scored.sum(-1).tolist())):
            # the predictions of the completion's tokens (all of them, unless the prompt is empty), in order
            completion = ex.completion[len(ex.completion) - len(row_preds):]
            row_preds = row_preds.tolist()
            for offset in range(0, len(completion) - k + 1, k):
                stats.add(row_preds[offset:offset + k], completion[offset:offset + k], prompt_id=ex.id)
    model.train(model_was_training)
    return stats
