"""The draft server's rows in llama.cpp: ``slot_engine.SlotDecoder``'s interface over a GGUF draft, with sessions.

llama.cpp is the CPU engine users run, and where torch has AVX2 alone its Q4_1 x q8_1 kernels decode a 4-bit draft
several times faster than torch's int4 kernel. ``LlamaCppSlots`` keeps its rows in one llama.cpp context of
sequences with cells of their own (``kv_unified`` off, as the llama.cpp trace backend): ``admit`` prefills a
context into a sequence and ``step`` feeds every live row its last token in one ``llama_decode``; a one-token step
per sequence gives the bits it gives alone, whoever shares the batch.

Every position gets the bits a pass of its own token gives it: a decode step feeds a drafted token alone, and a
prefill feeds a context in passes of ``pass_tokens`` tokens, the most that ``model.llamacpp.exact_pass_tokens``
found to give one-token passes' logits bit for bit on this model, CPU and thread count (1 where none does: llama.cpp
rounds a long pass, or with several threads a one-token pass over a long cache, otherwise). A position's keys and
values then depend only on the tokens up to it, never on how they were grouped into passes, so a request gets the
same bits whatever the server computed before, with the cache on or off.

Prefix reuse is per sequence, as llama-server's slots keep their prompt (``cache_prompt``): with a ``SessionCache``
a finished row's sequence keeps the keys and values of everything it was fed -- its context and its drafted tokens
-- and the next context is given the idle sequence that holds the longest prefix of it; only the rest is computed,
so a speculation loop's call computes the target's token, not the drafted tokens it accepted. ``SessionCache``
counts what is reused and sizes the sessions kept beyond the rows decoding: the prefix cache's memory budget, in
whole sequences.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from specdraft.model.generation import DraftSampling, Generation, RowSampler, finish_reason, row_samplers
from specdraft.model.llamacpp import CTX_PAD, llama_cpp_module, logits_row, sequences_context, set_batch_token
from specdraft.model.prefix_cache import PrefixCacheStats

CPU = torch.device("cpu")  # llama.cpp hands its logits over in host memory


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one position takes in llama.cpp's cache (f16, every layer)."""
    lib = llama_cpp_module()
    head_dim = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
    return lib.llama_model_n_layer(model) * 2 * lib.llama_model_n_head_kv(model) * head_dim * 2


