"""Lossless speculative decoding at batch 1, greedy or sampled (the algorithm the ``speculate`` stage times).

Greedy, one step: the drafter proposes k tokens for the current sequence; the target runs once on [last token, d1..dk]
with its KV cache and takes the argmax at every position (p0..pk); the longest prefix of the draft with
d_i == p_{i-1} is kept, plus the target's own next token p_n; the target's cache is cropped back to the kept
tokens. Every output token is a target argmax, so the output equals the target's plain greedy decoding (bit
for bit where the engine's multi-token pass computes what its one-token pass does: ``TargetModel.exact``).

Sampled (``SamplingParams`` with temperature > 0; Leviathan et al. 2023, Chen et al. 2023): the drafter draws
d1..dk from its warped distributions q1..qk (``Drafter.draft_with_probs``; the same warp as the target's); the
target's one pass gives p0..pk, warped alike; d_i is kept with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the
first refusal the step ends with a token drawn from normalise(max(0, p_{i-1} - q_i)); with all k kept, a bonus token
from p_k. Every output token is then distributed as plain sampling from the target would give it, whatever q is;
the randomness comes from one seeded ``torch.Generator``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from transformers import DynamicCache

from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError
from specdraft.drafting.metrics import accepted_length
from specdraft.model.forward import crop_cache, extend
from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs
from specdraft.model.targets import TargetModel, TorchTarget, as_target

# --------------------------------------------------------------------------------------- speculation

@dataclass
class SpecGeneration:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    steps: int = 0  # verify passes of the target (the prefill not counted)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accepted_per_step: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


def speculative_generate(target, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int, k: int,
                         eos_ids=None, sampling: SamplingParams = GREEDY,
                         generator: torch.Generator | None = None) -> SpecGeneration:
    """Speculative decoding of one prompt. ``target``: a ``TargetModel`` (any engine) or a transformers model.
    Greedy (``sampling`` at temperature 0): with an ``exact`` target the tokens equal ``greedy_decode(target,
    [prompt], ...)``. Sampled: distributed as sampling from the target under ``sampling`` (a torch target),
    drawn with ``generator``."""

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if k < 1:
        raise ValueError("k must be >= 1")
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    target = as_target(target)
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    step = GreedyStep(target, drafter) if sampling.greedy else SampledStep(target, drafter, sampling, generator)
    drafter.reset()
    started = time.perf_counter()
    gen = SpecGeneration(tokens=[step.first(prompt)], finish_reason="length")
    gen.verify_seconds += time.perf_counter() - started
    if gen.tokens[0] in eos:
        gen.finish_reason = "eos"
        return gen
    vocab = target.vocab_size
    while len(gen.tokens) < max_new_tokens:
        # Drafting more than the tokens still wanted (minus the target's own bonus token) is wasted work.
        kk = min(k, max_new_tokens - len(gen.tokens) - 1)
        t0 = time.perf_counter()
        draft = step.propose(prompt + gen.tokens, kk) if kk > 0 else []
        t1 = time.perf_counter()
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in draft):
            raise DrafterError(f"drafter {drafter.name!r} proposed ids outside the "
                               f"target vocab (0..{vocab - 1}): {draft}")
        start = len(prompt) + len(gen.tokens) - 1  # the cache holds everything but the last token
        n, nxt = step.settle(draft, gen.tokens[-1], start)
        target.truncate(start + 1 + n)
        gen.verify_seconds += time.perf_counter() - t1
        gen.draft_seconds += t1 - t0
        gen.steps += 1
        gen.drafted += len(draft)
        gen.accepted += n
        gen.accepted_per_step.append(n)
        for tok in draft[:n] + [nxt]:
            gen.tokens.append(tok)
            if tok in eos:
                gen.finish_reason = "eos"
                return gen
            if len(gen.tokens) >= max_new_tokens:
                break
    return gen


class GreedyStep:
    """One greedy step's two halves: the drafter's greedy draft; the target's argmax at every drafted position,
    the matching prefix kept and the target's own next token after it."""

    def __init__(self, target: TargetModel, drafter: Drafter):
        self.target, self.drafter = target, drafter

    def first(self, prompt: list[int]) -> int:
        return self.target.prefill(prompt)

    def propose(self, context: list[int], k: int) -> list[int]:
        return self.drafter.draft_one(context, k)[:k]

    def settle(self, draft: list[int], last: int, start: int) -> tuple[int, int]:
        """(tokens of ``draft`` kept, the next token) after the target's pass over [last, *draft] at ``start``."""
        preds = self.target.verify([last] + draft, start)  # preds[i]: target's next token after draft[:i]
        n = accepted_length(draft, preds)
        return n, preds[n]


