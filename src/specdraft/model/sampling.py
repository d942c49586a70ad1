"""Sampling settings and the distribution they give over the vocabulary.

One definition serves the server's sampled drafts, speculative sampling and acceptance at temperature: the
lossless guarantee of speculative sampling holds only when the target and the draft are warped the same way.
The order is transformers' (``generate``): temperature, then top-k, then top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy (the others are then ignored); ``top_k`` 0 and ``top_p`` 1 switch those off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()
NUCLEUS_FIRST_K = 64


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities over the last dimension of ``logits`` under ``params``.

    Greedy gives the one-hot of the argmax (the first of tied maxima, as ``torch.argmax``), so a greedy drafter's
    q and a greedy target's p are the distributions speculative sampling and expected acceptance expect.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        probs = scores.softmax(-1)
        # The nucleus is a prefix of the tokens sorted by probability: rather than sort the whole vocabulary for
        # every row, take the top k and double k until every row's nucleus ends inside it (usually at once).
        k = min(NUCLEUS_FIRST_K, probs.shape[-1])
        while True:
            top, order = torch.topk(probs, k, dim=-1)
            # keep a token while the mass before it is under top_p; the most likely token always stays
            keep_sorted = (top.cumsum(-1) - top) < params.top_p
            if k == probs.shape[-1] or not keep_sorted[..., -1].any():
                break
            k = min(2 * k, probs.shape[-1])
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.softmax(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs`` ([..., V] -> [...]), drawn with ``generator`` (seeded by the caller).

    Inverse-CDF sampling: one uniform number per row against the float64 cumulative sum (``torch.multinomial``
    costs several times more for one draw from a large vocabulary). A token of probability 0 is never drawn.
    """
    flat = probs.reshape(-1, probs.shape[-1])
    cdf = flat.double().cumsum(-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True).clamp_(max=flat.shape[-1] - 1)
    return ids.reshape(probs.shape[:-1])
