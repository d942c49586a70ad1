"""A bounded cache of contexts' keys and values in whole blocks, so a prefill computes only what it has not seen.

vLLM's automatic prefix caching on a CPU's memory budget. ``slot_engine.SlotDecoder`` with a ``PrefixCache``
prefills every context in blocks of ``block_tokens`` tokens at positions aligned to multiples of it, one forward
per block attending to all the columns before it. A block's keys and values then depend only on the tokens up to
its end, and the computation that made them has the same shapes whatever came before: a prefill that copies the
cached blocks of its context's prefix and computes the rest gets the bits a prefill from the first token gets, in
every compute format. (Splitting a context anywhere else is not exact: the attention kernel and the GEMMs round
by how many queries share a call.)

A full block is keyed by the hash chain of its prefix -- its parent's key and its own tokens (vLLM's scheme);
each entry also keeps its parent key and its tokens, so a hash collision is a miss, never a wrong reuse. Entries
are evicted least recently used under a byte budget. Every use touches a chain from its deepest block up to its
root, so no block is older than its descendants: eviction takes leaves first (SGLang's radix cache) and never
strands a block behind an evicted parent. The lock lets the HTTP side ask what a context would reuse (for the
scheduler's admission estimate) while the worker thread copies blocks in and out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PrefixCacheStats:
    """What ``/health`` and ``/metrics`` show of a cache: its budget and use, and its counters since it began."""

    block_tokens: int
    budget_bytes: int
    used_bytes: int
    blocks: int
    lookups: int  # prefills that asked for their prefix
    hits: int  # ... and reused at least one block
    reused_tokens: int  # context tokens copied in instead of computed
    stored_blocks: int
    evicted_blocks: int


@dataclass
class _Entry:
    parent: int | None
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2 (keys, values), kv heads, block_tokens, head dim]


class PrefixCache:
    """Full blocks of context KV keyed by their prefix's hash chain, least recently used out past ``budget_bytes``.

    ``chain(tokens)`` gives the keys of a context's full blocks; ``reusable`` says how many of its tokens a prefill
    would copy in, ``take`` hands over those blocks and ``put`` stores a block once computed.
    """

    def __init__(self, block_tokens: int, budget_bytes: int):
        if block_tokens < 1 or budget_bytes < 0:
            raise ValueError(f"PrefixCache: block_tokens {block_tokens} must be >= 1, budget_bytes {budget_bytes} >= 0")
        self.block_tokens, self.budget_bytes = block_tokens, budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._used = 0
        self._counts = {"lookups": 0, "hits": 0, "reused_tokens": 0, "stored_blocks": 0, "evicted_blocks": 0}

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """The keys of the full blocks of ``tokens``: block i's is the hash of block i-1's key and its tokens."""
        keys: list[int] = []
        parent = None
        b = self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            parent = hash((parent, tuple(tokens[start:start + b])))
            keys.append(parent)
        return keys

    def reusable(self, tokens: Sequence[int], keys: Sequence[int] | None = None) -> int:
        """Context tokens a prefill of ``tokens`` would copy in now: its cached full blocks from the first, short of
        its last token (which a prefill always computes, for its logits). Counts nothing, touches nothing."""
        keys = self.chain(tokens) if keys is None else keys
        with self._lock:
            return self._matched(tokens, keys) * self.block_tokens

    def take(self, tokens: Sequence[int], keys: Sequence[int], limit_tokens: int | None = None) -> list[torch.Tensor]:
        """The KV of the blocks ``reusable`` counts (at most ``limit_tokens`` of them), first block first; they
        become the most recently used."""
        with self._lock:
            n = self._matched(tokens, keys)
            if limit_tokens is not None:
                n = min(n, limit_tokens // self.block_tokens)
            self._touch(keys[:n])
            self._counts["lookups"] += 1
            self._counts["hits"] += n > 0
            self._counts["reused_tokens"] += n * self.block_tokens
            return [self._entries[k].kv for k in keys[:n]]

    def put(self, tokens: Sequence[int], keys: Sequence[int], index: int, kv: torch.Tensor) -> bool:
        """Store block ``index`` of ``tokens`` (its KV as ``_Entry.kv``, a tensor the cache keeps as it is),
        evicting least recently used blocks for room. Not stored (False) when it cannot fit, or when its parent
        block is not cached (nothing could reach it); a block already cached is only touched."""
        b = self.block_tokens
        size = kv.numel() * kv.element_size()
        with self._lock:
            key = keys[index]
            parent = keys[index - 1] if index else None
            if key in self._entries:
                self._touch(keys[:index + 1])
                return True
            if size > self.budget_bytes or (parent is not None and parent not in self._entries):
                return False
            self._touch(keys[:index])  # its ancestors are not evicted to make room for it
            while self._used + size > self.budget_bytes:
                _, gone = self._entries.popitem(last=False)
                self._used -= gone.kv.numel() * gone.kv.element_size()
                self._counts["evicted_blocks"] += 1
            if parent is not None and parent not in self._entries:
                return False
            self._entries[key] = _Entry(parent, tuple(tokens[index * b:(index + 1) * b]), kv)
            self._used += size
            self._counts["stored_blocks"] += 1
            self._touch(keys[:index + 1])
            return True

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(block_tokens=self.block_tokens, budget_bytes=self.budget_bytes,
                                    used_bytes=self._used, blocks=len(self._entries), **self._counts)

    def _matched(self, tokens: Sequence[int], keys: Sequence[int]) -> int:
        """Cached full blocks from the first, at most those that end before the last token (lock held)."""
        b, most = self.block_tokens, (len(tokens) - 1) // self.block_tokens
        parent = None
        for i, key in enumerate(keys[:most]):
            entry = self._entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != tuple(tokens[i * b:(i + 1) * b]):
                return i
            parent = key
        return min(most, len(keys))

    def _touch(self, keys: Sequence[int]) -> None:
        """Most recently used: the deepest block first and the root last, so no parent is older than its child."""
        for key in reversed(keys):
            if key in self._entries:
                self._entries.move_to_end(key)
