"""Batched greedy decoding with a KV cache, written once and used by traces, the draft server and eval.

The shape follows gpt-fast: ``prefill`` runs the (left-padded) prompts, ``decode_step`` feeds one token
per row, ``greedy_decode`` loops. Every row keeps its own positions (``cumsum(mask) - 1``), so a row
decoded inside a left-padded batch sees exactly what it would see alone. ``naive_greedy`` recomputes the
whole sequence every step with no cache and no padding: the reference the fast path is tested against.

Two engines share those rules:

* **slot engine** (the default, ``kv_cache="static"``): a preallocated :class:`SlotCache`, one slot per
  batch row, written in place at each row's own column (no ``torch.cat`` per step). Rows that finish
  (EOS or the limit) leave their slot and waiting prompts are prefilled into the free slots (continuous
  batching), so the batch stays full instead of decoding padding until its longest row ends.
  ``iter_greedy`` yields each prompt's result as soon as it is done. Needs a model whose layers all use
  full attention through ``sdpa`` or ``eager`` (Llama, Qwen2/3, Mistral without a window, ...). Its decode
  steps run ``lean.LeanForward`` (the forward written out; bit-identical logits) where the model allows it.
* **dynamic engine** (``kv_cache="dynamic"``, and the fallback for any other model): the small
  ``prefill`` / ``decode_step`` / ``keep_rows`` functions over a transformers ``DynamicCache``; one
  left-padded batch, finished rows dropped.

The slot engine also drafts with per-row sampling settings (``DraftSampling``: temperature, top-k, top-p through
``model.sampling.warp_probs``, a seeded generator per row, the draft's probability of each token): the draft
server's sampled drafts. ``naive_draft`` is their no-cache reference.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Literal, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from specdraft.model.lean import lean_forward
from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs

KVCache = Literal["auto", "static", "dynamic"]
DEFAULT_PREFILL_TOKENS = 8192  # most prompt tokens (padding included) run through one prefill forward
DEFAULT_MAX_PADDING = 0.1  # most padding in a prefill group, as a fraction of its tokens


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    # with ``top_logprobs=k``: at each generated position, the k most likely token ids (most likely first; the
    # generated token is the first) and their log-probabilities under the full softmax
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # with a ``DraftSampling`` that asks for them: the probability of each generated token under the row's warped
    # distribution, and that distribution's most likely tokens and their probabilities at each position
    probs: list[float] | None = None
    alternative_ids: list[list[int]] | None = None
    alternative_probs: list[list[float]] | None = None


@dataclass(frozen=True)
class DraftSampling:
    """How one row of the slot engine picks its tokens, and what it reports besides them.

    ``params`` greedy (the default) takes the argmax, as every other row; otherwise tokens are drawn from
    ``warp_probs(logits, params)`` with a generator of the row's own, seeded with ``seed`` (None: a fresh random
    seed), so a seeded row draws the same tokens whatever shares its batch. ``return_probs`` records the warped
    probability of each drawn token (greedy: the one-hot's 1.0); ``top_alternatives`` k > 0 the warped
    distribution's k most likely tokens at each position (the function ``top_alternatives``)."""

    params: SamplingParams = GREEDY
    seed: int | None = None
    return_probs: bool = False
    top_alternatives: int = 0

    def __post_init__(self) -> None:
        if self.top_alternatives < 0 or (self.top_alternatives and not self.return_probs):
            raise ValueError("top_alternatives must be >= 0, and > 0 only with return_probs")

    @property
    def plain(self) -> bool:
        """Greedy with nothing more to report: the row takes the engine's argmax path and nothing else."""
        return self.params.greedy and not self.return_probs


PLAIN = DraftSampling()


def top_alternatives(probs: torch.Tensor, logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` most likely tokens of one warped distribution ``probs`` [V] and their probabilities, most likely
    first. Tokens of equal probability -- notably the zero-probability ones: every token but the argmax when
    greedy, those top-k or top-p cut -- come in the order of their ``logits``, so the list says which tokens the
    draft ranks next even where the warp gives them nothing."""
    floor = probs.topk(k).values[-1]
    above = (probs > floor).nonzero().squeeze(-1)  # fewer than k
    at_floor = logits.float().masked_fill(probs != floor, float("-inf")).topk(k - above.numel()).indices
    ids = torch.cat([above, at_floor])
    ids = ids[torch.sort(logits[ids], descending=True, stable=True).indices]  # ties in probability: by logit
    ids = ids[torch.sort(probs[ids], descending=True, stable=True).indices]
    return ids.tolist(), probs[ids].tolist()


class RowSampler:
    """A row's ``DraftSampling`` at work: its generator and what it has recorded so far."""

    def __init__(self, settings: DraftSampling, device: torch.device):
        self.settings = settings
        self.generator: torch.Generator | None = None
        if not settings.params.greedy:
            self.generator = torch.Generator(device=device)
            if settings.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(settings.seed)
        self.probs: list[float] = []
        self.alternative_ids: list[list[int]] = []
        self.alternative_probs: list[list[float]] = []

    def pick(self, logits: torch.Tensor, greedy_token: int) -> int:
        """The row's token from its next-token ``logits`` [V] (``greedy_token`` is their argmax), recorded."""
        s = self.settings
        if s.params.greedy and not s.top_alternatives:
            self.probs.append(1.0)  # one-hot: no need to build it
            return greedy_token
        probs = warp_probs(logits, s.params)  # [V]
        token = greedy_token if self.generator is None else int(sample_from(probs, self.generator))
        if s.return_probs:
            self.probs.append(float(probs[token]))
        if s.top_alternatives:
            ids, values = top_alternatives(probs, logits, s.top_alternatives)
            self.alternative_ids.append(ids)
            self.alternative_probs.append(values)
        return token

    def report(self) -> dict:
        """The ``Generation`` fields this row fills, copies of what it has recorded so far."""
        s = self.settings
        return {"probs": list(self.probs) if s.return_probs else None,
                "alternative_ids": list(self.alternative_ids) if s.top_alternatives else None,
                "alternative_probs": list(self.alternative_probs) if s.top_alternatives else None}


def top_logprobs_of(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The ``k`` most likely ids of each row of ``logits`` [n, V] and their float32 log-softmax values."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return ids.tolist(), values.tolist()


# ---------------------------------------------------------------------------------------------- helpers

@functools.lru_cache(maxsize=None)
def _cache_arg(model_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """transformers renamed ``past_key_values`` to ``cache``; pass whichever this model's forward takes."""
    return {_cache_arg(type(model)): cache}


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: str | torch.device = "cpu"):
    """[B, T] ids and mask with every sequence right-aligned (left padding)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every sequence needs at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def eos_token_ids(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def pad_token_id(model) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None) or model.config.pad_token_id
    if pad is None:
        pad = next(iter(eos_token_ids(model)), 0)
    return int(pad)


def _device(model) -> torch.device:
    return next(model.parameters()).device


# ------------------------------------------------------------------------------- dynamic-cache engine

@dataclass
class DecodeState:
    """What one batch carries between steps: the cache, the 2-D mask and each row's next position."""

    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T] 1 = real token, 0 = left padding
    next_position: torch.Tensor  # [B] position id of the next token fed for each row
    rows: list[int] = field(default_factory=list)  # index of each live row in the caller's list


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
    """Run the prompts; return each row's first greedy token and the state to continue from."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask), use_cache=True, logits_to_keep=1,
                **cache_kwargs(model, cache))
    next_token = out.logits[:, -1, :].argmax(-1)  # [B]
    state = DecodeState(cache=cache, attention_mask=attention_mask,
                        next_position=attention_mask.sum(-1), rows=list(range(input_ids.shape[0])))
    return next_token, state


@torch.inference_mode()
def decode_step(model, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Feed one token per row ([B]); return the next greedy token per row ([B])."""
    state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones((token.shape[0], 1))], -1)
    out = model(input_ids=token[:, None], attention_mask=state.attention_mask,
                position_ids=state.next_position[:, None], use_cache=True, **cache_kwargs(model, state.cache))
    state.next_position = state.next_position + 1
    return out.logits[:, -1, :].argmax(-1)


def keep_rows(state: DecodeState, keep: torch.Tensor) -> None:
    """Drop finished rows from the batch (cache, mask and positions), and trim all-padding columns."""
    state.cache.batch_select_indices(keep)
    state.attention_mask = state.attention_mask[keep]
    state.next_position = state.next_position[keep]
    state.rows = [state.rows[i] for i in keep.tolist()]
    # Columns that are padding for every remaining row carry no information: cut them from the front.
    live = state.attention_mask.any(0).nonzero()
    first = int(live[0]) if live.numel() else 0
    if first > 0:
        state.attention_mask = state.attention_mask[:, first:]
        _crop_left(state.cache, first)


def _crop_left(cache: DynamicCache, n: int) -> None:
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, n:, :]
        layer.values = layer.values[:, :, n:, :]


@torch.inference_mode()
def _greedy_dynamic(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: set[int]) -> list[Generation]:
    """One left-padded batch over a DynamicCache; finished rows leave the batch."""
    device = _device(model)
    ids, mask = left_pad(prompts, pad_token_id(model), device)
    token, state = prefill(model, ids, mask)
    results: list[list[int]] = [[] for _ in prompts]
    finish: list[str] = ["length"] * len(prompts)
    while True:
        done = []
        for i, (row, tok) in enumerate(zip(state.rows, token.tolist())):
            results[row].append(tok)
            if tok in eos:
                finish[row] = "eos"
                done.append(i)
            elif len(results[row]) >= max_new_tokens:
                done.append(i)
        if len(done) == len(state.rows):
            break
        if done:
            gone = set(done)
            keep = torch.tensor([i for i in range(len(state.rows)) if i not in gone], device=device)
            token = token[keep]
            keep_rows(state, keep)
        token = decode_step(model, token, state)
    return [Generation(tokens=r, finish_reason=f) for r, f in zip(results, finish)]


# ------------------------------------------------------------------------------------ static slot cache

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

    def nbytes(self) -> int:
        return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.is_initialized)


def supports_slot_cache(model) -> bool:
    """The slot engine passes its own 4-D masks, so every layer must be plain full attention via sdpa or eager."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
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
                 pad_id: int | None = None, lean: bool = True, row_attention: bool = False, top_logprobs: int = 0):
        self.model, self.max_new_tokens, self.eos = model, max_new_tokens, eos
        # k > 0: each row also keeps the target's k most likely tokens and log-probabilities at every position it
        # generates (the distribution traces store for distillation); computed from the logits the argmax uses
        self.top_k = top_logprobs
        # decode steps through the written-out forward (bit-identical logits, less overhead) where it applies
        self.lean = lean_forward(model) if lean else None
        # attention row by row on each row's own columns, as alone (CPU attention rounds differently with other
        # rows' columns beside a row's keys); one call per row, so only where exactness is promised (the server)
        self.row_attention = row_attention
        self.device = _device(model)
        self.pad_id = pad_token_id(model) if pad_id is None else pad_id
        self.eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
        self.dtype = next(model.parameters()).dtype
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
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

    @property
    def free(self) -> int:
        return self.slots - self.n - (self.chunked is not None)

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
        ids, mask = left_pad(prompts, self.pad_id, self.device)  # [m, W]
        width = ids.shape[1]
        if width + self.max_new_tokens - 1 > self.capacity:
            raise ValueError(f"admit: prompt of {width} tokens needs a capacity of "
                             f"{width + self.max_new_tokens - 1} > {self.capacity}")
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
        time). Its last piece makes the row live, as ``admit`` does (with ``sampling``), and returns it if it
        already finished."""
        total, end = len(prompt), min(start + size, len(prompt))
        if start == 0:
            if self.chunked is not None:
                raise ValueError("prefill_chunk: another prompt is being prefilled in pieces")
            if self.free < 1:
                raise ValueError("prefill_chunk: no free slot")
            if total + self.max_new_tokens - 1 > self.capacity:
                raise ValueError(f"prefill_chunk: prompt of {total} tokens needs a capacity of "
                                 f"{total + self.max_new_tokens - 1} > {self.capacity}")
            self.chunked = (index, self.slots - 1)
        elif self.chunked is None or self.chunked[0] != index:
            raise ValueError(f"prefill_chunk: prompt {index} is not the one being prefilled in pieces")
        if not start < end:
            raise ValueError(f"prefill_chunk: empty piece [{start}, {end}) of a {total}-token prompt")
        slot = self.chunked[1]
        positions = torch.arange(start, end, device=self.device)[None]  # [1, size]
        allowed = self.columns[:end][None, :] <= positions[0, :, None]  # [size, end]: earlier columns and causal
        self.cache.plan_extend(slot, start)
        out = self.model(input_ids=torch.tensor([list(prompt[start:end])], device=self.device),
                         attention_mask=self._mask(allowed[None, None]), position_ids=positions, use_cache=True,
                         logits_to_keep=1, **cache_kwargs(self.model, self.cache))
        self.cache.end_forward()
        if end < total:
            return []
        self.chunked = None
        r = self.n
        if slot != r:
            self.cache.move_rows([slot], [r], total)
        samplers = self._samplers(None if sampling is None else [sampling], 1)
        first = self._pick(out.logits[:, -1, :], samplers)  # [1]
        self.start[r], self.end[r], self.position[r], self.last[r] = 0, total, total, first[0]
        self.index.append(index)
        self.tokens.append([])
        self.tops.append(([], []))
        self.samplers.extend(samplers)
        self.n += 1
        return self._record(first.tolist(), [r], self._tops(out.logits[:, -1, :]))

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
        if sampling is None:
            return [None] * m
        if len(sampling) != m:
            raise ValueError(f"{m} prompts but {len(sampling)} sampling settings")
        return [None if s.plain else RowSampler(s, self.device) for s in sampling]

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
            if tok in self.eos:
                reason = "eos"
            elif len(toks) >= self.max_new_tokens:
                reason = "length"
            else:
                continue
            top_ids, top_lps = self.tops[row] if tops is not None else (None, None)
            sampler = self.samplers[row]
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


@torch.inference_mode()
def iter_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                batch_size: int | None = None, eos_ids: Iterable[int] | None = None, stop_at_eos: bool = True,
                order: Sequence[int] | None = None, kv_cache: KVCache = "auto", refill_min: int = 1,
                prefill_tokens: int = DEFAULT_PREFILL_TOKENS, max_padding: float = DEFAULT_MAX_PADDING,
                lean: bool = True, exact_rows: bool = False, top_logprobs: int = 0) -> Iterator[tuple[int, Generation]]:
    """Greedy continuation of every prompt, yielded as ``(index, Generation)`` the moment a row finishes.

    At most ``batch_size`` rows decode together (all prompts when None). Prompts enter in ``order``
    (default: as given; sort by length to keep prefill padding small). With the slot engine a finished
    row's slot is refilled from the waiting prompts (once ``refill_min`` slots are free); prompts are
    prefilled in left-padded groups of at most ``prefill_tokens`` tokens with at most ``max_padding`` of
    them padding (see ``prefill_group``). The dynamic engine decodes consecutive groups of ``batch_size``
    instead. ``lean`` lets the slot engine's decode steps run ``lean.LeanForward`` where the model allows it
    (same logits, less overhead; False: always the model's own forward). ``exact_rows`` makes every row get
    the logits it gets alone, bit for bit, on the lean path with int4 weights: prompts of different lengths are
    prefilled apart (``max_padding`` 0) and decode steps attend row by row (one attention call per row).
    ``top_logprobs`` k > 0 adds the k most likely tokens and their log-probabilities at every generated position
    to each Generation (slot engine only).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    n = len(prompts)
    if n == 0:
        return
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    order = list(range(n)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError("order must be a permutation of the prompt indices")
    batch_size = n if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    eos = set(eos_token_ids(model) if eos_ids is None else eos_ids) if stop_at_eos else set()
    if kv_cache == "auto":
        kv_cache = "static" if supports_slot_cache(model) else "dynamic"
    if kv_cache == "dynamic":
        if top_logprobs:
            raise ValueError("top_logprobs needs the slot engine (models with full attention in every layer)")
        for s in range(0, n, batch_size):
            group = order[s:s + batch_size]
            yield from zip(group, _greedy_dynamic(model, [prompts[i] for i in group], max_new_tokens, eos))
        return
    if kv_cache != "static":
        raise ValueError(f"kv_cache must be auto, static or dynamic, not {kv_cache!r}")
    slots = min(batch_size, n)
    capacity = max(len(p) for p in prompts) + max_new_tokens
    if exact_rows:
        max_padding = 0.0
    decoder = SlotDecoder(model, slots, capacity, max_new_tokens, eos, lean=lean, row_attention=exact_rows,
                          top_logprobs=top_logprobs)
    waiting = deque(order)
    refill_min = max(1, min(refill_min, slots))
    while waiting or decoder.n:
        if waiting and (decoder.free >= refill_min or decoder.n == 0):
            group = prefill_group(waiting, [len(p) for p in prompts], decoder.free, prefill_tokens, max_padding)
            yield from decoder.admit(group, [prompts[i] for i in group])
            continue  # admit again while slots are free (a group may have been cut short)
        yield from decoder.step()


def prefill_group(waiting: deque, lengths: Sequence[int], free: int, max_tokens: int,
                  max_padding: float) -> list[int]:
    """Take the next prompts off ``waiting`` for one left-padded prefill forward: at most ``free`` of them,
    at most ``max_tokens`` tokens with padding, and padding at most ``max_padding`` of the group's tokens
    (on a CPU a padding token costs as much as a real one, while one more forward costs only a few)."""
    group = [waiting.popleft()]
    width, real = lengths[group[0]], lengths[group[0]]
    while waiting and len(group) < free:
        nxt = lengths[waiting[0]]
        w, n = max(width, nxt), len(group) + 1
        if w * n > max_tokens or w * n - (real + nxt) > max_padding * w * n:
            break
        group.append(waiting.popleft())
        width, real = w, real + nxt
    return group


@torch.inference_mode()
def greedy_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  eos_ids: Iterable[int] | None = None, stop_at_eos: bool = True, *,
                  batch_size: int | None = None, kv_cache: KVCache = "auto", lean: bool = True,
                  exact_rows: bool = False) -> list[Generation]:
    """Greedy continuation of every prompt, stopping per row at EOS or the limit; results in input order.

    All prompts decode as one batch unless ``batch_size`` is given (then the batch is refilled as rows
    finish). Finished rows leave the batch, so the remaining rows do not pay for them.
    """
    results: list[Generation | None] = [None] * len(prompts)
    for i, gen in iter_greedy(model, prompts, max_new_tokens, batch_size=batch_size, eos_ids=eos_ids,
                              stop_at_eos=stop_at_eos, kv_cache=kv_cache, lean=lean, exact_rows=exact_rows):
        results[i] = gen
    return results  # type: ignore[return-value]


@torch.inference_mode()
def draft_batch(model, contexts: Sequence[Sequence[int]], num_tokens: int, lean: bool = True) -> list[list[int]]:
    """Exactly ``num_tokens`` greedy tokens per context (no EOS stop): what the draft server returns.

    Each row gets exactly what it gets alone (``exact_rows``; int4 weights on the lean path): contexts of
    different lengths are prefilled apart and decode steps attend row by row."""
    return [g.tokens for g in greedy_decode(model, contexts, num_tokens, stop_at_eos=False, lean=lean,
                                            exact_rows=True)]


@torch.inference_mode()
def draft_rows(model, contexts: Sequence[Sequence[int]], num_tokens: int, sampling: Sequence[DraftSampling],
               lean: bool = True) -> list[Generation]:
    """``num_tokens`` draft tokens per context, each row as its ``sampling`` says (with its probabilities when
    asked): ``draft_batch`` with per-row settings. Exact rows, as the server's lanes: every row gets what it
    gets alone, a seeded sampled row included."""
    if len(sampling) != len(contexts):
        raise ValueError(f"{len(contexts)} contexts but {len(sampling)} sampling settings")
    if not contexts:
        return []
    decoder = SlotDecoder(model, len(contexts), max(map(len, contexts)) + num_tokens, num_tokens, eos=set(),
                          lean=lean, row_attention=True)
    lengths = [len(c) for c in contexts]
    waiting = deque(range(len(contexts)))
    results: dict[int, Generation] = {}
    while waiting:  # one slot per context: admission never waits for a step
        group = prefill_group(waiting, lengths, decoder.free, DEFAULT_PREFILL_TOKENS, 0.0)
        results.update(decoder.admit(group, [contexts[i] for i in group], [sampling[i] for i in group]))
    while decoder.n:
        results.update(decoder.step())
    return [results[i] for i in range(len(contexts))]


@torch.inference_mode()
def naive_draft(model, prompt: Sequence[int], num_tokens: int, sampling: DraftSampling) -> Generation:
    """Reference for ``draft_rows``: one row, no cache, the full sequence recomputed every step; each token the
    argmax or drawn from ``warp_probs`` of the last position's logits with a generator seeded as the row's."""
    device = _device(model)
    generator = RowSampler(sampling, device).generator  # None when greedy
    seq, out, probs = list(prompt), [], []
    for _ in range(num_tokens):
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1]
        warped = warp_probs(logits, sampling.params)
        tok = int(logits.argmax()) if generator is None else int(sample_from(warped, generator))
        out.append(tok)
        probs.append(float(warped[tok]))
        seq.append(tok)
    return Generation(out, "length", probs=probs)


@torch.inference_mode()
def naive_greedy(model, prompt: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int] | None = None,
                 stop_at_eos: bool = True) -> Generation:
    """Reference decoder: one row, no cache, no padding; the full sequence is recomputed every step."""
    device = _device(model)
    eos = set(eos_token_ids(model) if eos_ids is None else eos_ids) if stop_at_eos else set()
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in eos:
            return Generation(out, "eos")
    return Generation(out, "length")


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of a DynamicCache (``crop(-n)`` removes n in every version)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def extend(model, ids: Sequence[int], cache, start: int, logits_to_keep: int = 0):
    """Batch-1 forward of ``ids`` at positions start.. on top of ``cache`` (which holds positions < start)."""
    device = next(model.parameters()).device
    n = len(ids)
    return model(input_ids=torch.tensor([list(ids)], device=device),
                 attention_mask=torch.ones((1, start + n), dtype=torch.long, device=device),
                 position_ids=torch.arange(start, start + n, device=device)[None],
                 use_cache=True, logits_to_keep=logits_to_keep, **cache_kwargs(model, cache)).logits
