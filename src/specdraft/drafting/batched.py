"""A draft model in process, stateless: every call prefills its contexts and decodes ``num_tokens`` greedy
tokens with the shared decode loop (``model.decode.draft_batch``), as the draft server does."""

from __future__ import annotations

from typing import Sequence

from specdraft.drafting.base import Drafter
from specdraft.model.decode import draft_batch


class ModelDrafter(Drafter):
    def __init__(self, model, name: str = "model", max_batch_size: int = 32):
        self.model, self.name, self.max_batch_size = model, name, max_batch_size

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        # Length-sorted chunks keep padding small; results go back in the caller's order.
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        by_index: dict[int, list[int]] = {}
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for i, row in zip(chunk, draft_batch(self.model, [contexts[i] for i in chunk], num_tokens)):
                by_index[i] = row
        return [by_index[i] for i in range(len(contexts))]
