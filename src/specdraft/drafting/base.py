"""The one drafter interface: ``draft(contexts, num_tokens) -> one list of token ids per context``.

Every drafter -- a draft model in process (``ModelDrafter`` re-prefills each call, ``CachedDraftModel`` keeps its
KV cache), the draft server over HTTP (``HTTPDrafter``), model-free prompt lookup (``LookupDrafter``) and lookup
in front of a model (``HybridDrafter``) -- is measured by the same code: acceptance on evaluation points
(``drafting.acceptance.evaluate_drafter``) and end-to-end speculative decoding
(``drafting.speculative.speculative_generate``, which drafts for one context at a time). A draft may be
shorter than asked (lookup without a match proposes nothing); it is never longer.

Sampling adds two questions a drafter answers (``model.sampling.SamplingParams``, the same warp as the target's):
``draft_with_probs`` -- a draft drawn from the drafter's distribution q, with q (speculative sampling needs q at
every drafted token to stay lossless) -- and ``path_probs`` -- q at every prefix of a given continuation
(acceptance at temperature, without sampling noise). A drafter that does not sample (lookup, llama.cpp's n-gram)
proposes its greedy draft, whose q is one-hot: the base class's answer to both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specdraft.model.sampling import SamplingParams


class DrafterError(RuntimeError):
    """A drafter that failed or answered something unusable."""


@dataclass
class DraftDistributions:
    """Draft tokens and the distribution q each came from, sparse: row i of ``probs`` is q at position i over the
    token ids in row i of ``support`` (every other id has q = 0). A model draft's support is the whole vocabulary;
    a deterministic draft's is its one token (q = 1); a position with nothing proposed has q = 0 everywhere."""

    ids: list[int]
    support: torch.Tensor  # [n, m] int64 token ids; m = vocab size for a model draft, 1 for a one-hot q
    probs: torch.Tensor  # [n, m] float32, q over ``support``; each row sums to 1 (0 where nothing is proposed)

    def dense(self, vocab_size: int) -> torch.Tensor:
        """q as [n, vocab_size]. Ids at or past ``vocab_size`` (a draft's padded embedding rows) are left out: a
        drafted id there is the caller's to refuse."""
        support, probs = self.support.cpu(), self.probs.float().cpu()
        inside = support < vocab_size
        out = torch.zeros(probs.shape[0], vocab_size, dtype=torch.float32)
        return out.scatter_add_(1, support * inside, probs * inside)

    @classmethod
    def one_hot(cls, ids: Sequence[int], positions: int | None = None) -> "DraftDistributions":
        """q one-hot at each of ``ids``; with ``positions`` > len(ids), the positions after them have q = 0."""
        ids = [int(t) for t in ids]
        n = len(ids) if positions is None else positions
        ids = ids[:n]
        support = torch.zeros(n, 1, dtype=torch.long)
        probs = torch.zeros(n, 1, dtype=torch.float32)
        support[: len(ids), 0] = torch.tensor(ids, dtype=torch.long)
        probs[: len(ids)] = 1.0
        return cls(ids, support, probs)

    def rows(self, start: int, stop: int) -> "DraftDistributions":
        """Positions start..stop-1."""
        return DraftDistributions(self.ids[start:stop], self.support[start:stop], self.probs[start:stop])

    @classmethod
    def full(cls, ids: Sequence[int], probs: torch.Tensor) -> "DraftDistributions":
        """q over the whole vocabulary: ``probs`` [n, V]."""
        probs = probs.float().cpu()
        support = torch.arange(probs.shape[-1]).expand(probs.shape[0], -1)
        return cls([int(t) for t in ids], support, probs)


