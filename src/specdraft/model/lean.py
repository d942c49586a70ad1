"""The decode hot path of a Llama-family model (Llama, Qwen2, Qwen3), written out like gpt-fast.

``LeanForward`` runs a model's own modules' tensors through the same operations in the same order as
transformers' forward -- its rotary embedding, ``apply_rotary_pos_emb`` and ``sdpa_attention_forward``, RMSNorm
as transformers writes it, the same cache ``update`` -- so its logits are bit-identical to ``model(...)``
(tested), minus the per-call machinery around them (module and decorator wrappers, mask preparation, one bf16
cast per linear). One change leaves every value as it was: the int4 q/k/v projections run as one kernel call
(one bf16 cast of their input) on their concatenated codes where a probe shows the concatenation computes the
same (the kernel packs rows in blocks).

It runs decode steps and short cache extensions (``slot_engine.SlotDecoder.step``,
``drafting.cached.CachedDraftModel``); prefills keep the model's own forward (the dense bf16 path of int4
layers). ``lean_unsupported(model)`` says why a model cannot take it; callers then use ``model(...)``.
``CompiledSteps`` runs its one-token steps through ``torch.compile`` for callers whose every output is verified
anyway.
"""

from __future__ import annotations

import copy
import importlib
import logging
import time
import weakref
from typing import Any, Callable

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdraft.quant.linear import Int4Linear

log = logging.getLogger(__name__)


LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def lean_unsupported(model: nn.Module) -> str | None:
    """Why ``LeanForward`` cannot run this model (None when it can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model type {model_type!r} (lean forward: {LEAN_MODEL_TYPES})"
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (lean forward: sdpa)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (lean forward: silu)"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        return "sliding-window layers"
    if model.training:
        return "the model is in training mode"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder-only model with embed_tokens / layers / norm / rotary_emb"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(
                hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")):
            return "a layer without the Llama attention projections"
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            return "a layer without the gated MLP"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm / Qwen3RMSNorm, op for op (the variance in float32, the weight applied in x's dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _int4_matmul(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor,
                 sizes: tuple[int, ...], bias: torch.Tensor | None) -> list[torch.Tensor]:
    """``_weight_int4pack_mm_for_cpu`` over x's last dim, split into the outputs of the linears whose codes
    ``packed`` concatenates; Int4Linear's arithmetic (bf16 input, output cast back, bias added after)."""
    lead = x.shape[:-1]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), packed,
                                                   group_size, scales_and_zeros).to(x.dtype)
    y = y.reshape(*lead, y.shape[-1])
    parts = list(y.split(list(sizes), -1)) if len(sizes) > 1 else [y]
    if bias is not None:
        parts = [p + b.to(x.dtype) for p, b in zip(parts, bias.split(list(sizes)))]
    return parts


class _Int4Call:
    """Int4 linears that read the same input (one group size, a bias on all or none) as one
    ``_weight_int4pack_mm_for_cpu`` call on their concatenated codes. Always the codes, whatever the
    module's prefill phase says: this path runs decode steps and short extensions only."""

    def __init__(self, modules: list[nn.Module]):
        sizes = tuple(m.out_features for m in modules)
        # [N, K/2] and [K/G, N, 2]: rows of every module in turn (one module: its own tensors, no copy)
        packed = modules[0].packed if len(modules) == 1 else torch.cat([m.packed for m in modules], 0)
        scales_and_zeros = (modules[0].scales_and_zeros if len(modules) == 1
                            else torch.cat([m.scales_and_zeros for m in modules], 1))
        biases = [m.bias for m in modules]
        bias = None if biases[0] is None else torch.cat(biases)
        # the arguments of _int4_matmul after x
        self.args = (packed, modules[0].group_size, scales_and_zeros, sizes, bias)

    @staticmethod
    def can_fuse(modules: list[nn.Module]) -> bool:
        return (all(isinstance(m, Int4Linear) and not m.rescore_top_k for m in modules)
                and len({m.group_size for m in modules}) == 1
                and len({m.bias is None for m in modules}) == 1)

    def matches(self, modules: list[nn.Module]) -> bool:
        """Whether the concatenated codes compute what the modules do one by one. The kernel packs rows in
        blocks (64 in torch 2.13), so concatenation holds only when the earlier modules end on a block
        boundary; a probe input checks it instead of assuming a layout."""
        packed, group_size, scales_and_zeros = self.args[:3]
        x = torch.randn(2, packed.shape[1] * 2, generator=torch.Generator().manual_seed(0))
        x = x.to(torch.bfloat16)
        one_by_one = [torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, m.group_size, m.scales_and_zeros)
                      for m in modules]
        return torch.equal(torch.cat(one_by_one, -1), torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, group_size, scales_and_zeros))


