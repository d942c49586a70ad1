"""Prompt lookup: the model-free drafter (the latest earlier occurrence of the context's last n tokens, n = 4..1,
and what followed it). The peer baseline every trained draft is compared with."""

from __future__ import annotations

from typing import Sequence

from specdraft.drafting.base import Drafter

MAX_NGRAM = 4
# How far back a match is measured (``lookup_match``): enough to tell a restated passage from a common phrase,
# bounded so that measuring it costs no more than the lookup itself
MAX_MATCH = 64


def lookup_match(context: Sequence[int], num_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = 1) -> tuple[list[int], int]:
    """``lookup_draft``'s draft and its match length: how many of the context's last tokens equal those before
    the occurrence it copies from (at least the n-gram it matched, measured back up to ``MAX_MATCH``); 0 with no
    draft. A long match is a restated stretch (a rewrite, a quoted passage), where the copy tends to hold."""
    ctx = list(context)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                follow = ctx[start + n:start + n + num_tokens]
                if follow:
                    match = n
                    while (match < MAX_MATCH and start + n - match - 1 >= 0
                           and ctx[start + n - match - 1] == ctx[len(ctx) - match - 1]):
                        match += 1
                    return follow, match
    return [], 0


def lookup_draft(context: Sequence[int], num_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1) -> list[int]:
    """Match the last n tokens (n = max..min) at their latest earlier occurrence and copy what followed.
    Returns up to ``num_tokens`` tokens (possibly fewer, or none without a match)."""
    return lookup_match(context, num_tokens, max_ngram, min_ngram)[0]


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return [lookup_draft(c, num_tokens, self.max_ngram, self.min_ngram) for c in contexts]
