"""Lossless greedy speculative decoding at batch 1 (the algorithm the ``speculate`` stage times).

One step: the drafter proposes k tokens for the current sequence; the target runs once on [last token, d1..dk]
with its KV cache and takes the argmax at every position (p0..pk); the longest prefix of the draft with
d_i == p_{i-1} is kept, plus the target's own next token p_n; the target's cache is cropped back to the kept
tokens. Every output token is a target argmax, so the output equals the target's plain greedy decoding (bit
for bit where the engine's multi-token pass computes what its one-token pass does: ``TargetModel.exact``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from specdraft.drafting.base import Drafter, DrafterError
from specdraft.drafting.metrics import accepted_length
from specdraft.model.targets import as_target

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
                         eos_ids=None) -> SpecGeneration:
    """Greedy speculative decoding of one prompt. ``target``: a ``TargetModel`` (any engine) or a transformers
    model; with an ``exact`` target the tokens equal ``greedy_decode(target, [prompt], ...)``."""

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if k < 1:
        raise ValueError("k must be >= 1")
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    target = as_target(target)
    vocab = target.vocab_size
    eos = set(target.eos_ids if eos_ids is None else eos_ids)
    drafter.reset()
    started = time.perf_counter()
    gen = SpecGeneration(tokens=[target.prefill(prompt)], finish_reason="length")
    gen.verify_seconds += time.perf_counter() - started
    if gen.tokens[0] in eos:
        gen.finish_reason = "eos"
        return gen
    while len(gen.tokens) < max_new_tokens:
        # Drafting more than the tokens still wanted (minus the target's own bonus token) is wasted work.
        kk = min(k, max_new_tokens - len(gen.tokens) - 1)
        t0 = time.perf_counter()
        draft = drafter.draft_one(prompt + gen.tokens, kk)[:kk] if kk > 0 else []
        t1 = time.perf_counter()
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in draft):
            raise DrafterError(f"drafter {drafter.name!r} proposed ids outside the "
                               f"target vocab (0..{vocab - 1}): {draft}")
        start = len(prompt) + len(gen.tokens) - 1  # the cache holds everything but the last token
        preds = target.verify([gen.tokens[-1]] + draft, start)  # preds[i]: target's next token after draft[:i]
        n = accepted_length(draft, preds)
        target.truncate(start + 1 + n)
        gen.verify_seconds += time.perf_counter() - t1
        gen.draft_seconds += t1 - t0
        gen.steps += 1
        gen.drafted += len(draft)
        gen.accepted += n
        gen.accepted_per_step.append(n)
        for tok in draft[:n] + [preds[n]]:
            gen.tokens.append(tok)
            if tok in eos:
                gen.finish_reason = "eos"
                return gen
            if len(gen.tokens) >= max_new_tokens:
                break
    return gen


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if list(a) == list(b):
        return None
    return accepted_length(a, b)
