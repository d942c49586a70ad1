"""Drafters: anything that proposes the next tokens for a batch of contexts.

``ModelDrafter`` runs a draft LM with the shared decode loop; ``LookupDrafter`` is the model-free
prompt-lookup baseline (the latest earlier occurrence of the context's last n tokens, n = 4..1, and
what followed it); ``HybridDrafter`` asks prompt lookup first and the draft model only where the context
gives lookup nothing to copy.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .decode import draft_batch


class Drafter(Protocol):
    name: str

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]: ...


class ModelDrafter:
    def __init__(self, model, name: str = "model", max_batch_size: int = 32):
        self.model, self.name, self.max_batch_size = model, name, max_batch_size

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        out: list[list[int]] = []
        # Length-sorted chunks keep padding small; results go back in the caller's order.
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        by_index: dict[int, list[int]] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for i, row in zip(chunk, draft_batch(self.model, [contexts[i] for i in chunk], num_tokens)):
                by_index[i] = row
        out = [by_index[i] for i in range(len(contexts))]
        return out


def lookup_draft(context: Sequence[int], num_tokens: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: match the last n tokens (n = max..min) at their latest earlier occurrence and copy
    what followed. Returns up to ``num_tokens`` tokens (possibly fewer, or none without a match)."""
    ctx = list(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                follow = ctx[start + n:start + n + num_tokens]
                if follow:
                    return follow
    return []


class LookupDrafter:
    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return [lookup_draft(c, num_tokens, self.max_ngram, self.min_ngram) for c in contexts]


DEFAULT_HYBRID_MIN_NGRAM = 2


class HybridDrafter:
    """A draft model with prompt lookup in front: where the context's last ``min_ngram`` (or more, up to
    ``max_ngram``) tokens occurred earlier, propose what followed them (free); elsewhere ask the model.

    The two fail in different places: lookup wins in repetitive stretches (lists, code, restated text) and
    has nothing to say elsewhere; the model drafts everywhere but pays a forward pass per token. The model
    stays pure inference (the draft server never sees the lookup); the combination lives in the client.
    Counts of points each side answered are kept in ``lookup_used`` / ``model_used``.
    """

    def __init__(self, model_drafter: Any, min_ngram: int = DEFAULT_HYBRID_MIN_NGRAM, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.model_drafter, self.min_ngram, self.max_ngram = model_drafter, min_ngram, max_ngram
        self.name = f"{getattr(model_drafter, 'name', 'model')}+lookup{min_ngram}"
        self.model = getattr(model_drafter, "model", None)  # eval checks token ids against its vocab
        self.concurrency = getattr(model_drafter, "concurrency", 4)
        self.lookup_used = self.model_used = 0

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        out = [lookup_draft(c, num_tokens, self.max_ngram, self.min_ngram) for c in contexts]
        ask = [i for i, d in enumerate(out) if not d]
        if ask:
            drafts = self.model_drafter.draft([contexts[i] for i in ask], num_tokens)
            if len(drafts) != len(ask):
                raise RuntimeError(f"model drafter returned {len(drafts)} drafts for {len(ask)} contexts")
            for i, d in zip(ask, drafts):
                out[i] = list(d)
        self.lookup_used += len(contexts) - len(ask)
        self.model_used += len(ask)
        return out

    def take_latencies(self) -> list[float]:
        take = getattr(self.model_drafter, "take_latencies", None)
        return take() if take else []

    def close(self) -> None:
        close = getattr(self.model_drafter, "close", None)
        if close:
            close()