def _projection_calls(modules: list[nn.Module]) -> tuple:
    """Linear layers that read the same input, as data for ``_project``: one fused int4 call when they allow
    it, else one call each (an int4 one still on its codes, as ``_int4_matmul`` arguments; any other linear as
    its module)."""
    fused = _Int4Call(modules) if len(modules) > 1 and _Int4Call.can_fuse(modules) else None
    if fused is not None and fused.matches(modules):
        return (fused.args,)
    return tuple(_Int4Call([m]).args if _Int4Call.can_fuse([m]) else m for m in modules)


def _project(x: torch.Tensor, calls: tuple) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for call in calls:
        if isinstance(call, nn.Module):
            out.append(call(x))
        else:
            out.extend(_int4_matmul(x, *call))
    return out


class _Layer:
    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn  # sdpa_attention_forward reads num_key_value_groups / is_causal from it
        # Qwen3: RMSNorm over each head's dims
        qk_norms = (None if getattr(attn, "q_norm", None) is None else
                    (attn.q_norm.weight, attn.q_norm.variance_epsilon,
                     attn.k_norm.weight, attn.k_norm.variance_epsilon))
        # q/k/v fused: 63 vs 89 us per layer at 576 -> 576 + 192 + 192 (packF3L, 1 thread, one microbenchmark);
        # gate/up fused were no faster, so they keep their own codes (fusing would copy them)
        self.qkv = _projection_calls([attn.q_proj, attn.k_proj, attn.v_proj])
        o, gate, up, down = (_projection_calls([m]) for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        # the arguments of _pre_attention / _post_attention after the activations
        self.pre_args = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, self.qkv, qk_norms,
                         attn.head_dim)
        self.post_args = (o, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                          gate, up, down)


def _pre_attention(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rotary: Callable,
                   ln: torch.Tensor, eps: float, qkv: tuple, qk_norms: tuple | None, head_dim: int):
    """Input norm, q/k/v projections, (Qwen3) per-head norms, rotary: [B, heads, T, head_dim] q, k, v."""
    b, t = x.shape[:2]
    shape = (b, t, -1, head_dim)
    q, k, v = _project(_rms_norm(x, ln, eps), qkv)
    q, k = q.view(shape), k.view(shape)
    if qk_norms is not None:
        q, k = _rms_norm(q, qk_norms[0], qk_norms[1]), _rms_norm(k, qk_norms[2], qk_norms[3])
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(shape).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    return q, k, v


def _post_attention(x: torch.Tensor, attended: torch.Tensor, o: tuple, ln: torch.Tensor, eps: float,
                    gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """Output projection and residual, post-attention norm, SiLU-gated MLP and residual."""
    b, t = x.shape[:2]
    (out,) = _project(attended.reshape(b, t, -1).contiguous(), o)
    x = x + out
    h = _rms_norm(x, ln, eps)
    (g,), (u,) = _project(h, gate), _project(h, up)
    (d,) = _project(nn.functional.silu(g) * u, down)
    return x + d


class LeanForward:
    """``logits = LeanForward(model)(input_ids, position_ids, mask, cache, logits_to_keep)``.

    ``mask`` is what transformers' sdpa attention would receive: a boolean [B, 1, T, K] (True = attend), or
    None when every row attends to all its keys (one new token per row, no padding). ``cache`` is any
    transformers ``Cache`` (``update(k, v, layer_idx)`` returns the keys and values to attend to).

    ``key_ranges`` (one ``(start, stop)`` per row) runs attention row by row on that row's own key columns:
    the CPU flash-attention kernel's result depends on where a row's keys sit among padding columns (it
    accumulates keys in blocks), so only this gives a row in a padded batch exactly what it gets alone.
    """

    def __init__(self, model: nn.Module):
        reason = lean_unsupported(model)
        if reason:
            raise ValueError(f"lean forward: {reason}")
        module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)

        self.apply_rotary: Callable = module.apply_rotary_pos_emb
        self.attention: Callable = sdpa_attention_forward
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.head = model.get_output_embeddings()
        self.layers = [_Layer(layer) for layer in inner.layers]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 cache: Any, logits_to_keep: int = 1,
                 key_ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        return self.forward(input_ids, position_ids, mask, cache, logits_to_keep, key_ranges)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                cache: Any, logits_to_keep: int = 1,
                key_ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        x = self.embed(input_ids)  # [B, T, D]
        cos, sin = self.rotary(x, position_ids=position_ids)
        for i, layer in enumerate(self.layers):
            q, k, v = _pre_attention(x, cos, sin, self.apply_rotary, *layer.pre_args)
            k, v = cache.update(k, v, i)
            x = _post_attention(x, self._attend(layer, q, k, v, mask, key_ranges), *layer.post_args)
        x = _rms_norm(x, self.norm, self.norm_eps)
        return self.head(x[:, -logits_to_keep:] if logits_to_keep else x)

    def _attend(self, layer: _Layer, q, k, v, mask, key_ranges: list[tuple[int, int]] | None) -> torch.Tensor:
        if key_ranges is None:
            return self.attention(layer.attn, q, k, v, mask, dropout=0.0, scaling=layer.attn.scaling)[0]
        return torch.cat([self.attention(layer.attn, q[r:r + 1], k[r:r + 1, :, lo:hi], v[r:r + 1, :, lo:hi],
                                         None if mask is None else mask[r:r + 1, ..., lo:hi], dropout=0.0,
                                         scaling=layer.attn.scaling)[0]
                          for r, (lo, hi) in enumerate(key_ranges)])