def common_prefix(a: Sequence[int], b: Sequence[int], most: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``most``: compared in slices (at C speed), then one by
    one in the slice that differs."""
    limit, step, n = min(most, len(a), len(b)), 64, 0
    while n + step <= limit and a[n:n + step] == b[n:n + step]:
        n += step
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class SessionCache:
    """The prefix cache of llama.cpp lanes: the memory budget that buys sessions beyond the lanes' rows (whole
    sequences, allocated by llama.cpp with the lane), and what they report (``stats``, as ``PrefixCache.stats``:
    ``/health`` and ``/metrics`` read it). A row's own sequence keeps its context for reuse too, so the bytes
    ``stats`` reports as the budget are every sequence's: the rows' and the sessions the budget bought."""

    block_tokens = 1  # reuse at token granularity: every position has the bits of a one-token pass

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"SessionCache: budget_bytes {budget_bytes} must be >= 0")
        self.budget_bytes = budget_bytes
        self._left = budget_bytes
        self._held_bytes = 0  # every lane's sequences, rows' and extra sessions'
        self._lock = threading.Lock()
        self._lanes: list[LlamaCppSlots] = []
        self._counts = {"lookups": 0, "hits": 0, "reused_tokens": 0, "stored_blocks": 0, "evicted_blocks": 0}

    def claim(self, lane: "LlamaCppSlots", session_bytes: int, most: int) -> int:
        """How many sessions of ``session_bytes`` (at most ``most``) a lane may keep beyond its rows, taken from
        what is left of the budget; the lane's use is reported from now on."""
        with self._lock:
            extra = min(most, self._left // max(session_bytes, 1))
            self._left -= extra * session_bytes
            self._held_bytes += (lane.slots + extra) * session_bytes
            self._lanes.append(lane)
            return extra

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def stats(self) -> PrefixCacheStats:
        held = [lane.held_tokens() for lane in self._lanes]
        with self._lock:
            return PrefixCacheStats(block_tokens=self.block_tokens, budget_bytes=self._held_bytes,
                                    used_bytes=sum(bytes_ for _, bytes_ in held),
                                    blocks=sum(tokens for tokens, _ in held), **self._counts)


@dataclass
class _Row:
    """A context decoding in a sequence: the caller's index, where its next token goes, what it generated."""

    index: int
    seq: int
    position: int  # where its last token goes at the next step (its context's length, then one more a step)
    tokens: list[int]
    sampler: RowSampler | None


class LlamaCppSlots:
    """``slots`` rows of at most ``capacity`` positions (context + ``max_new_tokens``) decoding together in llama.cpp,
    over the GGUF ``model`` (``model.llamacpp.load_gguf_model``; the caller frees it after ``close``). With a
    ``SessionCache``, finished rows' sequences are kept for reuse (more of them as its budget allows); without one,
    nothing is kept. The interface is ``SlotDecoder``'s."""

    def __init__(self, model: Any, slots: int, capacity: int, max_new_tokens: int, eos: set[int],
                 vocab_size: int, threads: int | None = None, cache: SessionCache | None = None, name: str = "draft",
                 pass_tokens: int = 1):
        lib = self.lib = llama_cpp_module()
        self.slots, self.capacity, self.max_new_tokens, self.eos = slots, capacity, max_new_tokens, eos
        self.vocab_size, self.name = vocab_size, name
        self.cache = cache
        self.token_bytes = kv_bytes_per_token(model)
        cells = -(-capacity // CTX_PAD) * CTX_PAD
        # llama.cpp allocates (and clears) every sequence up front: idle sessions beyond the rows' own, at most one
        # per row, so the default budget does not preallocate memory a few loops never use
        most = min(slots, lib.llama_max_parallel_sequences() - slots)
        extra = cache.claim(self, cells * self.token_bytes, most) if cache is not None else 0
        self.sequences = slots + extra  # a live row, or the context prefilled in pieces, holds one each
        threads = threads or max(1, (os.cpu_count() or 2) - 1)
        # a step's batch holds one token per sequence, a prefill's pass ``pass_tokens`` (exact_pass_tokens' count:
        # larger passes would round otherwise); llama.cpp reserves its graph for the larger
        self.pass_tokens = pass_tokens
        batch_tokens = max(self.sequences, pass_tokens)
        self.ctx, self.positions = sequences_context(model, self.sequences, capacity, batch_tokens, threads, name)
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self.rows: list[_Row] = []
        self.chunked: _Row | None = None  # the context being prefilled in pieces (its ``tokens`` empty)
        self._lock = threading.Lock()  # ``held`` and ``busy``: the HTTP side asks ``reusable``
        self.held: list[list[int]] = [[] for _ in range(self.sequences)]  # each sequence's reusable prefix
        self.busy: set[int] = set()
        self._clock = itertools.count()
        self.last_used = [next(self._clock) for _ in range(self.sequences)]

    # -- what SlotLane reads of the live rows, in row order
    @property
    def index(self) -> list[int]:
        return [r.index for r in self.rows]

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.rows]

    @property
    def samplers(self) -> list[RowSampler | None]:
        return [r.sampler for r in self.rows]

    @property
    def free(self) -> int:
        return self.slots - len(self.rows) - (self.chunked is not None)

    def held_tokens(self) -> tuple[int, int]:
        """Positions the idle and live sequences keep for reuse, and their bytes."""
        with self._lock:
            tokens = sum(map(len, self.held))
        return tokens, tokens * self.token_bytes

    def reusable(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` a prefill would take from an idle sequence now, not compute (0 without a cache)."""
        with self._lock:
            return max((n for _, n in self._candidates(prompt)), default=0)

    def close(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None

    # ------------------------------------------------------------------------------------------- rows

    def admit(self, indices: Sequence[int], prompts: Sequence[Sequence[int]],
              sampling: Sequence[DraftSampling] | None = None) -> list[tuple[int, Generation]]:
        """Prefill each prompt into a sequence (its reusable prefix taken, the rest computed), each row's first
        token picked as its ``sampling`` says; the rows already finished."""
        if len(prompts) > self.free:
            raise ValueError(f"admit: {len(prompts)} prompts but only {self.free} free slots")
        samplers = row_samplers(sampling, len(prompts), CPU)
        finished: list[tuple[int, Generation]] = []
        for index, prompt, sampler in zip(indices, prompts, samplers):
            prompt = self._checked(prompt)
            seq, reused = self._take_sequence(prompt)
            try:
                logits = self._fill(seq, prompt, reused, len(prompt))
            except BaseException:
                self._idle(seq)
                raise
            finished += self._go_live(_Row(index, seq, len(prompt), [], sampler), logits)
        return finished

    def prefill_chunk(self, index: int, prompt: Sequence[int], start: int, size: int,
                      sampling: DraftSampling | None = None) -> list[tuple[int, Generation]]:
        """Prefill ``prompt[start:start + size]`` of one long prompt (its first piece starts at ``reusable(prompt)``:
        that prefix is taken from an idle sequence); its last piece makes the row live, as ``admit`` does."""
        prompt = self._checked(prompt)
        total, end = len(prompt), min(start + size, len(prompt))
        if not start < end:
            raise ValueError(f"prefill_chunk: empty piece [{start}, {end}) of a {total}-token prompt")
        if self.chunked is None or start == 0:
            if self.chunked is not None:
                raise ValueError("prefill_chunk: another prompt is being prefilled in pieces")
            if self.free < 1:
                raise ValueError("prefill_chunk: no free slot")
            seq, reused = self._take_sequence(prompt, limit=start)
            if reused != start:
                raise ValueError(f"prefill_chunk: no idle sequence holds the first {start} tokens of prompt {index}")
            self.chunked = _Row(index, seq, total, [], row_samplers(
                None if sampling is None else [sampling], 1, CPU)[0])
        elif self.chunked.index != index:
            raise ValueError(f"prefill_chunk: prompt {index} is not the one being prefilled in pieces")
        row = self.chunked
        logits = self._fill(row.seq, prompt, start, end)
        if end < total:
            return []
        self.chunked = None
        return self._go_live(row, logits)

    def step(self) -> list[tuple[int, Generation]]:
        """Feed every live row its last token, all in one ``llama_decode``; the rows that finished."""
        if not self.rows:
            return []
        batch = self.batch
        for n, row in enumerate(self.rows):
            set_batch_token(self.batch, n, row.tokens[-1], row.position, row.seq, True)
        batch.n_tokens = len(self.rows)
        self._decode(self.rows[0].seq)
        picked = [self._pick(row, logits_row(self.ctx, n, self.vocab_size)) for n, row in enumerate(self.rows)]
        with self._lock:
            for row in self.rows:
                row.position += 1
                if self.cache is not None:  # its keys and values are as a prefill would compute them: kept
                    self.held[row.seq].append(row.tokens[-1])
        return self._record(list(self.rows), picked)

    def release(self, indices: Iterable[int]) -> None:
        """Drop these rows (live, or the one being prefilled in pieces) without finishing them."""
        wanted = set(indices)
        if self.chunked is not None and self.chunked.index in wanted:
            self._idle(self.chunked.seq)
            self.chunked = None
        for row in [r for r in self.rows if r.index in wanted]:
            self.rows.remove(row)
            self._idle(row.seq)

    # ------------------------------------------------------------------------------------------- sequences

    def _candidates(self, prompt: Sequence[int]) -> list[tuple[int, int]]:
        """(idle sequence, tokens of ``prompt`` it can give) for every idle sequence (lock held): their common
        prefix, short of the prompt's last token, which a prefill always computes (for its logits)."""
        if self.cache is None:
            return []
        most = len(prompt) - 1
        return [(seq, common_prefix(held, prompt, most)) for seq, held in enumerate(self.held) if seq not in self.busy]

    def _take_sequence(self, prompt: Sequence[int], limit: int | None = None) -> tuple[int, int]:
        """An idle sequence for ``prompt``: the one holding its longest reusable prefix (at most ``limit`` tokens),
        else the least recently used; cut back to that prefix. The sequence and the tokens it keeps."""
        with self._lock:
            candidates = self._candidates(prompt) or [(s, 0) for s in range(self.sequences) if s not in self.busy]
            if limit is not None:
                candidates = [(s, min(n, limit)) for s, n in candidates]
            # the longest prefix; among equals the least recently used, so recent sessions stay
            seq, reused = max(candidates, key=lambda c: (c[1], -self.last_used[c[0]]))
            self.busy.add(seq)
            evicted = len(self.held[seq]) - reused
            self.held[seq] = self.held[seq][:reused]
        if self.cache is not None:
            self.cache.count(lookups=1, hits=int(reused > 0), reused_tokens=reused, evicted_blocks=evicted)
        self.lib.llama_memory_seq_rm(self.memory, seq, reused, -1)
        return seq, reused

    def _idle(self, seq: int) -> None:
        with self._lock:
            self.busy.discard(seq)
            self.last_used[seq] = next(self._clock)
            if self.cache is None:
                self.held[seq] = []

    # ------------------------------------------------------------------------------------------- model calls

    def _fill(self, seq: int, prompt: list[int], start: int, end: int) -> np.ndarray:
        """Compute ``prompt[start:end]`` into ``seq`` in passes of ``pass_tokens`` (kept for reuse with a cache). The
        last position's logits (a copy)."""
        for first in range(start, end, self.pass_tokens):
            chunk = prompt[first:min(first + self.pass_tokens, end)]
            for n, token in enumerate(chunk):
                set_batch_token(self.batch, n, token, first + n, seq, first + n == end - 1)
            self.batch.n_tokens = len(chunk)
            self._decode(seq, cut=first)
            if self.cache is not None:
                with self._lock:
                    self.held[seq].extend(chunk)
        if self.cache is not None:
            self.cache.count(stored_blocks=end - start)
        return logits_row(self.ctx, len(chunk) - 1, self.vocab_size).copy()

    def _decode(self, seq: int, cut: int | None = None) -> None:
        code = self.lib.llama_decode(self.ctx, self.batch)
        if code != 0:
            if cut is not None:  # a failed prefill leaves nothing half-written behind
                self.lib.llama_memory_seq_rm(self.memory, seq, cut, -1)
            raise RuntimeError(f"{self.name}: llama_decode returned {code}")

    # ------------------------------------------------------------------------------------------- tokens

    def _checked(self, prompt: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("an empty prompt")
        if len(prompt) + self.max_new_tokens - 1 > min(self.capacity, self.positions):
            raise ValueError(f"prompt of {len(prompt)} tokens needs a capacity of "
                             f"{len(prompt) + self.max_new_tokens - 1} > {min(self.capacity, self.positions)}")
        return prompt

    @staticmethod
    def _pick(row: _Row, logits: np.ndarray) -> int:
        greedy = int(logits.argmax())
        if row.sampler is None:
            return greedy
        return row.sampler.pick(torch.from_numpy(logits.copy()), greedy)

    def _go_live(self, row: _Row, logits: np.ndarray) -> list[tuple[int, Generation]]:
        self.rows.append(row)
        return self._record([row], [self._pick(row, logits)])

    def _record(self, rows: list[_Row], picked: list[int]) -> list[tuple[int, Generation]]:
        finished = []
        for row, token in zip(rows, picked):
            row.tokens.append(token)
            reason = finish_reason(token, len(row.tokens), self.max_new_tokens, self.eos, row.sampler)
            if reason is None:
                continue
            finished.append((row.index, Generation(row.tokens, reason,
                                                   **(row.sampler.report() if row.sampler else {}))))
            self.rows.remove(row)
            self._idle(row.seq)
        return finished
