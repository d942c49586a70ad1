"""The linear layers a draft computes with, and ``apply_compute``, which swaps a model's ``nn.Linear`` for them.

  float32   the weights as loaded (QD04 values dequantised to float32)
  bfloat16  ``BF16Linear``: bf16 weights, bf16 matmul, output in the input's dtype
  int4      ``Int4Linear``: the QD04 4-bit codes themselves, run by torch's CPU weight-only int4 kernel
            (``aten._weight_int4pack_mm_for_cpu``, bf16 activations) in decode steps; the prefill pass runs a
            dense bf16 copy of the same weights; a tied lm_head rescores its top candidates in float32

At batch 1 every generated token reads every weight once, so bytes per weight set the decode speed:
4 (float32) > 2 (bfloat16) > ~0.56 (int4 codes + an fp16 scale and zero per group of 64).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import nn

from specdraft.quant import q4g

log = logging.getLogger(__name__)


Compute = Literal["float32", "bfloat16", "int4"]
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
INT4_N_MULTIPLE = 16  # the CPU int4 packer needs out_features % 16 == 0
RESCORE_TOP_K = 8  # lm_head candidates recomputed in float32 (Int4Linear)
# A head the file stores raw (an f16 embedding kept on purpose) runs its candidate search on codes made at load
# at this G and rescores the top candidates from the stored rows: a quarter of the bytes of a bf16 matmul
HEAD_SEARCH_GROUP_SIZE = 32
# Longest extension of a kept cache still run on the int4 kernel (is_prefill); past this the dense bf16 GEMM wins
INT4_EXTEND_MAX_TOKENS = 16


# --------------------------------------------------------------------------------------- linear layers

class BF16Linear(nn.Module):
    """y = x W^T (+ b) with W stored in bfloat16; input cast to bf16, output cast back to x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As a 2-D [M, K] input: a 3-D bf16 input with an odd stride on a size-1 dim (the last position of a
        # longer hidden state, x[:, -1:]) sends linear to a batched matmul that copies the whole weight
        # transposed on every call (twenty times slower for the stand-in's head).
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        y = nn.functional.linear(x2, self.weight).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Phase:
    """Which pass the model is in, set by a forward pre-hook (``track_phase``): a prefill (the contexts'
    first forward) or a one-token decode step. Shared by a model's Int4Linear layers."""

    def __init__(self) -> None:
        self.prefill = True


def is_prefill(kwargs: dict) -> bool:
    """A forward is a prefill when it starts its rows at position 0 (a left-padded group of contexts, or a
    one-token context) or feeds more than ``INT4_EXTEND_MAX_TOKENS`` positions per row. Everything else --
    a decode step (one token per row at position >= 1), or a short extension of a kept cache (speculative
    decoding's catch-up after accepted tokens) -- runs on the 4-bit codes: at a few rows the int4 kernel
    reads a quarter of the bytes of the dense bf16 copy. This needs nothing from the cache, so it holds for
    every decode engine, and a row is classified the same way alone or batched."""
    pos = kwargs.get("position_ids")
    if pos is None:
        ids = kwargs.get("input_ids")
        return ids is None or ids.shape[-1] > 1
    return int(pos.min()) == 0 or pos.shape[-1] > INT4_EXTEND_MAX_TOKENS


def track_phase(model: nn.Module, phase: Phase):
    """Set ``phase.prefill`` before every forward of ``model`` (``is_prefill``)."""

    def hook(module, args, kwargs):
        phase.prefill = is_prefill(kwargs) if not args else args[0].shape[-1] > 1
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W as groupwise 4-bit codes, computed by the CPU int4 weight-only kernel.

    QD04 stores w = q * scale + min (asymmetric, q in 0..15); the kernel computes
    w = (q - 8) * scale + zero, so zero = min + 8 * scale (``q4g.int4pack_scales_and_zeros``).
    The kernel takes bf16 activations and returns bf16, so outputs carry bf16 rounding (2^-8 relative).
    With ``rescore_top_k`` (used for the lm_head) each row's k largest outputs are recomputed exactly in
    float32 from the same codes, so that the greedy argmax is the float32 one unless the true winner is
    not among the kernel's top k.

    With ``phase`` the prefill pass (many rows) runs a dense bf16 matmul on a bf16 copy of the same
    dequantised weights instead: the int4 kernel is built for few rows and is slower than a bf16 GEMM at
    hundreds of rows, while decode steps (one row per sequence) stay on the 4-bit codes. Both
    kernels compute each row independently of the others, so a row gets the same result alone or batched.
    The prefill rows are padded up to ``bucket_rows(M)``: the bf16 GEMM keeps per-shape state, and with a
    new M for every batch the server's memory would grow with the number of shapes it has seen.

    ``exact_rows``: the weight as the file stores it, when ``q`` was made from it at load (a raw f16 head):
    the rescoring then recomputes the candidates from these rows, so the top logits are the float model's
    although the codes only approximate the weight.
    """

    def __init__(self, q: q4g.QuantizedTensor, bias: torch.Tensor | None = None, rescore_top_k: int = 0,
                 phase: Phase | None = None, exact_rows: torch.Tensor | None = None):
        super().__init__()
        n, k = q.shape
        g = q.group_size
        reason = int4_unsupported(q.shape, g)
        if reason:
            raise ValueError(reason)
        self.out_features, self.in_features, self.group_size = n, k, g
        self.rescore_top_k = rescore_top_k
        codes = q4g.unpack_codes(q.codes).to(torch.int32)  # [N, K] values 0..15
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))  # [N, K/2]
        self.register_buffer("scales_and_zeros", q4g.int4pack_scales_and_zeros(q, torch.bfloat16))  # [K/G, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))
        self.phase = phase
        if phase is not None:
            self.register_buffer("dense", q4g.dequantize(q, torch.bfloat16))  # [N, K] for the prefill pass
        self.register_buffer("exact_rows", None if exact_rows is None else exact_rows.detach().clone())  # [N, K]
        if rescore_top_k and exact_rows is None:  # the QD04 parts themselves, to dequantise a few rows exactly
            self.register_buffer("q_codes", q.codes.clone())  # [N, K/2] uint8
            self.register_buffer("q_scales", q.scales.clone())  # [N, K/G] fp16
            self.register_buffer("q_mins", q.mins.clone())  # [N, K/G] fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.phase is not None and self.phase.prefill:
            m = x2.shape[0]
            xp = nn.functional.pad(x2, (0, 0, 0, bucket_rows(m) - m)).to(torch.bfloat16)  # [M', K]
            y = nn.functional.linear(xp, self.dense)[:m].to(x.dtype)  # [M, N]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, self.group_size,
                                                           self.scales_and_zeros).to(x.dtype)  # [M, N]
        if self.rescore_top_k:
            y = self._rescore(x2, y)
        y = y.reshape(*lead, self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _rescore(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        top = y.topk(self.rescore_top_k, dim=-1).indices  # [M, k]
        m, k = top.shape
        if self.exact_rows is not None:
            w = self.exact_rows[top].float()  # [M, k, K]
        else:
            codes = q4g.unpack_codes(self.q_codes[top]).float()  # [M, k, K]
            groups = codes.view(m, k, -1, self.group_size)  # [M, k, K/G, G]
            w = groups * self.q_scales[top].float().unsqueeze(-1) + self.q_mins[top].float().unsqueeze(-1)
        # a product and a row sum, not einsum: its batched matmul rounds differently for other M, and a row must
        # get the same logits alone or in a batch
        exact = (w.view(m, k, -1) * x.float().unsqueeze(1)).sum(-1)  # [M, k]
        return y.scatter(-1, top, exact.to(y.dtype))

    def weight_bytes(self) -> int:
        """Bytes the kernel reads per call: packed codes + the bf16 (scale, zero) pairs."""
        return self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


def bucket_rows(m: int) -> int:
    """m rounded up to one of four sizes per power of two (at most 25% padding): few distinct shapes."""
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - 3)  # m in [4 * step, 8 * step)
    return -(-m // step) * step


def int4_unsupported(shape: tuple[int, int], group_size: int) -> str | None:
    """Why the CPU int4 kernel cannot take this weight (None when it can)."""
    n, k = shape
    if group_size not in INT4_GROUP_SIZES:
        return f"group size {group_size} (the kernel takes {INT4_GROUP_SIZES})"
    if k % group_size:
        return f"in_features {k} is not a multiple of the group size {group_size}"
    if n % INT4_N_MULTIPLE:
        return f"out_features {n} is not a multiple of {INT4_N_MULTIPLE}"
    return None


# ------------------------------------------------------------------------------------------- swapping

def _linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _weight_name_for(model: nn.Module, linear_name: str, linear: nn.Linear) -> str:
    """The stored tensor name of a linear's weight: its own, or the input embedding's when tied."""
    emb = model.get_input_embeddings()
    if emb is not None and linear.weight is emb.weight:
        return next(n for n, p in model.named_parameters() if p is emb.weight)
    return f"{linear_name}.weight"


def apply_compute(model: nn.Module, compute: Compute, quantized: dict[str, Any] | None = None,
                  group_size: int = q4g.DEFAULT_GROUP_SIZE, dense_prefill: bool = True,
                  device: str = "cpu") -> dict[str, Any]:
    """Swap the model's nn.Linear modules for the chosen format, in place; return a summary.

    For int4, ``quantized`` maps stored tensor names to what a QD04 file holds (``qd4.load_qd4_quantized``):
    a linear runs on its own 4-bit codes, or in bfloat16 where the file stores it raw or the kernel cannot
    take its shape -- except a raw head (an f16 embedding kept on purpose), which searches on codes made at
    load and rescores its top candidates from the stored rows (``Int4Linear(exact_rows=)``). With no file
    (``quantized`` None: float weights from from_pretrained) each linear is quantised now with ``q4g.quantize``
    (the packer's quantiser). ``Int4Linear`` runs torch's CPU int4 kernel, so on another ``device`` int4 becomes
    bfloat16 (said in the log and in the summary's ``int4_fallback``).
    """
    if compute not in ("float32", "bfloat16", "int4"):
        raise ValueError(f"compute must be float32, bfloat16 or int4, got {compute!r}")
    fallback = None
    if compute == "int4" and torch.device(device).type != "cpu":
        fallback = (f"int4 on {device}: Int4Linear runs torch's CPU int4 kernel; the linear layers run in bfloat16 "
                    f"on {device} instead")
        log.warning(fallback)
        compute = "bfloat16"
    summary: dict[str, Any] = {"compute": compute, "from_codes": 0, "quantised_at_load": 0,
                               "bf16_fallback": [], "linear_weight_bytes": 0,
                               "dense_prefill": bool(dense_prefill and compute == "int4"),
                               **({"int4_fallback": fallback} if fallback else {})}
    linears = _linear_modules(model)
    head = model.get_output_embeddings()
    phase = Phase() if summary["dense_prefill"] else None
    if phase is not None:
        track_phase(model, phase)
    for name, lin in linears.items():
        bias = lin.bias
        top_k, layer_phase = (RESCORE_TOP_K, None) if lin is head else (0, phase)
        if compute == "float32":
            summary["linear_weight_bytes"] += lin.weight.numel() * lin.weight.element_size()
            continue
        new: nn.Module
        if compute == "bfloat16":
            new = BF16Linear(lin.weight, bias)
        elif quantized is not None:  # a QD04 file: its own codes, or bf16 where it holds none usable
            stored = quantized.get(_weight_name_for(model, name, lin))
            if isinstance(stored, q4g.QuantizedTensor) and int4_unsupported(stored.shape, stored.group_size) is None:
                new, summary["from_codes"] = Int4Linear(stored, bias, top_k, layer_phase), summary["from_codes"] + 1
            elif (lin is head and isinstance(stored, torch.Tensor)
                  and int4_unsupported(tuple(stored.shape), HEAD_SEARCH_GROUP_SIZE) is None):
                # a head kept raw on purpose: search on codes made now, rescore the candidates from its rows
                new = Int4Linear(q4g.quantize(stored.float(), HEAD_SEARCH_GROUP_SIZE), bias, top_k,
                                 exact_rows=stored)
                summary["head_search_codes"] = f"q4g G{HEAD_SEARCH_GROUP_SIZE}, rescored from {stored.dtype}"
            else:  # stored raw (e.g. an f16 embedding kept on purpose) or a shape the kernel cannot take
                new = BF16Linear(lin.weight, bias)
                summary["bf16_fallback"].append(name)
        elif int4_unsupported(tuple(lin.weight.shape), group_size) is None:  # float weights: quantise now
            new = Int4Linear(q4g.quantize(lin.weight.detach().float(), group_size), bias, top_k, layer_phase)
            summary["quantised_at_load"] += 1
        else:
            new = BF16Linear(lin.weight, bias)
            summary["bf16_fallback"].append(name)
        summary["linear_weight_bytes"] += new.weight_bytes()
        _set_module(model, name, new)
    if summary["bf16_fallback"]:
        log.warning("%d linear layers have no usable int4 codes, kept in bfloat16: %s",
                    len(summary["bf16_fallback"]), summary["bf16_fallback"][:8])
    return summary
