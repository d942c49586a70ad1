"""Drafters: anything that proposes the next tokens for a batch of contexts.

``ModelDrafter`` runs a draft LM with the shared decode loop; ``LookupDrafter`` is the model-free
prompt-lookup baseline (the latest earlier occurrence of the context's last n tokens, n = 4..1, and
what followed it).
"""

from __future__ import annotations

from typing import Protocol, Sequence

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
