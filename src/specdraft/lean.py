"""The decode hot path of a Llama-family model (Llama, Qwen2, Qwen3), written out like gpt-fast.

``LeanForward`` runs a model's own modules' tensors through the same operations in the same order as
transformers' forward -- its rotary embedding, ``apply_rotary_pos_emb`` and ``sdpa_attention_forward``, RMSNorm
as transformers writes it, the same cache ``update`` -- so its logits are bit-identical to ``model(...)``
(tested), minus the per-call machinery around them (module and decorator wrappers, mask preparation, one bf16
cast per linear). Two changes leave every value as it was: an input is cast to bf16 once for all the int4
linears that read it, and the int4 q/k/v projections run as one kernel call on their concatenated codes where a
probe shows the concatenation computes the same (the kernel packs rows in blocks).

It runs decode steps and short cache extensions (``decode.SlotDecoder.step``, ``speculate.CachedDraftModel``);
prefills keep the model's own forward (the dense bf16 path of int4 layers). On the 24-layer 576-wide int4
draft (1 thread) a speculative draft step takes 26.7 ms instead of 31.8 ms; the server's 16-token drafts gain
less (p50 472 vs 488 ms), their steps being a smaller share (BENCHMARKS.md). ``lean_unsupported(model)`` says
why a model cannot take it; callers then use ``model(...)``.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Any, Callable

import torch
from torch import nn

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


class _Int4Call:
    """Int4 linears that read the same input (one group size, a bias on all or none) as one
    ``_weight_int4pack_mm_for_cpu`` call on their concatenated codes. Always the codes, whatever the
    module's prefill phase says: this path runs decode steps and short extensions only."""

    def __init__(self, modules: list[nn.Module]):
        self.sizes = [m.out_features for m in modules]
        self.group_size = modules[0].group_size
        # [N, K/2] and [K/G, N, 2]: rows of every module in turn (one module: its own tensors, no copy)
        self.packed = modules[0].packed if len(modules) == 1 else torch.cat([m.packed for m in modules], 0)
        self.scales_and_zeros = (modules[0].scales_and_zeros if len(modules) == 1
                                 else torch.cat([m.scales_and_zeros for m in modules], 1))
        biases = [m.bias for m in modules]
        self.bias = None if biases[0] is None else torch.cat(biases)

    @staticmethod
    def can_fuse(modules: list[nn.Module]) -> bool:
        from .server.engine import Int4Linear

        return (all(isinstance(m, Int4Linear) and not m.rescore_top_k for m in modules)
                and len({m.group_size for m in modules}) == 1
                and len({m.bias is None for m in modules}) == 1)

    def matches(self, modules: list[nn.Module]) -> bool:
        """Whether the concatenated codes compute what the modules do one by one. The kernel packs rows in
        blocks (64 in torch 2.13), so concatenation holds only when the earlier modules end on a block
        boundary; a probe input checks it instead of assuming a layout."""
        x = torch.randn(2, self.packed.shape[1] * 2, generator=torch.Generator().manual_seed(0))
        x = x.to(torch.bfloat16)
        one_by_one = [torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, m.group_size, m.scales_and_zeros)
                      for m in modules]
        return torch.equal(torch.cat(one_by_one, -1), torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.packed,
                                                       self.group_size, self.scales_and_zeros).to(x.dtype)
        y = y.reshape(*lead, y.shape[-1])
        parts = list(y.split(self.sizes, -1)) if len(self.sizes) > 1 else [y]
        if self.bias is not None:  # Int4Linear adds its bias after the cast, in x's dtype
            parts = [p + b.to(x.dtype) for p, b in zip(parts, self.bias.split(self.sizes))]
        return parts


class _Projections:
    """Linear layers that read the same input: one fused int4 call when they allow it, else one call each
    (an int4 one still on its codes; any other linear as its module)."""

    def __init__(self, modules: list[nn.Module]):
        fused = _Int4Call(modules) if len(modules) > 1 and _Int4Call.can_fuse(modules) else None
        if fused is not None and fused.matches(modules):
            self.calls: list[Callable] = [fused]
        else:
            self.calls = [_Int4Call([m]) if _Int4Call.can_fuse([m]) else (lambda x, m=m: [m(x)]) for m in modules]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [y for call in self.calls for y in call(x)]


class _Layer:
    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn = attn  # sdpa_attention_forward reads num_key_value_groups / is_causal from it
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3: RMSNorm over each head's dims
        self.k_norm = getattr(attn, "k_norm", None)
        self.qkv = _Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _Projections([attn.o_proj])
        # q/k/v fused: 63 vs 89 us per layer at 576 -> 576 + 192 + 192 (packF3L, 1 thread, one microbenchmark);
        # gate/up fused measured no faster (151 vs 154 us), so they keep their own codes (fusing copies them)
        self.gate, self.up = _Projections([mlp.gate_proj]), _Projections([mlp.up_proj])
        self.down = _Projections([mlp.down_proj])
        self.act = mlp.act_fn
        self.head_dim = attn.head_dim


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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
        x = self.embed(input_ids)  # [B, T, D]
        cos, sin = self.rotary(x, position_ids=position_ids)
        b, t = input_ids.shape
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.ln1, layer.eps1)
            x = x + self._attention(layer, i, h, cos, sin, mask, cache, b, t, key_ranges)
            h = _rms_norm(x, layer.ln2, layer.eps2)
            (gate,), (up,) = layer.gate(h), layer.up(h)
            (down,) = layer.down(layer.act(gate) * up)
            x = x + down
        x = _rms_norm(x, self.norm, self.norm_eps)
        return self.head(x[:, -logits_to_keep:] if logits_to_keep else x)

    def _attention(self, layer: _Layer, index: int, h: torch.Tensor, cos, sin, mask, cache, b: int, t: int,
                   key_ranges: list[tuple[int, int]] | None):
        shape = (b, t, -1, layer.head_dim)
        q, k, v = layer.qkv(h)
        q, k = q.view(shape), k.view(shape)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(shape).transpose(1, 2)
        q, k = self.apply_rotary(q, k, cos, sin)
        k, v = cache.update(k, v, index)
        if key_ranges is None:
            out, _ = self.attention(layer.attn, q, k, v, mask, dropout=0.0, scaling=layer.attn.scaling)
        else:
            out = torch.cat([self.attention(layer.attn, q[r:r + 1], k[r:r + 1, :, lo:hi], v[r:r + 1, :, lo:hi],
                                            None if mask is None else mask[r:r + 1, ..., lo:hi], dropout=0.0,
                                            scaling=layer.attn.scaling)[0]
                             for r, (lo, hi) in enumerate(key_ranges)])
        (o,) = layer.o(out.reshape(b, t, -1).contiguous())
        return o


_BUILT: "weakref.WeakKeyDictionary[nn.Module, tuple[list[weakref.ref], LeanForward | None]]" = \
    weakref.WeakKeyDictionary()


def lean_forward(model: nn.Module) -> LeanForward | None:
    """The model's ``LeanForward`` (None when ``lean_unsupported``), built once and rebuilt when any of its
    modules has been swapped since (``server.engine.apply_compute`` replaces linears)."""
    modules = list(model.modules())
    built = _BUILT.get(model)
    if built is not None and len(built[0]) == len(modules) and all(r() is m for r, m in zip(built[0], modules)):
        return built[1]
    lean = None if lean_unsupported(model) else LeanForward(model)
    _BUILT[model] = ([weakref.ref(m) for m in modules], lean)
    return lean