class Drafter(ABC):
    """What callers may ask of any drafter; each attribute's default is what a drafter without it means."""

    name: str = "drafter"
    # Contexts worth drafting in one call: evaluate_drafter asks 4x this many at once (the HTTP drafter's
    # requests in flight; an in-process model batches what it is given).
    concurrency: int = 4
    # Contexts prompt lookup answered instead of the model, and those the model did (HybridDrafter); None for a
    # drafter with no lookup in front.
    lookup_used: int | None = None
    model_used: int | None = None

    @abstractmethod
    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Up to ``num_tokens`` greedy draft tokens after each context, in the contexts' order."""

    def draft_one(self, context: Sequence[int], num_tokens: int) -> list[int]:
        """The draft for one context."""
        return list(self.draft([context], num_tokens)[0])

    @property
    def vocab_size(self) -> int | None:
        """The draft model's vocabulary size, to check token ids against; None where no model is in process."""
        return None

    @property
    def backpressure(self) -> dict[str, Any] | None:
        """What a draft server's refusals cost so far (retries, seconds waited, concurrency); None in process."""
        return None

    @property
    def compile_error(self) -> str | None:
        """Why torch.compile failed for a compiled draft that fell back to eager steps; None otherwise."""
        return None

    # Whether ``draft_guided`` follows guides (a model drafter in process or behind a server does)
    follows_guides: bool = False

    def draft_guided(self, contexts: Sequence[Sequence[int]], num_tokens: int,
                     guides: Sequence[Sequence[Sequence[int]]], min_ratios: Sequence[float]) -> list[list[int]]:
        """Greedy drafts that follow each context's guides (proposed continuations, at most ``MAX_GUIDES``; none: a
        plain draft) while the model gives the guide token it takes at least that context's ``min_ratios`` share of
        its top probability (``model.generation.GuideFollower``). Only drafters with ``follows_guides``."""
        raise DrafterError(f"{self.name}: this drafter does not follow guides (a draft model in process or behind "
                           "a draft server does)")

    def draft_with_probs(self, contexts: Sequence[Sequence[int]], num_tokens: int, params: SamplingParams,
                         generator: torch.Generator | None = None) -> list[DraftDistributions]:
        """Up to ``num_tokens`` tokens after each context drawn from the drafter's distribution under ``params``,
        with that distribution (q). Here: the greedy draft, q one-hot -- right for a drafter that does not
        sample, and still lossless in speculative sampling (the target accepts token x with probability p(x))."""
        return [DraftDistributions.one_hot(d) for d in self.draft(contexts, num_tokens)]

    # True where path_probs' row i under sampled settings depends only on context + continuation[:i] (a model's
    # teacher-forced pass): one call along a longer path then serves every evaluation point on it
    teacher_forced_paths: bool = False

    def path_probs(self, context: Sequence[int], continuation: Sequence[int],
                   settings: Sequence[SamplingParams]) -> list[DraftDistributions]:
        """For each of ``settings`` (one forward serves them all): row i is q of the token after ``context +
        continuation[:i]``, for i < len(continuation) (``ids``: the drafter's most likely token there). Here: a
        drafter that does not sample drafts once, at ``context``, whatever the settings; row i is its i-th token
        one-hot (q = 0 past the end of its draft) -- what one speculative step would offer."""
        n = len(continuation)
        one_hot = DraftDistributions.one_hot(self.draft_one(context, n)[:n], n)
        return [one_hot for _ in settings]

    def reset(self) -> None:
        """A new sequence starts: forget per-sequence state (a kept KV cache). Stateless drafters keep nothing."""

    def take_latencies(self) -> list[float]:
        """Seconds of each request since the last call (remote drafters; others record none)."""
        return []

    def close(self) -> None:
        """Release connections and threads."""

    def __enter__(self) -> "Drafter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NoDraft(Drafter):
    """Proposes nothing: speculative decoding with it is plain decoding (greedy or sampled), one target forward
    per token -- the baseline timed against speculation in the same loop."""

    name = "none"

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return [[] for _ in contexts]


def check_guided(contexts: Sequence[Sequence[int]], guides: Sequence[Sequence[Sequence[int]]],
                 min_ratios: Sequence[float]) -> None:
    """``draft_guided``'s arguments line up: one list of guides and one ratio per context."""
    if not len(guides) == len(min_ratios) == len(contexts):
        raise ValueError(f"{len(contexts)} contexts but {len(guides)} lists of guides and {len(min_ratios)} ratios")
