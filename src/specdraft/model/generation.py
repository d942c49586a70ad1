"""What one decoded row yields (``Generation``) and how a row picks its tokens (``DraftSampling``).

The slot engine drafts with per-row sampling settings: temperature, top-k and top-p through
``model.sampling.warp_probs``, a seeded generator per row (``RowSampler``), the draft's probability of each
token and the warped distribution's most likely tokens (``top_alternatives``); traces ask for the target's top
log-probabilities (``top_logprobs_of``). Kept apart from the engines so that the server's schema and scheduler
can name a row's settings without the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "eos" | "length" | "confidence" (a ``DraftSampling.stop_confidence`` stop)
    # with ``top_logprobs=k``: at each generated position, the k most likely token ids (most likely first; the
    # generated token is the first) and their log-probabilities under the full softmax
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # with a ``DraftSampling`` that asks for them: the probability of each generated token under the row's warped
    # distribution, and that distribution's most likely tokens and their probabilities at each position
    probs: list[float] | None = None
    alternative_ids: list[list[int]] | None = None
    alternative_probs: list[list[float]] | None = None


@dataclass(frozen=True)
class DraftSampling:
    """How one row of the slot engine picks its tokens, and what it reports besides them.

    ``params`` greedy (the default) takes the argmax, as every other row; otherwise tokens are drawn from
    ``warp_probs(logits, params)`` with a generator of the row's own, seeded with ``seed`` (None: a fresh random
    seed), so a seeded row draws the same tokens whatever shares its batch. ``return_probs`` records the warped
    probability of each drawn token (greedy: the one-hot's 1.0); ``top_alternatives`` k > 0 the warped
    distribution's k most likely tokens at each position (the function ``top_alternatives``).

    ``stop_confidence`` t ends the row after the first token whose confidence is below t, that token included
    (``drafting.cached.CachedDraftModel``'s "probability" rule, transformers' assistant confidence threshold): a
    greedy token's confidence is its probability under the draft's plain softmax, a sampled token's its probability
    under the warped distribution it was drawn from. The tokens are the same with or without it, up to the stop."""

    params: SamplingParams = GREEDY
    seed: int | None = None
    return_probs: bool = False
    top_alternatives: int = 0
    stop_confidence: float | None = None

    def __post_init__(self) -> None:
        if self.top_alternatives < 0 or (self.top_alternatives and not self.return_probs):
            raise ValueError("top_alternatives must be >= 0, and > 0 only with return_probs")
        if self.stop_confidence is not None and not 0 < self.stop_confidence <= 1:
            raise ValueError(f"stop_confidence must be in (0, 1], got {self.stop_confidence!r}")

    @property
    def plain(self) -> bool:
        """Greedy with nothing more to report or decide: the row takes the engine's argmax path and nothing else."""
        return self.params.greedy and not self.return_probs and self.stop_confidence is None


PLAIN = DraftSampling()


def top_alternatives(probs: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens of one warped distribution ``probs`` [V] and their probabilities, most likely
    first. Tokens of equal probability -- notably the zero-probability ones: every token but the argmax when
    greedy, those top-k or top-p cut -- come in the order of their ``logits``, so the list says which tokens the
    draft ranks next even where the warp gives them nothing."""
    floor = probs.topk(k).values[-1]
    above = (probs > floor).nonzero().squeeze(-1)  # fewer than k
    at_floor = logits.float().masked_fill(probs != floor, float("-inf")).topk(k - above.numel()).indices
    ids = torch.cat([above, at_floor])
    ids = ids[torch.sort(logits[ids], descending=True, stable=True).indices]  # ties in probability: by logit
    ids = ids[torch.sort(probs[ids], descending=True, stable=True).indices]
    return ids.tolist(), probs[ids].tolist()


class RowSampler:
    """A row's ``DraftSampling`` at work: its generator and what it has recorded so far."""

    def __init__(self, settings: DraftSampling, device: torch.device):
        self.settings = settings
        self.generator: torch.Generator | None = None
        if not settings.params.greedy:
            self.generator = torch.Generator(device=device)
            if settings.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(settings.seed)
        self.probs: list[float] = []
        self.alternative_ids: list[list[int]] = []
        self.alternative_probs: list[list[float]] = []
        self.stopped = False  # the last token's confidence fell below ``stop_confidence``

    def pick(self, logits: torch.Tensor, greedy_token: int) -> int:
        """The row's token from its next-token ``logits`` [V] (``greedy_token`` is their argmax), recorded."""
        s = self.settings
        if s.params.greedy and s.stop_confidence is not None:
            # the greedy one-hot says nothing about confidence: the plain softmax's top probability does
            self.stopped = float(torch.softmax(logits.float(), -1).max()) < s.stop_confidence
        if s.params.greedy and not s.top_alternatives:
            self.probs.append(1.0)  # one-hot: no need to build it
            return greedy_token
        probs = warp_probs(logits, s.params)  # [V]
        token = greedy_token if self.generator is None else int(sample_from(probs, self.generator))
        if not s.params.greedy and s.stop_confidence is not None:
            self.stopped = float(probs[token]) < s.stop_confidence
        if s.return_probs:
            self.probs.append(float(probs[token]))
        if s.top_alternatives:
            ids, values = top_alternatives(probs, logits, s.top_alternatives)
            self.alternative_ids.append(ids)
            self.alternative_probs.append(values)
        return token

    def report(self) -> dict:
        """The ``Generation`` fields this row fills, copies of what it has recorded so far."""
        s = self.settings
        return {"probs": list(self.probs) if s.return_probs else None,
                "alternative_ids": list(self.alternative_ids) if s.top_alternatives else None,
                "alternative_probs": list(self.alternative_probs) if s.top_alternatives else None}


def row_samplers(sampling: Sequence[DraftSampling] | None, m: int, device: torch.device) -> list[RowSampler | None]:
    """One ``RowSampler`` per row of ``m`` (None for a plain greedy row, and for all without ``sampling``)."""
    if sampling is None:
        return [None] * m
    if len(sampling) != m:
        raise ValueError(f"{m} prompts but {len(sampling)} sampling settings")
    return [None if s.plain else RowSampler(s, device) for s in sampling]


def finish_reason(token: int, generated: int, max_new_tokens: int, eos: set[int] | frozenset[int],
                  sampler: RowSampler | None) -> str | None:
    """Why a row that just took ``token`` (its ``generated``-th) is done -- ``Generation.finish_reason`` -- or None
    while it goes on."""
    if token in eos:
        return "eos"
    if generated >= max_new_tokens:
        return "length"
    if sampler is not None and sampler.stopped:  # its stop rule
        return "confidence"
    return None


def top_logprobs_of(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``k`` most likely ids of each row of ``logits`` [n, V] and their float32 log-softmax values."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.tolist(), values.tolist()

