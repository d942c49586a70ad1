"""Prompt lookup: the model-free drafter (the latest earlier occurrence of the context's last n tokens, n = 4..1,
and what followed it). The peer baseline every trained draft is compared with, and the guided draft's proposals
(``lookup_continuations``)."""

from __future__ import annotations

from typing import Sequence

from specdraft.core.wire import MAX_GUIDES
from specdraft.drafting.base import Drafter

MAX_NGRAM = 4
# How far back a match is measured (``lookup_match``): enough to tell a restated passage from a common phrase,
# bounded so that measuring it costs no more than the lookup itself
MAX_MATCH = 64


def _latest_occurrence(ctx: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int] | None:
    """(n, start) of the latest earlier occurrence of the context's last n tokens with something after it, for
    the largest n from ``max_ngram`` down to ``min_ngram``; None where there is none."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                return n, start
    return None


def _match_length(ctx: list[int], n: int, start: int) -> int:
    """How many of the context's last tokens equal those before what follows the occurrence at ``start`` (at least
    its n-gram, measured back up to ``MAX_MATCH``)."""
    match = n
    while (match < MAX_MATCH and start + n - match - 1 >= 0
           and ctx[start + n - match - 1] == ctx[len(ctx) - match - 1]):
        match += 1
    return match


def lookup_match(context: Sequence[int], num_tokens: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = 1) -> tuple[list[int], int]:
    """``lookup_draft``'s draft and its match length: how many of the context's last tokens equal those before
    the occurrence it copies from (at least the n-gram it matched, measured back up to ``MAX_MATCH``); 0 with no
    draft. A long match is a restated stretch (a rewrite, a quoted passage), where the copy tends to hold."""
    ctx = list(context)
    found = _latest_occurrence(ctx, max_ngram, min_ngram)
    if found is None or num_tokens < 1:
        return [], 0
    n, start = found
    return ctx[start + n:start + n + num_tokens], _match_length(ctx, n, start)


def lookup_continuations(context: Sequence[int], num_tokens: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1,
                         limit: int = MAX_GUIDES) -> tuple[list[list[int]], int]:
    """Every distinct continuation lookup could copy, up to ``limit``: what followed each earlier occurrence of the
    n-gram ``lookup_match`` matched, the latest first (``lookup_match``'s draft), with ``lookup_match``'s match
    length. A guided draft (``model.generation.GuideFollower``) picks among them token by token: where the text
    repeated a phrase more than once, the latest occurrence is not always the one it repeats now."""
    ctx = list(context)
    found = _latest_occurrence(ctx, max_ngram, min_ngram)
    if found is None or num_tokens < 1:
        return [], 0
    n, latest = found
    tail, out = ctx[-n:], []
    for start in range(latest, -1, -1):
        if len(out) >= limit:
            break
        if ctx[start:start + n] == tail:
            follow = ctx[start + n:start + n + num_tokens]
            if follow not in out:
                out.append(follow)
    return out, _match_length(ctx, n, latest)


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
