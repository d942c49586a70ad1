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

# How much weight the draft must give a guide's token, against its most likely one, for the row to take it: a
# fallback for callers that send a guide without the ratio their hybrid rule measured (``drafting.hybrid_rule``)
DEFAULT_GUIDE_MIN_RATIO = 0.1


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
    under the warped distribution it was drawn from. The tokens are the same with or without it, up to the stop.

    ``guides`` (greedy rows only): proposed continuations -- prompt lookup's copies, made by the client -- that the
    row follows while the draft finds them plausible (``GuideFollower``): at position i, of the tokens the guides
    that agree with the row so far propose there, the one the draft finds most likely, wherever its probability
    under the draft's softmax is at least ``guide_min_ratio`` times the most likely token's; from the first
    position where none is, the row's own argmax to the end (ratio 1: the plain greedy draft, up to exact ties).
    The draft stays the model's: it only ever takes a token the model itself gives that much weight. The
    confidence of a guided token, for ``stop_confidence``, is its own probability."""

    params: SamplingParams = GREEDY
    seed: int | None = None
    return_probs: bool = False
    top_alternatives: int = 0
    stop_confidence: float | None = None
    guides: tuple[tuple[int, ...], ...] = ()
    guide_min_ratio: float = DEFAULT_GUIDE_MIN_RATIO

    def __post_init__(self) -> None:
        if self.top_alternatives < 0 or (self.top_alternatives and not self.return_probs):
            raise ValueError("top_alternatives must be >= 0, and > 0 only with return_probs")
        if self.stop_confidence is not None and not 0 < self.stop_confidence <= 1:
            raise ValueError(f"stop_confidence must be in (0, 1], got {self.stop_confidence!r}")
        if not 0 < self.guide_min_ratio <= 1:
            raise ValueError(f"guide_min_ratio must be in (0, 1], got {self.guide_min_ratio!r}")
        if self.guides and (not self.params.greedy or self.top_alternatives):
            raise ValueError("a guide is followed by greedy drafts without top_alternatives only")

    @property
    def plain(self) -> bool:
        """Greedy with nothing more to report or decide: the row takes the engine's argmax path and nothing else."""
        return self.params.greedy and not self.return_probs and self.stop_confidence is None and not self.guides


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


class GuideFollower:
    """A greedy draft's walk along its guides (``DraftSampling.guides``). At each position the guides still in play
    (those equal to the draft so far) propose their tokens there; the draft takes the one it finds most likely (its
    argmax where proposed; the earlier guide on a tie) while that one has at least ``min_ratio`` of its most likely
    token's probability, and keeps the guides that proposed it. From the first position where it does not (or past
    every guide's end) the draft is its own argmax. One guide is the single copy rule; several let the draft pick,
    token by token, which earlier occurrence the text repeats. The one rule the server's rows, the in-process
    drafters and eval's teacher-forced walk (``drafting.hybrid_rule.guided_accepted``) follow."""

    def __init__(self, guides: Sequence[Sequence[int]], min_ratio: float):
        self.guides = [tuple(int(t) for t in guide) for guide in guides if len(guide)]
        self.min_ratio = min_ratio
        self.position = 0
        self.on = bool(self.guides)  # still on a guide: callers need the probabilities only while it is

    def pick(self, probs: torch.Tensor, top: int) -> int:
        """The next position's token from the draft's probabilities there [V] (``top``: their argmax)."""
        i, self.position = self.position, self.position + 1
        if self.on:
            proposed = [t for t in dict.fromkeys(g[i] for g in self.guides if i < len(g)) if 0 <= t < probs.shape[-1]]
            best = top if top in proposed else max(proposed, key=lambda t: float(probs[t]), default=None)
            if best is not None and (best == top or float(probs[best]) >= self.min_ratio * float(probs[top])):
                self.guides = [g for g in self.guides if i < len(g) and g[i] == best]
                return best
        self.on = False
        return top


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
        self.guide = GuideFollower(settings.guides, settings.guide_min_ratio) if settings.guides else None

    def pick(self, logits: torch.Tensor, greedy_token: int) -> int:
        """The row's token from its next-token ``logits`` [V] (``greedy_token`` is their argmax), recorded."""
        s = self.settings
        if self.guide is not None and self.guide.on:
            return self._follow_guide(logits, greedy_token)
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

    def _follow_guide(self, logits: torch.Tensor, greedy_token: int) -> int:
        """The guide's next token where the draft gives it enough weight; else the argmax, and off the guide."""
        probs = torch.softmax(logits.float(), -1)
        token = self.guide.pick(probs, greedy_token)
        if self.settings.stop_confidence is not None:
            self.stopped = float(probs[token]) < self.settings.stop_confidence
        self.probs.append(1.0)  # greedy: the one-hot at the token taken
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

