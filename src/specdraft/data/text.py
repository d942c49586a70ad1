"""Text normalisation, the word n-gram contamination check and MinHash near-duplicate detection.

``ngram_overlap`` is the one contamination function: the prompts stage drops what it finds and the audit
stage re-runs it on the written prompts against the same evaluation sets.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from datasketch import MinHash, MinHashLSH

_WORD_RE = re.compile(r"\w+")
# Unicode spaces other than tab/newline (no-break, thin, ideographic, zero-width ...) become a plain space.
_ODD_SPACE_RE = re.compile(r"[\u00a0\u1680\u2000-\u200b\u202f\u205f\u3000\ufeff\x0b\x0c]")
_TRAILING_RE = re.compile(r"[ \t]+\n")
_BLANK_LINES_RE = re.compile(r"\n{3,}")


def normalise_prompt(text: str) -> str:
    """Whitespace normalisation that keeps code intact: CRLF -> LF, odd Unicode spaces -> ' ', no trailing
    spaces on lines, at most one blank line in a row, no leading/trailing whitespace. Indentation stays."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _ODD_SPACE_RE.sub(" ", text)
    text = _TRAILING_RE.sub("\n", text)
    text = _BLANK_LINES_RE.sub("\n\n", text)
    return text.strip()


def dedup_key(text: str) -> str:
    """Exact-duplicate key: all whitespace runs collapsed (so two prompts differing only in spacing match)."""
    return " ".join(text.split())


def words(text: str) -> list[str]:
    """Normalised words: lower-cased runs of letters/digits/underscore; punctuation and spacing ignored."""
    return _WORD_RE.findall(text.lower())


def _ngrams(ws: Sequence[str], n: int) -> Iterable[tuple[str, ...]]:
    return (tuple(ws[i:i + n]) for i in range(len(ws) - n + 1))


def ngram_overlap(train_texts: Sequence[str], eval_texts: Iterable[str], n: int = 13) -> list[tuple[int, str]]:
    """Training prompts that share a normalised word n-gram with an evaluation prompt.

    A training prompt of at least ``n`` words is flagged when one of its n-grams occurs in an evaluation
    prompt; a shorter one when its whole word sequence equals an evaluation prompt's (which is then shorter
    than ``n`` words too). Returns ``(train_index, offending_text)`` for each flagged prompt, in index order,
    with the first offending n-gram (or the whole short prompt) joined by spaces.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams: set[tuple[str, ...]] = set()
    short: set[tuple[str, ...]] = set()
    for text in eval_texts:
        ws = words(text)
        if len(ws) < n:
            if ws:
                short.add(tuple(ws))
        else:
            grams.update(_ngrams(ws, n))
    found: list[tuple[int, str]] = []
    for i, text in enumerate(train_texts):
        ws = words(text)
        if len(ws) < n:
            if ws and tuple(ws) in short:
                found.append((i, " ".join(ws)))
            continue
        if not grams:
            continue
        for gram in _ngrams(ws, n):
            if gram in grams:
                found.append((i, " ".join(gram)))
                break
    return found


def contamination_filter(train_texts: Sequence[str], eval_texts: Iterable[str],
                         n: int = 13) -> tuple[list[int], list[tuple[int, str]]]:
    """(indices of clean training prompts, offending (index, n-gram) pairs): ``ngram_overlap`` as a filter."""
    offending = ngram_overlap(train_texts, eval_texts, n)
    bad = {i for i, _ in offending}
    return [i for i in range(len(train_texts)) if i not in bad], offending


def shingles(text: str, k: int = 3) -> set[bytes]:
    """Word k-gram shingles of the normalised text (the whole text when it has fewer than k words)."""
    ws = words(text)
    if len(ws) < k:
        return {(" ".join(ws) or text.strip() or "\0").encode()}
    return {" ".join(ws[i:i + k]).encode() for i in range(len(ws) - k + 1)}


def lsh_bands(threshold: float, num_perm: int, recall: float = 0.99) -> tuple[int, int]:
    """(bands, rows) for LSH: the most rows per band (fewest false candidates) that still finds a pair of
    similarity ``threshold`` with probability >= ``recall``. (datasketch's own choice balances false
    positives and negatives and finds a pair at the threshold only about a third of the time.)"""
    for rows in range(num_perm, 0, -1):
        bands = num_perm // rows
        if 1 - (1 - threshold ** rows) ** bands >= recall:
            return bands, rows
    return num_perm, 1


def near_duplicates(texts: Sequence[str], threshold: float = 0.8, num_perm: int = 64,
                    shingle_words: int = 3, seed: int = 1) -> list[tuple[int, int]]:
    """Near-duplicates by MinHash LSH over word shingles, first occurrence kept.

    Texts are visited in order; a text whose estimated Jaccard similarity with an earlier *kept* text is at
    least ``threshold`` is reported as ``(index, index_of_the_kept_text)``. LSH candidates are confirmed with
    the MinHash estimate, so a report always means estimated similarity >= threshold; bands are chosen by
    ``lsh_bands`` so that a pair at the threshold is a candidate with probability >= 0.99. Deterministic.
    """

    if not texts:
        return []
    sets = [shingles(t, shingle_words) for t in texts]
    hashes = MinHash.bulk(sets, num_perm=num_perm, seed=seed)
    lsh = MinHashLSH(num_perm=num_perm, params=lsh_bands(threshold, num_perm))
    found: list[tuple[int, int]] = []
    for i, mh in enumerate(hashes):
        best = None
        for j in lsh.query(mh):
            if mh.jaccard(hashes[j]) >= threshold and (best is None or j < best):
                best = j
        if best is not None:
            found.append((i, best))
        else:
            lsh.insert(i, mh)
    return found
