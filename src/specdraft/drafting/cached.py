"""A draft model in process that keeps its KV cache across the steps of one sequence (speculative decoding's
draft: each step it catches up on the tokens the target kept and drafts from there), and stops a step's draft
short of k where more tokens are unlikely to be accepted."""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from transformers import DynamicCache

from specdraft.drafting.base import DraftDistributions, Drafter, check_guided
from specdraft.drafting.batched import model_path_probs
from specdraft.drafting.calibration import AcceptanceCalibration
from specdraft.drafting.metrics import accepted_length
from specdraft.model.forward import crop_cache, extend
from specdraft.model.generation import GuideFollower
from specdraft.model.lean import CompiledSteps, lean_forward
from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs
from specdraft.quant.linear import is_prefill


class CachedDraftModel(Drafter):
    """A draft LM that keeps its KV cache between steps.

    ``tokens`` lists the ids whose keys/values are in the cache. Each draft keeps the longest
    common prefix of ``tokens`` and the new context (the accepted part of the previous draft), crops
    the rest, feeds only the new tokens, then decodes k tokens greedily one at a time, fewer when ``stop``
    says so: "probability", after a token whose probability is below ``min_confidence``; "calibrated", once
    the estimated probability that every token drafted so far is accepted falls below it (the estimate per
    token from ``AcceptanceCalibration``, which learns from each new context how much of the previous draft
    the target kept). ``lean``: through ``lean.LeanForward`` where the model allows;
    ``compile``: its one-token steps through ``torch.compile`` (``lean.CompiledSteps``: faster; logits not
    bit-identical to eager -- harmless here, the target verifies every drafted token).
    """

    def __init__(self, model, name: str = "draft", lean: bool = True, min_confidence: float | None = None,
                 compile: bool = False, stop: Literal["probability", "calibrated"] = "probability"):
        self.model, self.name = model.eval(), name
        self.lean = lean_forward(model, compile=compile) if lean else None
        self.compiled = isinstance(self.lean, CompiledSteps)
        # Stopping short of k: each further token costs a draft step and is less likely to be accepted.
        self.min_confidence = min_confidence
        self.stop = stop
        # Kept across prompts (``reset``): it describes the draft against this target, not one sequence. None
        # without a threshold: a draft that always drafts k has nothing to decide with it.
        self.calibration = AcceptanceCalibration() if stop == "calibrated" and min_confidence else None
        self.reset()

    def feed(self, ids: Sequence[int], start: int) -> torch.Tensor:
        """Last-position logits of ``ids`` fed at positions start..; steps and short catch-ups (the accepted
        drafts and the bonus token) take the lean forward, on the 4-bit codes of an int4 draft; the context's
        prefill takes the model's own (its dense path): the rule of ``quant.linear.is_prefill``, called."""

        n = len(ids)
        device = next(self.model.parameters()).device
        positions = torch.arange(start, start + n, device=device)[None]  # [1, n]
        if self.lean is None or is_prefill({"position_ids": positions}):
            return extend(self.model, ids, self.cache, start, logits_to_keep=1)
        # one new token sees every cached key (no mask); several need the causal pattern over the cache
        mask = None if n == 1 else (torch.arange(start + n, device=device) <= positions[0, :, None])[None, None]
        return self.lean(torch.tensor([list(ids)], device=device), positions, mask, self.cache)

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.tokens: list[int] = []
        self.fed_tokens = 0  # context tokens run through the draft (prefill + catch-up), for the report
        self._last_draft: tuple[int, list[int], list[float]] | None = None  # (context length, tokens, probs)

    def _learn(self, context: list[int], common: int) -> None:
        """What the target did with the previous draft, read off the new context (which holds the target's
        greedy tokens after the previous one, whoever drafted them)."""
        start, draft, probs = self._last_draft
        self._last_draft = None
        if common < start:  # not a continuation of the context that draft was made for
            return
        after = context[start:]
        kept = accepted_length(draft, after)
        self.calibration.observe(probs, kept, refused=kept < min(len(draft), len(after)))

    def _stop_after(self, probs: list[float], still_kept: float) -> tuple[bool, float]:
        """(stop drafting, the estimated probability that every token so far is accepted); with a threshold."""
        if self.calibration is None:
            return probs[-1] < self.min_confidence, still_kept
        still_kept *= self.calibration.estimate(probs[-1])
        return still_kept < self.min_confidence, still_kept

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def compile_error(self) -> str | None:
        return self.lean.error if isinstance(self.lean, CompiledSteps) else None

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """One context at a time: the kept cache follows one sequence (several contexts thrash it)."""
        return [self._draft_one(c, num_tokens)[0] for c in contexts]

    follows_guides = True

    def draft_guided(self, contexts, num_tokens, guides, min_ratios):
        check_guided(contexts, guides, min_ratios)
        return [self._draft_one(c, num_tokens, guides=g, guide_min_ratio=r)[0]
                for c, g, r in zip(contexts, guides, min_ratios)]

    def draft_with_probs(self, contexts, num_tokens, params, generator=None):
        if params.greedy:  # the greedy draft, bit for bit as ``draft`` gives it
            return super().draft_with_probs(contexts, num_tokens, params, generator)
        return [DraftDistributions.full(*self._draft_one(c, num_tokens, params, generator)) for c in contexts]

    teacher_forced_paths = True

    def path_probs(self, context, continuation, settings):
        return model_path_probs(self, self.model, context, continuation, settings)

    @torch.inference_mode()
    def _draft_one(self, context: Sequence[int], k: int, params: SamplingParams = GREEDY,
                   generator: torch.Generator | None = None, guides: Sequence[Sequence[int]] = (),
                   guide_min_ratio: float = 1.0) -> tuple[list[int], torch.Tensor | None]:
        """(tokens, their q as [n, V]): greedy (q None), or sampled under ``params`` (the stop rule then reads q of
        the drafted token instead of the greedy token's probability); a greedy draft follows ``guides`` as the
        server's rows do (``model.generation.DraftSampling``)."""
        if k <= 0:
            return [], None if params.greedy else torch.zeros(0, self.vocab_size)
        context = list(context)
        common = 0
        for a, b in zip(self.tokens, context):
            if a != b:
                break
            common += 1
        if self.calibration is not None and self._last_draft is not None:
            self._learn(context, common)
        common = min(common, len(context) - 1)  # feed at least one token to get the next logits
        crop_cache(self.cache, common)
        del self.tokens[common:]
        feed = context[common:]
        logits = self.feed(feed, common)
        self.tokens.extend(feed)
        self.fed_tokens += len(feed)
        rows: list[torch.Tensor] = []

        follower = GuideFollower(guides, guide_min_ratio)
        guided = follower.on  # before the walk: the follower leaves its guides as it goes

        def choose(logits: torch.Tensor) -> int:
            if params.greedy:
                top = int(logits[0, -1].argmax())
                if follower.on:
                    return follower.pick(torch.softmax(logits[0, -1].float(), -1), top)
                return top
            rows.append(warp_probs(logits[0, -1], params).cpu())  # sampled on the CPU: the generator lives there
            return int(sample_from(rows[-1], generator))

        def probability(logits: torch.Tensor) -> float:
            if params.greedy and not guided:
                return top_probability(logits)
            if params.greedy:  # a guided token's own probability, as the server's rows read it
                return float(torch.softmax(logits[0, -1].float(), -1)[out[-1]])
            return float(rows[-1][out[-1]])

        out, probs, still_kept = [choose(logits)], [], 1.0
        for _ in range(k - 1):
            if self.min_confidence:
                probs.append(probability(logits))
                stop, still_kept = self._stop_after(probs, still_kept)
                if stop:
                    break
            logits = self.feed(out[-1:], len(self.tokens))
            self.tokens.append(out[-1])
            out.append(choose(logits))
        if self.calibration is not None:
            if len(probs) < len(out):  # the last token's probability, not needed to decide
                probs.append(probability(logits))
            self._last_draft = (len(context), out, probs)
        return out, None if params.greedy else torch.stack(rows)


def top_probability(logits: torch.Tensor) -> float:
    """Probability of the greedy token at the last position of [1, T, V] logits."""
    return float(torch.softmax(logits[0, -1].float(), -1).max())
