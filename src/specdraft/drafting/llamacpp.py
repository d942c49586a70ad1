"""Drafters that run in llama.cpp (llama-cpp-python): a draft GGUF with its KV cache kept across steps -- any
``specdraft export`` output, or a target's own file as its self-draft -- and llama-cpp-python's n-gram drafter
(``LlamaPromptLookupDecoding``, the binding's own prompt lookup)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from specdraft.drafting.base import Drafter, check_guided
from specdraft.drafting.metrics import accepted_length
from specdraft.model.generation import GuideFollower
from specdraft.model.llamacpp import LlamaCppModel, llama_cpp_module


class LlamaCppDrafter(Drafter):
    """Greedy drafts from a GGUF model in llama.cpp. Each call keeps the longest common prefix of the cached
    tokens and the new context (the accepted part of the previous draft), feeds the rest in one batch, then
    decodes one token at a time: what ``llama-speculative-simple``'s draft does."""

    def __init__(self, path: str | os.PathLike, n_ctx: int = 4096, threads: int | None = None, name: str = "draft"):
        self.model, self.name = LlamaCppModel(path, n_ctx=n_ctx, threads=threads), name
        self.path = self.model.path

    def draft_one(self, context: Sequence[int], num_tokens: int, guides: Sequence[Sequence[int]] = (),
                  guide_min_ratio: float = 1.0) -> list[int]:
        """A greedy draft; with ``guides``, one that follows them as the server's rows do
        (``model.generation.DraftSampling``)."""
        context = [int(t) for t in context]
        if num_tokens < 1:
            return []
        common = accepted_length(self.model.tokens, context)  # the cached prefix still valid
        start = min(common, len(context) - 1)  # at least the last token is fed: its logits start the draft
        follower, out = GuideFollower(guides, guide_min_ratio), []
        logits = self.model.decode(context[start:], start)[-1]
        while True:
            top = int(logits.argmax())
            out.append(follower.pick(torch.softmax(torch.from_numpy(np.asarray(logits)).float(), -1), top)
                       if follower.on else top)
            if len(out) == num_tokens:
                return out
            logits = self.model.decode(out[-1:], len(context) + len(out) - 1)[-1]

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return [self.draft_one(c, num_tokens) for c in contexts]

    follows_guides = True

    def draft_guided(self, contexts, num_tokens, guides, min_ratios):
        check_guided(contexts, guides, min_ratios)
        return [self.draft_one(c, num_tokens, g, r) for c, g, r in zip(contexts, guides, min_ratios)]

    def reset(self) -> None:
        self.model.truncate(0)

    def close(self) -> None:
        self.model.close()


class LlamaCppNgramDrafter(Drafter):
    """llama-cpp-python's ``LlamaPromptLookupDecoding``: the first earlier occurrence of the context's last
    ``max_ngram`` (then fewer) tokens, and what followed it; nothing without a match."""

    def __init__(self, max_ngram: int = 2, name: str = "ngram"):
        speculative = llama_cpp_module().llama_speculative
        self.lookup, self.name = speculative.LlamaPromptLookupDecoding(max_ngram_size=max_ngram), name

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        out = []
        for context in contexts:
            self.lookup.num_pred_tokens = num_tokens
            out.append([int(t) for t in self.lookup(np.asarray(context, dtype=np.intc))])
        return out
