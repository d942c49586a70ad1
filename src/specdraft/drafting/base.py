"""The one drafter interface: ``draft(contexts, num_tokens) -> one list of token ids per context``.

Every drafter -- a draft model in process (``ModelDrafter`` re-prefills each call, ``CachedDraftModel`` keeps its
KV cache), the draft server over HTTP (``HTTPDrafter``), model-free prompt lookup (``LookupDrafter``) and lookup
in front of a model (``HybridDrafter``) -- is measured by the same code: acceptance on evaluation points
(``drafting.acceptance.evaluate_drafter``) and end-to-end speculative decoding
(``drafting.speculative.speculative_generate``, which drafts for one context at a time). A draft may be
shorter than asked (lookup without a match proposes nothing); it is never longer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence


class DrafterError(RuntimeError):
    """A drafter that failed or answered something unusable."""


class Drafter(ABC):
    name: str = "drafter"

    @abstractmethod
    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Up to ``num_tokens`` greedy draft tokens after each context, in the contexts' order."""

    def draft_one(self, context: Sequence[int], num_tokens: int) -> list[int]:
        """The draft for one context."""
        return list(self.draft([context], num_tokens)[0])

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
    """Proposes nothing: speculative decoding with it is plain greedy, one target forward per token -- the
    baseline timed against speculation in the same loop."""

    name = "none"

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return [[] for _ in contexts]
