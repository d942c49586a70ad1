"""Which of the target's layers a ``truncate:`` draft keeps: greedy elimination, scored teacher-forced.

A draft cut from the target loses most where it loses a layer the rest depend on, and which layers those are is a
property of the target, not of their position (dropping one contiguous middle block is a guess). Starting from every
layer, each round removes the layer whose absence raises the cross-entropy of the target's own greedy tokens least,
until ``keep`` remain. Teacher forcing is exact for greedy drafting: a draft's accepted length from a position is the
run of positions where its argmax equals the target's token, so one forward pass per candidate scores it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specdraft.core.records import Example
from specdraft.model.batching import collate, next_tokens, scored_positions


@dataclass(frozen=True)
class LayerScore:
    """A stack of layers, scored on the target's greedy tokens."""

    layers: list[int]
    cross_entropy: float  # mean, per completion token
    agreement: float  # share of completion tokens where the stack's argmax is the target's token
    accepted: float  # mean run of agreeing tokens (of at most ``k``) from every completion position

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LayerDrop:
    """One elimination round: the layer removed and the stack left."""

    dropped: int
    score: LayerScore
    runner_up: int | None  # the next-best layer to remove this round

    def to_json(self) -> dict:
        return {"dropped": self.dropped, "runner_up": self.runner_up, **self.score.to_json()}

    @classmethod
    def from_json(cls, obj: dict) -> "LayerDrop":
        return cls(obj["dropped"], LayerScore(list(obj["layers"]), obj["cross_entropy"], obj["agreement"],
                                              obj["accepted"]), obj["runner_up"])


def accepted_runs(matches: list[bool], k: int) -> list[int]:
    """From every position, how many of the next ``k`` positions agree before the first that does not."""
    runs, current = [0] * len(matches), 0
    for j in range(len(matches) - 1, -1, -1):  # a run from j is 1 + the run from j + 1 while j agrees
        current = current + 1 if matches[j] else 0
        runs[j] = min(current, k)
    return runs


@torch.no_grad()
def score_layers(model, layers: Sequence[int], examples: Sequence[Example], *, k: int = 16, batch_size: int = 8,
                 pad_id: int = 0) -> LayerScore:
    """``model`` computing with only ``layers`` of its decoder stack (restored after), on the examples' targets."""
    stack = model.model.layers
    n_config = model.config.num_hidden_layers
    model.model.layers = torch.nn.ModuleList([stack[i] for i in layers])
    model.config.num_hidden_layers = len(layers)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        ce_sum, tokens, agreeing, runs = 0.0, 0, 0, []
        for start in range(0, len(examples), batch_size):
            batch = collate(examples[start:start + batch_size], pad_id, device)
            scored = scored_positions(batch["labels"])  # [B, T]
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                           logits_to_keep=scored).logits.float()  # [N, V]
            labels = next_tokens(batch["labels"], batch["labels"])  # [N]
            ce_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
            tokens += len(labels)
            match = logits.argmax(-1) == labels
            agreeing += int(match.sum())
            for row_match in match.split(scored.sum(-1).tolist()):
                runs += accepted_runs(row_match.tolist(), k)
    finally:
        model.model.layers = stack
        model.config.num_hidden_layers = n_config
        model.train(was_training)
    return LayerScore(list(layers), ce_sum / max(1, tokens), agreeing / max(1, tokens),
                      sum(runs) / max(1, len(runs)))


def choose_layers(model, examples: Sequence[Example], keep: int, *, fixed: Sequence[int] | None = None,
                  k: int = 16, batch_size: int = 8, pad_id: int = 0,
                  done: Sequence[LayerDrop] = (),
                  progress: Callable[[LayerDrop], None] | None = None) -> list[LayerDrop]:
    """Greedy elimination from the full stack down to ``keep`` layers; the rounds in order (the last one's
    ``score.layers`` is the choice). ``fixed`` layers are never removed (default: the first and the last, which
    map tokens into and out of the residual stream). ``done``: rounds of an interrupted run on the same inputs,
    continued from (the elimination is deterministic, so they are the new run's first rounds)."""
    n_layers = model.config.num_hidden_layers
    if not 1 <= keep <= n_layers:
        raise ValueError(f"keep={keep}: a {n_layers}-layer model keeps 1..{n_layers}")
    fixed = {0, n_layers - 1} if fixed is None else set(fixed)
    if len(fixed) > keep:
        raise ValueError(f"keep={keep} is fewer than the {len(fixed)} fixed layers {sorted(fixed)}")
    rounds = list(done)
    current = list(rounds[-1].score.layers) if rounds else list(range(n_layers))
    while len(current) > keep:
        candidates = sorted(
            ((score_layers(model, [i for i in current if i != j], examples, k=k, batch_size=batch_size,
                           pad_id=pad_id), j) for j in current if j not in fixed),
            key=lambda scored: (scored[0].cross_entropy, scored[1]))
        (best, dropped), runner_up = candidates[0], candidates[1][1] if len(candidates) > 1 else None
        current = best.layers
        drop = LayerDrop(dropped, best, runner_up)
        rounds.append(drop)
        if progress is not None:
            progress(drop)
    return rounds