# --------------------------------------------------------------------------------------- sampling

def acceptance_probability(p_x: float, q_x: float) -> float:
    """The chance a drafted token x is kept: min(1, p(x) / q(x)) -- the rule that makes the output lossless."""
    return 1.0 if p_x >= q_x else p_x / q_x


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)): what a refused position draws from. Where p = q numerically (a refusal is then
    a rounding event) p itself."""
    rest = (p - q).clamp_min(0)
    total = rest.sum()
    return rest / total if total > 0 else p


class SamplingTarget:
    """The warped distributions of a torch target along its kept-cache sequence. Sampling needs the target's
    probabilities, which ``TargetModel`` (greedy tokens only) does not give: llama.cpp's target is refused."""

    def __init__(self, target: TargetModel, params: SamplingParams):
        if not isinstance(target, TorchTarget):
            raise ValueError(f"speculative sampling needs the target's probabilities: the {target.engine} "
                             "engine gives its greedy tokens only (use the torch engine, or temperature 0)")
        self.target, self.params = target, params

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int]) -> torch.Tensor:
        """p of the token after ``prompt`` ([V]); the cache then holds the prompt."""
        self.target.cache = DynamicCache(config=self.target.model.config)
        logits = extend(self.target.model, list(prompt), self.target.cache, 0, logits_to_keep=1)
        return warp_probs(logits[0, -1], self.params).cpu()

    @torch.inference_mode()
    def verify(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        """p after each of ``tokens`` fed at positions start.. ([len(tokens), V])."""
        crop_cache(self.target.cache, start)
        return warp_probs(extend(self.target.model, list(tokens), self.target.cache, start)[0], self.params).cpu()


class SampledStep:
    """One speculative-sampling step's two halves: the drafter's draft sampled from q (kept with its
    distributions); each drafted token kept with probability min(1, p/q), the first refusal replaced by a draw from
    normalise(max(0, p - q)), or with all kept a bonus token from p."""

    def __init__(self, target: TargetModel, drafter: Drafter, params: SamplingParams,
                 generator: torch.Generator | None):
        self.sampler = SamplingTarget(target, params)
        self.drafter, self.params, self.generator = drafter, params, generator
        self.vocab = target.vocab_size
        self.proposal: DraftDistributions | None = None

    def first(self, prompt: list[int]) -> int:
        return int(sample_from(self.sampler.prefill(prompt), self.generator))

    def propose(self, context: list[int], k: int) -> list[int]:
        self.proposal = self.drafter.draft_with_probs([context], k, self.params, self.generator)[0]
        return self.proposal.ids[:k]

    def settle(self, draft: list[int], last: int, start: int) -> tuple[int, int]:
        p = self.sampler.verify([last] + draft, start)  # p[i]: the target's distribution after draft[:i]
        q = self.proposal.dense(self.vocab)[: len(draft)] if draft else None
        for i, x in enumerate(draft):
            u = float(torch.rand((), generator=self.generator))
            if u >= acceptance_probability(float(p[i, x]), float(q[i, x])):
                return i, int(sample_from(residual_distribution(p[i], q[i]), self.generator))
        # every draft token kept: the bonus token from the target's own distribution
        return len(draft), int(sample_from(p[len(draft)], self.generator))


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if list(a) == list(b):
        return None
    return accepted_length(a, b)
