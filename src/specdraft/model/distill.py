"""What distilling a draft computes, below the `train` stage's orchestration: the epoch's length-bucketed
micro-batches, the loss of one micro-batch (cross-entropy on the target's tokens, optionally mixed with KL to the
target's logits or to the top-K distribution the traces stored), and the held-out loss.

The losses read the logits at the labelled positions only (``batching.scored_positions`` passed as
``logits_to_keep``): in short traces most positions are prompt, and the vocabulary head and the softmax are a large
share of a small draft's step.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from specdraft.core.records import Example
from specdraft.model.batching import collate, next_tokens, scored_positions

# ------------------------------------------------------------------------------------------- batches

def make_batches(examples: list[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches (indices) for one epoch: shuffle, sort within pools, pack to a token budget."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    pool = 256
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: len(examples[i].input_ids))
        batch: list[int] = []
        width = 0
        for i in chunk:
            n = len(examples[i].input_ids)
            if batch and max(width, n) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, width = [], 0
            batch.append(i)
            width = max(width, n)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def micro_batches(train: list[Example], *, batch_tokens: int, seed: int, grad_accum: int, world: int,
                  rank: int) -> Iterator[list[int]]:
    """This rank's micro-batches, epoch after epoch without end; each epoch is cut to whole optimizer steps
    across the ranks. Rank r takes batches r, r + world, ...: the ranks' micro-batches are disjoint, and a step's
    grad_accum * world of them are the ones a single process with that grad_accum takes for the same step."""
    for epoch in itertools.count():
        batches = make_batches(train, batch_tokens, seed, epoch)
        usable = len(batches) - len(batches) % (grad_accum * world)
        for i in range(rank, usable, world):
            yield batches[i]


# ------------------------------------------------------------------------------------------- losses

def distill_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None,
                 kd_weight: float, temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """CE on the target's next tokens; optionally mixed with KL(teacher || student) at a temperature. ``logits``
    and ``teacher_logits`` ([N, V]) are the models' at the batch's ``scored_positions``, ``labels`` the batch's."""
    ce = F.cross_entropy(logits.float(), next_tokens(labels, labels))
    parts = {"ce": float(ce.detach())}
    if teacher_logits is None:
        return ce, parts
    t = temperature
    kl = F.kl_div(F.log_softmax(logits.float() / t, -1), F.log_softmax(teacher_logits.float() / t, -1),
                  log_target=True, reduction="batchmean") * (t * t)
    parts["kl"] = float(kl.detach())
    return (1 - kd_weight) * ce + kd_weight * kl, parts


def stored_kd_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], kd_weight: float,
                   temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """CE on the target's next tokens mixed with KL(p || q) to the target's stored top-K distribution: p is the
    stored log-probabilities at the temperature, renormalised over the K ids; q is the draft's full softmax at the
    same temperature, read at those ids (so mass the draft puts elsewhere is penalised too). Positions without a
    stored distribution count in the CE only. ``logits`` ([N, V]) are the draft's at the ``scored_positions``."""
    labels = batch["labels"]
    ce = F.cross_entropy(logits.float(), next_tokens(labels, labels))
    parts = {"ce": float(ce.detach())}
    stored = next_tokens(batch["top_mask"], labels)  # [N]
    if not bool(stored.any()):
        return ce, parts
    t = temperature
    student = F.log_softmax(logits[stored].float() / t, dim=-1)  # [M, V]
    teacher = F.log_softmax(next_tokens(batch["top_logprobs"], labels)[stored] / t, dim=-1)  # [M, K], -inf: < K
    drafted = student.gather(-1, next_tokens(batch["top_ids"], labels)[stored])  # [M, K]
    p = teacher.exp()
    kl = (p * (teacher - drafted)).nan_to_num(0.0).sum(-1).mean() * (t * t)  # 0 * (-inf) terms dropped
    parts["kl"] = float(kl.detach())
    return (1 - kd_weight) * ce + kd_weight * kl, parts


def batch_loss(model, batch: dict[str, torch.Tensor], *, teacher=None, kd_stored: bool = False,
               kd_weight: float = 0.5, temperature: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The draft's loss on one collated micro-batch (a forward of ``model``, and of ``teacher`` without gradient
    when given): with ``kd_stored``, ``stored_kd_loss`` (the batch collated with its top-K); else
    ``distill_loss``, with KL to ``teacher``'s logits when there is a teacher."""
    scored = scored_positions(batch["labels"])
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   logits_to_keep=scored).logits  # [N, V]
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     logits_to_keep=scored).logits  # [N, V]
    if kd_stored:
        return stored_kd_loss(logits, batch, kd_weight, temperature)
    return distill_loss(logits, batch["labels"], teacher_logits, kd_weight, temperature)


@torch.no_grad()
def heldout_loss(model, examples: Sequence[Example], pad_id: int, batch_size: int = 8) -> float:
    """Mean cross-entropy per label token."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad_id, device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       logits_to_keep=scored_positions(batch["labels"])).logits  # [N, V]
        labels = next_tokens(batch["labels"], batch["labels"])  # [N]
        total += float(F.cross_entropy(logits.float(), labels, reduction="sum"))
        count += len(labels)
    model.train(was_training)
    return total / max(1, count)