def _mark_length_dynamic(layers) -> None:
    """Cache tensors are [B, kv heads, length, head dim]: with the length dynamic one graph serves them all."""
    for layer in layers:
        torch._dynamo.mark_dynamic(layer.keys, 2)
        torch._dynamo.mark_dynamic(layer.values, 2)


class CompiledSteps:
    """A ``LeanForward`` whose decode steps (one new token, no mask: the speculative draft's hot path) run
    through ``torch.compile``; anything else (catch-ups of several tokens) runs it eagerly. Called like it.

    Inductor fuses the norms, rotary, casts and residuals of all layers into a few C++ loops and calls the
    int4 kernel as it is, which takes the per-step work outside the kernel down. The KV
    cache's length is marked dynamic, so one graph serves every length; a second one serves a cache whose
    tensors ``crop`` left as views (their strides differ). Both are compiled at the first step (the second on
    a scratch copy of the cache): minutes with an empty inductor cache, seconds with a warm one.

    The logits are not bit-identical to the eager forward (fused reductions round differently; greedy
    tokens rarely change), so only callers whose output is checked anyway use it: a speculative draft,
    whose every token the target verifies -- not the server, which promises each row of a batch exactly
    what it gets alone. If compiling fails (no C++ compiler, say), the error is logged and kept in ``error``
    and every step runs eagerly from then on: slower, the same tokens.
    """

    def __init__(self, lean: LeanForward):
        self.lean = lean
        self._step: Callable | None = torch.compile(lean.forward)
        self.error: str | None = None
        self.calls = {"compiled": 0, "eager": 0}

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
                 cache: Any, logits_to_keep: int = 1) -> torch.Tensor:
        layers = getattr(cache, "layers", None)
        if (self._step is None or input_ids.shape[1] != 1 or mask is not None or not layers
                or any(getattr(layer, "keys", None) is None for layer in layers)):
            self.calls["eager"] += 1
            return self.lean.forward(input_ids, position_ids, mask, cache, logits_to_keep)
        _mark_length_dynamic(layers)
        saved = [(layer.keys, layer.values) for layer in layers]  # update() replaces them (a cat), never writes
        first = self.calls["compiled"] == 0
        if first:  # otherwise a silent minute
            log.info("compiling the draft's decode step (torch.compile; a minute or two with an empty inductor "
                     "cache, seconds with a warm one)")
        started = time.perf_counter()
        try:
            logits = self._step(input_ids, position_ids, None, cache, logits_to_keep)
            if first:
                self._compile_cropped(input_ids, position_ids, cache, logits_to_keep)
            self.calls["compiled"] += 1
            if first:
                log.info("draft decode step compiled in %.1f s", time.perf_counter() - started)
            return logits
        except Exception as e:  # a compiler failure costs speed, never the answer
            self.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:500]
            self._step = None
            log.warning("torch.compile of the draft step failed (%s); running it eagerly", self.error)
            for layer, (keys, values) in zip(layers, saved):  # undo what layers before the failure appended
                layer.keys, layer.values = keys, values
            self.calls["eager"] += 1
            return self.lean.forward(input_ids, position_ids, None, cache, logits_to_keep)

    def _compile_cropped(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                         logits_to_keep: int) -> None:
        """Compile the graph for a cropped cache now, on a scratch copy: otherwise it compiles at the first
        rejected draft, inside whatever is being timed."""
        if cache.get_seq_length() < 2:
            return
        scratch = copy.deepcopy(cache)
        scratch.crop(-2)  # leaves its tensors as views, as a rewind after a rejected draft does
        _mark_length_dynamic(scratch.layers)
        self._step(input_ids, position_ids - 1, None, scratch, logits_to_keep)


_BUILT: "weakref.WeakKeyDictionary[nn.Module, tuple[list[weakref.ref], dict[bool, Any]]]" = \
    weakref.WeakKeyDictionary()


def lean_forward(model: nn.Module, compile: bool = False) -> "LeanForward | CompiledSteps | None":
    """The model's ``LeanForward`` (``compile``: as ``CompiledSteps``; None when ``lean_unsupported``), built
    once per setting and rebuilt when any of the model's modules has been swapped since
    (``quant.linear.apply_compute`` replaces linears)."""
    modules = list(model.modules())
    built = _BUILT.get(model)
    if built is None or len(built[0]) != len(modules) or not all(r() is m for r, m in zip(built[0], modules)):
        built = ([weakref.ref(m) for m in modules], {})
        _BUILT[model] = built
    if False not in built[1]:
        built[1][False] = None if lean_unsupported(model) else LeanForward(model)
    if compile and True not in built[1]:
        built[1][True] = None if built[1][False] is None else CompiledSteps(built[1][False])
    return built[1][compile]
