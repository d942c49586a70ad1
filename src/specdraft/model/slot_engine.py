"""The slot engine: a preallocated KV cache with one slot per batch row, and continuous batching over it.

``SlotCache`` is like gpt-fast's static KV cache but keeps a column per row, written in place (no ``torch.cat``
per step). ``SlotDecoder`` prefills prompts into free slots (whole, or a long one in pieces) and decodes one
token for every live row per ``step``, with per-row positions and attention masks, so a row gets what it gets
alone; a finished row leaves its slot at once for the next prompt. Its decode steps run ``lean.LeanForward``
where the model allows it. ``supports_slot_cache`` says which models it can run (full attention through
``sdpa`` or ``eager`` in every layer). ``decode.iter_greedy`` and the draft server drive it.

With a ``prefix_cache.PrefixCache`` it runs in block mode: every prompt is prefilled in aligned blocks, one forward
each, its full blocks kept in the cache and the cached ones of a prompt's prefix copied in, not computed; a
prompt then gets the same bits whatever the cache held (``SlotCache.read_columns`` / ``write_columns`` move them).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdraft.model.forward import cache_kwargs, left_pad, model_device, pad_token_id, positions_from_mask
from specdraft.model.generation import (
    DraftSampling,
    Generation,
    RowSampler,
    finish_reason,
    row_samplers,
    top_logprobs_of,
)
from specdraft.model.lean import lean_forward
from specdraft.model.prefix_cache import PrefixCache
from specdraft.model.specs import text_config


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in a :class:`SlotCache`: [slots, kv_heads, capacity, head_dim]."""

    is_sliding = False

    def __init__(self, owner: "SlotCache"):
        super().__init__()
        # A weak reference: cache -> layer -> cache would be a reference cycle, and the KV tensors (hundreds of
        # MB for a large batch) would then live until Python's cyclic GC happened to run, not until the step
        # ended -- the server's RSS grew by GBs over minutes of traffic.
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> "SlotCache":
        return self._owner()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        slots, capacity = self.owner.slots, self.owner.capacity
        # Zeros, not empty: masked columns are still multiplied, and garbage could hold NaN or inf.
        self.keys = key_states.new_zeros((slots, key_states.shape[1], capacity, key_states.shape[3]))
        self.values = value_states.new_zeros((slots, value_states.shape[1], capacity, value_states.shape[3]))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner.write(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.capacity, 0  # unused: the slot engine always passes a prepared 4-D mask

    def get_seq_length(self) -> int:
        return 0  # unused: the slot engine always passes position ids

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """A static KV cache with one slot per batch row, like gpt-fast's KVCache but with a column per row.

    Live rows are slots ``0..n-1``. A row's tokens sit in columns ``[start, end)`` of its slot (``start`` > 0
    when its prompt was left-padded in a prefill group); the next token is written at column ``end``.
    Before each forward the engine says what the forward writes (``plan_prefill`` / ``plan_step``); the
    layers then write in place and hand attention a view of the live rows and columns.
    """

    def __init__(self, num_layers: int, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self._plan: tuple = ("none",)

    def plan_prefill(self, first_row: int, num_rows: int) -> None:
        """The next forward runs ``num_rows`` left-padded prompts into slots ``first_row...``, columns 0..W-1."""
        self._plan = ("prefill", first_row, first_row + num_rows)

    def plan_extend(self, row: int, start: int) -> None:
        """The next forward feeds slot ``row`` the next piece of its prompt, written from column ``start``: it
        attends to the slot's earlier columns and causally within the piece (a long prompt prefilled in chunks)."""
        self._plan = ("extend", row, start)

    def plan_step(self, num_rows: int, write_cols: torch.Tensor, width: int) -> None:
        """The next forward feeds one token to each of rows ``0..num_rows-1``, written at ``write_cols``."""
        rows = torch.arange(num_rows, device=write_cols.device)
        self._plan = ("step", rows, write_cols, width)

    def end_forward(self) -> None:
        """Forget the plan, so that an unplanned forward fails instead of writing to stale places."""
        self._plan = ("none",)

    def write(self, layer: SlotLayer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self._plan[0]
        if kind == "prefill":
            _, r0, r1 = self._plan
            width = k.shape[2]
            layer.keys[r0:r1, :, :width] = k
            layer.values[r0:r1, :, :width] = v
            return k, v  # a prompt attends only to itself
        if kind == "extend":
            _, row, start = self._plan
            end = start + k.shape[2]
            layer.keys[row, :, start:end] = k[0]
            layer.values[row, :, start:end] = v[0]
            return layer.keys[row:row + 1, :, :end], layer.values[row:row + 1, :, :end]
        if kind == "step":
            _, rows, cols, width = self._plan
            layer.keys[rows, :, cols] = k[:, :, 0]  # [n, kv_heads, head_dim] at (row, its column)
            layer.values[rows, :, cols] = v[:, :, 0]
            n = rows.shape[0]
            return layer.keys[:n, :, :width], layer.values[:n, :, :width]
        raise RuntimeError("SlotCache: no write planned for this forward")

    def move_rows(self, src: list[int], dst: list[int], width: int) -> None:
        """Copy the first ``width`` columns of slots ``src`` into slots ``dst`` (filling holes left by
        finished rows, so that the live rows stay at ``0..n-1``)."""
        if not src:
            return
        for layer in self.layers:
            if layer.is_initialized:
                s = torch.tensor(src, device=layer.keys.device)
                d = torch.tensor(dst, device=layer.keys.device)
                layer.keys[d, :, :width] = layer.keys[s, :, :width]
                layer.values[d, :, :width] = layer.values[s, :, :width]

    def read_columns(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Columns ``[start, end)`` of one slot, every layer's keys and values: [layers, 2, kv heads, T, head dim]."""
        return torch.stack([torch.stack((layer.keys[slot, :, start:end], layer.values[slot, :, start:end]))
                            for layer in self.layers])

    def write_columns(self, slot: int, start: int, kv: torch.Tensor) -> None:
        """``read_columns``' layout written into one slot from column ``start``."""
        end = start + kv.shape[3]
        for layer, (k, v) in zip(self.layers, kv):
            if not layer.is_initialized:  # a slot filled from cached blocks before any forward ran
                layer.lazy_initialization(k[None], v[None])
            layer.keys[slot, :, start:end] = k
            layer.values[slot, :, start:end] = v

    def nbytes(self) -> int:
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)


def supports_slot_cache(model) -> bool:
    """The slot engine passes its own 4-D masks, so every layer must be plain full attention via sdpa or eager."""
    text = text_config(model.config)
    if getattr(text, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return getattr(text, "sliding_window", None) is None


class SlotDecoder:
    """Continuous greedy batching over a :class:`SlotCache` (the engine behind ``iter_greedy`` and the server).

    ``admit`` prefills prompts into free slots and ``step`` decodes one token for every live row; both
    return the rows that finished, which leave the batch at once. ``prefill_chunk`` prefills one long prompt a
    piece at a time, between steps of the live rows (it waits in the top slot until its last piece), and
    ``release`` drops rows whose answer nobody wants any more.
    """

    def __init__(self, model, slots: int, capacity: int, max_new_tokens: int, eos: set[int],
                 pad_id: int | None = None, lean: bool = True, row_attention: bool = False, top_logprobs: int = 0,
                 prefix_cache: PrefixCache | None = None):
        self.model, self.max_new_tokens, self.eos = model, max_new_tokens, eos
        # k > 0: each row also keeps the target's k most likely tokens and log-probabilities at every position it
        # generates (the distribution traces store for distillation); computed from the logits the argmax uses
        self.top_k = top_logprobs
        # decode steps through the written-out forward (bit-identical logits, less overhead) where it applies
        self.lean = lean_forward(model) if lean else None
        # attention row by row on each row's own columns, as alone (CPU attention rounds differently with other
        # rows' columns beside a row's keys); one call per row, so only where exactness is promised (the server)
        self.row_attention = row_attention
        self.device = model_device(model)
        self.pad_id = pad_token_id(model) if pad_id is None else pad_id
        self.eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.dtype = next(model.parameters()).dtype
        text = text_config(model.config)
        self.cache = SlotCache(text.num_hidden_layers, slots, capacity)
        self.slots, self.capacity = slots, capacity
        self.n = 0  # live rows: slots 0..n-1
        self.chunked: tuple[int, int] | None = None  # (caller index, slot) of the prompt prefilled in pieces
        self.index: list[int] = []  # caller's index of each live row
        self.tokens: list[list[int]] = []  # generated so far, per live row
        self.tops: list[tuple[list[list[int]], list[list[float]]]] = []  # (top ids, top logprobs) per live row
        self.samplers: list[RowSampler | None] = []  # per live row; None: plain greedy (most rows)
        self.start = torch.zeros(slots, dtype=torch.long, device=self.device)  # first real column
        self.end = torch.zeros(slots, dtype=torch.long, device=self.device)  # next write column
        self.position = torch.zeros(slots, dtype=torch.long, device=self.device)  # next position id
        self.last = torch.zeros(slots, dtype=torch.long, device=self.device)  # token fed at the next step
        self.columns = torch.arange(capacity, device=self.device)
        # Block mode: every prompt is prefilled in blocks aligned to the cache's block size, one forward each, and
        # its full blocks are kept in (and copied from) the cache: a prompt gets the same bits whatever is cached
        # (model.prefix_cache says why). Without a cache, a prompt is prefilled whole, as it always was.
        self.prefix_cache = prefix_cache
        self._chunk_keys: list[int] = []  # block keys of the prompt prefilled in pieces (block mode)

    @property
    def free(self) -> int:
        return self.slots - self.n - (self.chunked is not None)

    def reusable(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt`` a prefill would copy from the prefix cache now (0 without one)."""
        return 0 if self.prefix_cache is None else self.prefix_cache.reusable(prompt)

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean [B, 1, Q, K] for sdpa; an additive float mask for eager attention."""
        if not self.eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~allowed, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def admit(self, indices: Sequence[int], prompts: Sequence[Sequence[int]],
              sampling: Sequence[DraftSampling] | None = None) -> list[tuple[int, Generation]]:
        """Prefill ``prompts`` (one left-padded group) into the next free slots; their first token is the
        prefill's argmax, or drawn as each row's ``sampling`` says (default: all plain greedy). Returns the rows
        already finished (EOS first, or ``max_new_tokens == 1``)."""
        m = len(prompts)
        if m == 0:
            return []
        if m > self.free:
            raise ValueError(f"admit: {m} prompts but only {self.free} free slots")
        if self.prefix_cache is not None:
            return self._admit_blocks(indices, prompts, self._samplers(sampling, m))
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # [m, W]
        width = ids.shape[1]
        self._check_capacity("admit", width)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        allowed = causal[None] & mask.bool()[:, None, :]  # [m, W, W] real keys only
        allowed |= torch.eye(width, dtype=torch.bool, device=self.device)  # padding attends to itself (no NaN)
        r0 = self.n
        self.cache.plan_prefill(r0, m)
        out = self.model(input_ids=ids, attention_mask=self._mask(allowed[:, None]),
                         position_ids=positions_from_mask(mask), use_cache=True, logits_to_keep=1,
                         **cache_kwargs(self.model, self.cache))
        self.cache.end_forward()
        samplers = self._samplers(sampling, m)
        first = self._pick(out.logits[:, -1, :], samplers)  # [m]
        tops = self._tops(out.logits[:, -1, :])
        lengths = mask.sum(-1)
        rows = slice(r0, r0 + m)
        self.start[rows] = width - lengths
        self.end[rows] = width
        self.position[rows] = lengths
        self.last[rows] = first
        self.index.extend(indices)
        self.tokens.extend([] for _ in range(m))
        self.tops.extend(([], []) for _ in range(m))
        self.samplers.extend(samplers)
        self.n += m
        return self._record(first.tolist(), range(r0, r0 + m), tops)

    @torch.inference_mode()
    def prefill_chunk(self, index: int, prompt: Sequence[int], start: int, size: int,
                      sampling: DraftSampling | None = None) -> list[tuple[int, Generation]]:
        """Prefill ``prompt[start:start + size]`` of one long prompt, which waits in the top slot meanwhile (one at a
        time). Its first piece starts at 0 or, with a prefix cache, at ``reusable(prompt)``: that prefix is copied in;
        in block mode a piece starts and ends on a block boundary (or at the prompt's end). Its last piece makes the
        row live, as ``admit`` does (with ``sampling``), and returns it if it already finished."""
        total, end = len(prompt), min(start + size, len(prompt))
        if not start < end:
            raise ValueError(f"prefill_chunk: empty piece [{start}, {end}) of a {total}-token prompt")
        block = self.prefix_cache.block_tokens if self.prefix_cache is not None else 0
        if block and (start % block or (end < total and end % block)):
            raise ValueError(f"prefill_chunk: piece [{start}, {end}) is not on {block}-token block boundaries")
        if start == 0 or self.chunked is None:
            self._begin_pieces(index, prompt, start)
        elif self.chunked[0] != index:
            raise ValueError(f"prefill_chunk: prompt {index} is not the one being prefilled in pieces")
        slot = self.chunked[1]
        logits = self._fill(slot, prompt, self._chunk_keys, start, end)
        if end < total:
            return []
        self.chunked = None
        r = self.n
        if slot != r:
            self.cache.move_rows([slot], [r], total)
        return self._go_live(index, r, total, logits, self._samplers(None if sampling is None else [sampling], 1)[0])

    def _begin_pieces(self, index: int, prompt: Sequence[int], start: int) -> None:
        """The top slot takes a prompt to prefill in pieces, its first ``start`` tokens copied from the cache."""
        if self.chunked is not None:
            raise ValueError("prefill_chunk: another prompt is being prefilled in pieces")
        if start and self.prefix_cache is None:
            raise ValueError(f"prefill_chunk: prompt {index} is not the one being prefilled in pieces")
        if self.free < 1:
            raise ValueError("prefill_chunk: no free slot")
        self._check_capacity("prefill_chunk", len(prompt))
        slot = self.slots - 1
        self._chunk_keys = [] if self.prefix_cache is None else self.prefix_cache.chain(prompt)
        if start and self._copy_in(slot, prompt, self._chunk_keys, start) != start:
            raise ValueError(f"prefill_chunk: the prefix cache does not hold the first {start} tokens of prompt "
                             f"{index}")
        self.chunked = (index, slot)

    def _admit_blocks(self, indices: Sequence[int], prompts: Sequence[Sequence[int]],
                      samplers: list[RowSampler | None]) -> list[tuple[int, Generation]]:
        """Block mode's ``admit``: each prompt into the next free row, its cached prefix copied in and the rest
        computed block by block (each row alone: a block's computation must not depend on its neighbours)."""
        finished: list[tuple[int, Generation]] = []
        for index, prompt, sampler in zip(indices, prompts, samplers):
            self._check_capacity("admit", len(prompt))
            keys = self.prefix_cache.chain(prompt)
            r = self.n
            logits = self._fill(r, prompt, keys, self._copy_in(r, prompt, keys), len(prompt))
            finished += self._go_live(index, r, len(prompt), logits, sampler)
        return finished

    def _copy_in(self, slot: int, prompt: Sequence[int], keys: list[int], limit: int | None = None) -> int:
        """Copy the prompt's cached blocks (at most ``limit`` tokens) into ``slot``; the tokens copied."""
        blocks = self.prefix_cache.take(prompt, keys, limit)
        block = self.prefix_cache.block_tokens
        for i, kv in enumerate(blocks):
            self.cache.write_columns(slot, i * block, kv)
        return len(blocks) * block

    def _fill(self, slot: int, prompt: Sequence[int], keys: list[int], start: int, end: int) -> torch.Tensor:
        """Compute ``prompt[start:end]`` into ``slot``: one forward, or in block mode one per block, each full
        block then stored in the cache. The last position's logits [1, V]."""
        if self.prefix_cache is None:
            return self._extend(slot, prompt, start, end)
        block = self.prefix_cache.block_tokens
        for s in range(start, end, block):
            e = min(s + block, end)
            logits = self._extend(slot, prompt, s, e)
            if e - s == block:
                self.prefix_cache.put(prompt, keys, s // block, self.cache.read_columns(slot, s, e))
        return logits

    def _extend(self, slot: int, prompt: Sequence[int], start: int, end: int) -> torch.Tensor:
        """One forward of ``prompt[start:end]`` into ``slot``, attending to its earlier columns and causally within
        the piece; the last position's logits [1, V]."""
        positions = torch.arange(start, end, device=self.device)[None]  # [1, size]
        allowed = self.columns[:end][None, :] <= positions[0, :, None]  # [size, end]: earlier columns and causal
        self.cache.plan_extend(slot, start)
        out = self.model(input_ids=torch.tensor([list(prompt[start:end])], device=self.device),
                         attention_mask=self._mask(allowed[None, None]), position_ids=positions, use_cache=True,
                         logits_to_keep=1, **cache_kwargs(self.model, self.cache))
        self.cache.end_forward()
        return out.logits[:, -1, :]

    def _go_live(self, index: int, r: int, total: int, logits: torch.Tensor,
                 sampler: RowSampler | None) -> list[tuple[int, Generation]]:
        """Row ``r``, its prompt of ``total`` tokens in columns ``[0, total)``, joins the live rows with its first
        token picked from ``logits``; returned if that already finished it."""
        first = self._pick(logits, [sampler])  # [1]
        self.start[r], self.end[r], self.position[r], self.last[r] = 0, total, total, first[0]
        self.index.append(index)
        self.tokens.append([])
        self.tops.append(([], []))
        self.samplers.append(sampler)
        self.n += 1
        return self._record(first.tolist(), [r], self._tops(logits))

    def _check_capacity(self, what: str, width: int) -> None:
        if width + self.max_new_tokens - 1 > self.capacity:
            raise ValueError(f"{what}: prompt of {width} tokens needs a capacity of "
                             f"{width + self.max_new_tokens - 1} > {self.capacity}")

    def close(self) -> None:
        """Nothing held outside Python: the slots' tensors go with the decoder (``LlamaCppSlots`` frees a context)."""

    @torch.inference_mode()
    def release(self, indices: Iterable[int]) -> None:
        """Drop these rows (live, or the one being prefilled in pieces) without finishing them."""
        wanted = set(indices)
        if self.chunked is not None and self.chunked[0] in wanted:
            self.chunked = None
        rows = [r for r in range(self.n) if self.index[r] in wanted]
        if rows:
            self._release(rows)

    @torch.inference_mode()
    def step(self) -> list[tuple[int, Generation]]:
        """Feed every live row its last token; returns the rows that finished with this step's token."""
        n = self.n
        if n == 0:
            return []
        end = self.end[:n]
        width = int(end.max()) + 1
        cols = self.columns[:width]
        allowed = (cols >= self.start[:n, None]) & (cols <= end[:, None])  # [n, width]
        self.cache.plan_step(n, end, width)
        if self.lean is not None:
            key_ranges = list(zip(self.start[:n].tolist(), (end + 1).tolist())) if self.row_attention else None
            logits = self.lean(self.last[:n, None], self.position[:n, None], allowed[:, None, None], self.cache,
                               key_ranges=key_ranges)
        else:
            logits = self.model(input_ids=self.last[:n, None], attention_mask=self._mask(allowed[:, None, None]),
                                position_ids=self.position[:n, None], use_cache=True,
                                **cache_kwargs(self.model, self.cache)).logits
        self.cache.end_forward()
        nxt = self._pick(logits[:, -1, :], self.samplers)  # [n]
        self.end[:n] += 1
        self.position[:n] += 1
        self.last[:n] = nxt
        return self._record(nxt.tolist(), range(n), self._tops(logits[:, -1, :]))

    def _samplers(self, sampling: Sequence[DraftSampling] | None, m: int) -> list[RowSampler | None]:
        return row_samplers(sampling, m, self.device)

    def _pick(self, logits: torch.Tensor, samplers: Sequence[RowSampler | None]) -> torch.Tensor:
        """Each row's next token from its logits [n, V]: the argmax, except where a row's sampler picks."""
        tokens = logits.argmax(-1)  # [n]
        if not any(samplers):  # all plain greedy rows: the path they always took
            return tokens
        greedy = tokens.tolist()
        for row, sampler in enumerate(samplers):
            if sampler is not None:
                tokens[row] = sampler.pick(logits[row], greedy[row])
        return tokens

    def _tops(self, logits: torch.Tensor) -> tuple[list[list[int]], list[list[float]]] | None:
        return top_logprobs_of(logits, self.top_k) if self.top_k else None

    def _record(self, new_tokens: list[int], rows: Iterable[int],
                tops: tuple[list[list[int]], list[list[float]]] | None = None) -> list[tuple[int, Generation]]:
        finished: list[tuple[int, Generation]] = []
        done: list[int] = []
        for i, (row, tok) in enumerate(zip(rows, new_tokens)):
            toks = self.tokens[row]
            toks.append(tok)
            if tops is not None:
                self.tops[row][0].append(tops[0][i])
                self.tops[row][1].append(tops[1][i])
            sampler = self.samplers[row]
            reason = finish_reason(tok, len(toks), self.max_new_tokens, self.eos, sampler)
            if reason is None:  # else it leaves: the slot is free for the next prompt
                continue
            top_ids, top_lps = self.tops[row] if tops is not None else (None, None)
            finished.append((self.index[row], Generation(toks, reason, top_ids, top_lps,
                                                         **(sampler.report() if sampler else {}))))
            done.append(row)
        if done:
            self._release(done)
        return finished

    def _release(self, done: list[int]) -> None:
        """Free finished slots; live rows from the tail move into the holes so live rows stay 0..n-1."""
        gone = set(done)
        keep_n = self.n - len(gone)
        holes = [r for r in range(keep_n) if r in gone]
        movers = [r for r in range(keep_n, self.n) if r not in gone]
        if movers:
            width = int(self.end[movers].max())
            self.cache.move_rows(movers, holes, width)
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            for t in (self.start, self.end, self.position, self.last):
                t[dst] = t[src]
            for r_src, r_dst in zip(movers, holes):
                self.index[r_dst] = self.index[r_src]
                self.tokens[r_dst] = self.tokens[r_src]
                self.tops[r_dst] = self.tops[r_src]
                self.samplers[r_dst] = self.samplers[r_src]
        del self.index[keep_n:]
        del self.tokens[keep_n:]
        del self.tops[keep_n:]
        del self.samplers[keep_n:]
        self.n = keep_n
