"""The target as speculative decoding uses it, whatever engine runs it: prefill a prompt, verify a run of tokens
in one pass, drop what was rejected.

``TorchTarget`` runs a transformers model (specdraft's own engine); ``model.llama_cpp.LlamaCppTarget`` runs a
GGUF file in llama.cpp. ``drafting.speculative`` and ``drafting.timing`` take either.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch
from transformers import DynamicCache

from specdraft.model.decode import greedy_decode
from specdraft.model.forward import crop_cache, eos_token_ids, extend
from specdraft.model.generation import Generation


class TargetModel(ABC):
    """One sequence at a time; the engine's cache holds the positions fed so far."""

    engine: str = "engine"
    name: str = "target"
    vocab_size: int
    eos_ids: frozenset[int]
    # True where a pass over several tokens gives every position the argmax a one-token pass gives, so
    # speculative decoding reproduces plain greedy bit for bit. llama.cpp's batched kernels round differently
    # from its one-token ones (by design): there near-ties may part, and the report counts where they do.
    exact: bool = True

    @abstractmethod
    def prefill(self, prompt: Sequence[int]) -> int:
        """Start a new sequence with ``prompt``; its greedy next token."""

    @abstractmethod
    def verify(self, tokens: Sequence[int], start: int) -> list[int]:
        """Feed ``tokens`` at positions start.. (the cache holds everything before ``start``, and is cut there
        first); the greedy next token after each of them."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache."""

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        """Plain greedy decoding, one token per pass, stopping at EOS: the reference output."""
        tokens = [self.prefill(prompt)]
        while tokens[-1] not in self.eos_ids and len(tokens) < max_new_tokens:
            tokens += self.verify(tokens[-1:], len(prompt) + len(tokens) - 1)
        return Generation(tokens, "eos" if tokens[-1] in self.eos_ids else "length")

    def close(self) -> None:
        """Free the engine's memory."""


class TorchTarget(TargetModel):
    """A transformers causal LM with a DynamicCache (float32 unless loaded otherwise)."""

    engine = "torch"

    def __init__(self, model, name: str = "target"):
        self.model, self.name = model.eval(), name
        self.vocab_size = model.config.vocab_size
        self.eos_ids = frozenset(eos_token_ids(model))
        self.cache = DynamicCache(config=model.config)

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int]) -> int:
        self.cache = DynamicCache(config=self.model.config)
        return int(extend(self.model, list(prompt), self.cache, 0, logits_to_keep=1)[0, -1].argmax())

    @torch.inference_mode()
    def verify(self, tokens: Sequence[int], start: int) -> list[int]:
        crop_cache(self.cache, start)
        return extend(self.model, list(tokens), self.cache, start)[0].argmax(-1).tolist()

    def truncate(self, length: int) -> None:
        crop_cache(self.cache, length)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> Generation:
        # the batched decoder the other stages use (tested against the naive one): the reference tokens
        return greedy_decode(self.model, [list(prompt)], max_new_tokens, eos_ids=self.eos_ids)[0]


def as_target(model_or_target) -> TargetModel:
    """A ``TargetModel`` as it is; a transformers model wrapped in ``TorchTarget``."""
    return model_or_target if isinstance(model_or_target, TargetModel) else TorchTarget(model_or_target)
