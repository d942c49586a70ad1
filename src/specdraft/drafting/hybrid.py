"""A draft model behind prompt lookup: where the context's last ``min_ngram`` (or more, up to ``max_ngram``)
tokens occurred earlier, propose what followed them (free); elsewhere ask the model. With a ``HybridRule`` (a rule
measured by `specdraft eval --choose-hybrid-rule`, ``drafting.hybrid_rule``), lookup drafts where its match length
reaches the rule's threshold instead; the fixed rule is the rule ``HybridRule(min_ngram)``.

The two fail in different places: lookup wins in repetitive stretches (lists, code, restated text) and has
nothing to say elsewhere; the model drafts everywhere but pays a forward pass per token. The model stays pure
inference (the draft server never runs the lookup); the combination lives in the client. A guided rule
(``HybridRule.guide_min_ratio``) sends lookup's copies along as the request's guides where the rule uses lookup
(``lookup_continuations``: what followed each earlier occurrence of the matched tokens): the model then drafts every
context, taking a copy's token only where it finds it plausible itself.
"""

from __future__ import annotations

from typing import Any, Sequence

from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError
from specdraft.drafting.hybrid_rule import DEFAULT_HYBRID_MIN_NGRAM, HybridRule
from specdraft.drafting.lookup import MAX_NGRAM, lookup_continuations, lookup_match

__all__ = ["DEFAULT_HYBRID_MIN_NGRAM", "HybridDrafter", "HybridRule"]


class HybridDrafter(Drafter):
    """``lookup_used`` / ``model_used`` count the contexts each side answered (under a guided rule: the contexts
    the model drafted with lookup's guide, and without). A kept draft cache behind it stays correct across the
    contexts lookup answered: ``CachedDraftModel`` catches up on whatever the context gained since its last call."""

    def __init__(self, model_drafter: Drafter, min_ngram: int = DEFAULT_HYBRID_MIN_NGRAM, max_ngram: int = MAX_NGRAM,
                 name: str | None = None, rule: HybridRule | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.model_drafter, self.min_ngram, self.max_ngram = model_drafter, min_ngram, max_ngram
        # lookup's match is at least the n-gram it found (n <= max_ngram), and a match found below min_ngram
        # never reaches it: the fixed rule is exactly the threshold min_ngram on the match length
        self.rule = rule if rule is not None else HybridRule(min_ngram)
        if self.rule.guided and not model_drafter.follows_guides:
            raise ValueError(f"a guided hybrid rule needs a drafter that follows guides; {model_drafter.name} does not")
        measured = f"-match{self.rule.min_match}" if self.rule.min_match else "-never"
        if self.rule.guided and self.rule.min_match:
            measured = f"-guided{self.rule.guide_min_ratio:g}" + measured
        self.name = name or f"{model_drafter.name}+lookup{min_ngram if rule is None else measured}"
        self.concurrency = model_drafter.concurrency
        self.lookup_used = self.model_used = 0

    @property
    def vocab_size(self) -> int | None:
        return self.model_drafter.vocab_size

    @property
    def compile_error(self) -> str | None:
        return self.model_drafter.compile_error

    @property
    def backpressure(self) -> dict[str, Any] | None:
        return self.model_drafter.backpressure

    def _lookup(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> tuple[list[list[int]], list[int]]:
        """Lookup's drafts, and the indices of the contexts it has nothing for (the model's)."""
        out = [self._found(c, num_tokens) for c in contexts]
        ask = [i for i, d in enumerate(out) if not d]
        self.lookup_used += len(contexts) - len(ask)
        self.model_used += len(ask)
        return out, ask

    def _found(self, context: Sequence[int], num_tokens: int) -> list[int]:
        """Lookup's draft where the rule (its overall threshold: a context has no category here) proposes it."""
        draft, match = lookup_match(context, num_tokens, self.max_ngram, 1)
        return draft if self.rule.uses_lookup(match) else []

    def _guides(self, context: Sequence[int], num_tokens: int) -> list[list[int]]:
        """Lookup's copies where the rule (its overall threshold) proposes lookup; none elsewhere."""
        continuations, match = lookup_continuations(context, num_tokens, self.max_ngram, 1)
        return continuations if self.rule.uses_lookup(match) else []

    def _guided(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Every context drafted by the model, with lookup's copies as its guides where the rule uses lookup."""
        guides = [self._guides(c, num_tokens) for c in contexts]
        self.lookup_used += sum(bool(g) for g in guides)
        self.model_used += sum(not g for g in guides)
        ratio = float(self.rule.guide_min_ratio)  # type: ignore[arg-type]
        drafts = self.model_drafter.draft_guided(contexts, num_tokens, guides, [ratio] * len(contexts))
        if len(drafts) != len(contexts):
            raise DrafterError(f"model drafter returned {len(drafts)} drafts for {len(contexts)} contexts")
        return [list(d) for d in drafts]

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        if self.rule.guided:
            return self._guided(contexts, num_tokens)
        out, ask = self._lookup(contexts, num_tokens)
        if ask:
            drafts = self.model_drafter.draft([contexts[i] for i in ask], num_tokens)
            if len(drafts) != len(ask):
                raise DrafterError(f"model drafter returned {len(drafts)} drafts for {len(ask)} contexts")
            for i, d in zip(ask, drafts):
                out[i] = list(d)
        return out

    def draft_with_probs(self, contexts, num_tokens, params, generator=None):
        """Lookup's proposal (q one-hot) where it has one, the model's sampled draft elsewhere. A guided rule
        guides greedy drafts only: sampled ones are the model's own."""
        if self.rule.guided:
            if params.greedy:
                return [DraftDistributions.one_hot(d) for d in self._guided(contexts, num_tokens)]
            return self.model_drafter.draft_with_probs(contexts, num_tokens, params, generator)
        drafts, ask = self._lookup(contexts, num_tokens)
        out = [DraftDistributions.one_hot(d) for d in drafts]
        if ask:
            sampled = self.model_drafter.draft_with_probs([contexts[i] for i in ask], num_tokens, params, generator)
            if len(sampled) != len(ask):
                raise DrafterError(f"model drafter returned {len(sampled)} drafts for {len(ask)} contexts")
            for i, d in zip(ask, sampled):
                out[i] = d
        return out

    def path_probs(self, context, continuation, settings):
        """Where lookup answers at ``context`` its draft drives the whole step (q one-hot), else the model's."""
        n = len(continuation)
        if self.rule.guided:  # greedy settings: the guided draft, one-hot; sampled ones: the model's own
            rows = self.model_drafter.path_probs(context, continuation, settings)
            guided = DraftDistributions.one_hot(self.draft_one(context, n)[:n], n)
            return [guided if params.greedy else row for params, row in zip(settings, rows)]
        found = self._found(context, n)
        if found:
            return [DraftDistributions.one_hot(found, n) for _ in settings]
        return self.model_drafter.path_probs(context, continuation, settings)

    def reset(self) -> None:
        self.model_drafter.reset()

    def take_latencies(self) -> list[float]:
        return self.model_drafter.take_latencies()

    def close(self) -> None:
        self.model_drafter.close()
