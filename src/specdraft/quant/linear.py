"""The linear layers a draft computes with, and ``apply_compute``, which swaps a model's ``nn.Linear`` for them.

  float32   the weights as loaded (QD04 values dequantised to float32)
  bfloat16  ``BF16Linear``: bf16 weights, bf16 matmul, output in the input's dtype
  int4      ``Int4Linear``: the QD04 4-bit codes themselves, run by torch's CPU weight-only int4 kernel
            (``aten._weight_int4pack_mm_for_cpu``, bf16 activations) in decode steps; the prefill pass runs a
            dense copy of the same weights (``Int4Prefill``: bf16 or float32) or the codes too; a tied lm_head
            rescores its top candidates in float32

At batch 1 every generated token reads every weight once, so bytes per weight bound the decode speed:
4 (float32) > 2 (bfloat16) > ~0.56 (int4 codes + an fp16 scale and zero per group of 64). Which format is
fastest still depends on the CPU's kernels (bf16 matmuls without AVX-512 bf16 cost several times float32's):
``quant.compute_choice`` measures it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from specdraft.quant import q4g

log = logging.getLogger(__name__)


Compute = Literal["float32", "bfloat16", "int4"]
Int4Prefill = Literal["bfloat16", "float32", "int4"]  # what an int4 model's prefill pass runs on
DENSE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
INT4_N_MULTIPLE = 16  # the CPU int4 packer needs out_features % 16 == 0
RESCORE_TOP_K = 8  # lm_head candidates recomputed in float32 (Int4Linear)
# A head the file stores raw (an f16 embedding kept on purpose) runs its candidate search on codes made at load
# at this G and rescores the top candidates from the stored rows: a quarter of the bytes of a bf16 matmul
HEAD_SEARCH_GROUP_SIZE = 32
# Longest extension of a kept cache still run on the int4 kernel (is_prefill); past this the dense bf16 GEMM wins
INT4_EXTEND_MAX_TOKENS = 16
F32_ROW_BLOCKS = (8, 16, 32, 64)  # the row multiples f32_row_block tries


# --------------------------------------------------------------------------------------- linear layers

class F32Linear(nn.Module):
    """y = x W^T (+ b) in float32, the rows padded to a multiple of ``row_block``.

    The CPU float32 GEMM (MKL) picks its kernel by the number of rows: one row (a GEMV) and row counts off the
    kernel's tiles round differently from full tiles, so a row's result depends on how many others share the
    call. Padded to whole tiles (``f32_row_block`` finds their size on this machine, by a probe) a row gets the
    same bits alone or in any batch: what the server promises each request.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, row_block: int = 8):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.row_block = row_block
        self.register_buffer("weight", weight.detach().to(torch.float32))  # the same storage when already float32
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        y = padded_linear(x2.to(torch.float32), self.weight, self.row_block).to(x.dtype)  # [M, N]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def padded_linear(x: torch.Tensor, weight: torch.Tensor, row_block: int) -> torch.Tensor:
    """``linear(x, weight)`` with x's rows padded up to a multiple of ``row_block`` (and the padding dropped)."""
    m = x.shape[0]
    pad = -m % row_block
    if pad:
        x = nn.functional.pad(x, (0, 0, 0, pad))
    return nn.functional.linear(x, weight)[:m]


@functools.lru_cache(maxsize=None)
def f32_row_block(in_features: int, threads: int) -> int | None:
    """The smallest row count in ``F32_ROW_BLOCKS`` whose multiples make this machine's float32 GEMM compute each
    row the same whatever the other rows are (at ``threads`` threads, ``in_features`` inputs); None when none does.
    A probe, not an assumption: the same vector at other positions, among other rows, in calls of other sizes."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, in_features, generator=g)
    probe = torch.randn(in_features, generator=g)
    for block in F32_ROW_BLOCKS:
        results = []
        for rows, at in ((block, 0), (block, block - 1), (2 * block, block + 1), (5 * block, 3 * block + 2)):
            x = torch.randn(rows, in_features, generator=g)
            x[at] = probe
            results.append(nn.functional.linear(x, weight)[at])
        if all(torch.equal(r, results[0]) for r in results):
            return block
    return None


def model_f32_row_block(model: nn.Module) -> int | None:
    """The row block that makes every float32 linear of ``model`` row-invariant here (None where none does)."""
    blocks = {f32_row_block(m.in_features, torch.get_num_threads()) for m in _linear_modules(model).values()}
    return None if None in blocks or not blocks else max(blocks)


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
        # transposed on every call (many times slower for a large head).
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

    With ``phase`` the prefill pass (many rows) runs a dense matmul on a copy of the same dequantised weights
    in ``dense_dtype`` (bf16 or float32) instead: the int4 kernel is built for few rows and is slower than a
    dense GEMM at hundreds of rows, while decode steps (one row per sequence) stay on the 4-bit codes. Both
    kernels compute each row independently of the others, so a row gets the same result alone or batched.
    bf16 prefill rows are padded up to ``bucket_rows(M)``: the bf16 GEMM keeps per-shape state, and with a
    new M for every batch the server's memory would grow with the number of shapes it has seen.

    ``exact_rows``: the weight as the file stores it, when ``q`` was made from it at load (a raw f16 head):
    the rescoring then recomputes the candidates from these rows, so the top logits are the float model's
    although the codes only approximate the weight.
    """

    def __init__(self, q: q4g.QuantizedTensor, bias: torch.Tensor | None = None, rescore_top_k: int = 0,
                 phase: Phase | None = None, exact_rows: torch.Tensor | None = None,
                 dense_dtype: torch.dtype = torch.bfloat16, row_block: int = 1):
        super().__init__()
        n, k = q.shape
        g = q.group_size
        reason = int4_unsupported(q.shape, g)
        if reason:
            raise ValueError(reason)
        self.out_features, self.in_features, self.group_size = n, k, g
        self.rescore_top_k = rescore_top_k
        self.row_block = row_block  # a float32 prefill's rows padded to whole GEMM tiles (F32Linear)
        codes = q4g.unpack_codes(q.codes).to(torch.int32)  # [N, K] values 0..15
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))  # [N, K/2]
        self.register_buffer("scales_and_zeros", q4g.int4pack_scales_and_zeros(q, torch.bfloat16))  # [K/G, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))
        self.phase = phase
        if phase is not None:
            self.register_buffer("dense", q4g.dequantize(q, dense_dtype))  # [N, K] for the prefill pass
        self.register_buffer("exact_rows", None if exact_rows is None else exact_rows.detach().clone())  # [N, K]
        if rescore_top_k and exact_rows is None:  # the QD04 parts themselves, to dequantise a few rows exactly
            self.register_buffer("q_codes", q.codes.clone())  # [N, K/2] uint8
            self.register_buffer("q_scales", q.scales.clone())  # [N, K/G] fp16
            self.register_buffer("q_mins", q.mins.clone())  # [N, K/G] fp16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if self.phase is not None and self.phase.prefill:
            if self.dense.dtype == torch.bfloat16:
                m = x2.shape[0]
                xp = nn.functional.pad(x2, (0, 0, 0, bucket_rows(m) - m)).to(torch.bfloat16)  # [M', K]
                y = nn.functional.linear(xp, self.dense)[:m].to(x.dtype)  # [M, N]
            else:
                y = padded_linear(x2.to(torch.float32), self.dense, self.row_block).to(x.dtype)  # [M, N]
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
                  group_size: int = q4g.DEFAULT_GROUP_SIZE, prefill: Int4Prefill = "bfloat16",
                  device: str = "cpu", row_invariant: bool = False) -> dict[str, Any]:
    """Swap the model's nn.Linear modules for the chosen format, in place; return a summary.

    For int4, ``quantized`` maps stored tensor names to what a QD04 file holds (``qd4.load_qd4_quantized``):
    a linear runs on its own 4-bit codes, or in bfloat16 where the file stores it raw or the kernel cannot
    take its shape -- except a raw head (an f16 embedding kept on purpose), which searches on codes made at
    load and rescores its top candidates from the stored rows (``Int4Linear(exact_rows=)``). With no file
    (``quantized`` None: float weights from from_pretrained) each linear is quantised now with ``q4g.quantize``
    (the packer's quantiser). ``prefill``: what an int4 model's prefill pass runs on, a dense bf16 or float32
    copy of the codes' values or the codes themselves. ``Int4Linear`` runs torch's CPU int4 kernel, so on another
    ``device`` int4 becomes bfloat16 (said in the log and in the summary's ``int4_fallback``).

    ``row_invariant``: every row computed the same whatever shares its forward (the server's promise). bf16 and
    int4 kernels are; float32 linears become ``F32Linear`` (rows padded to whole GEMM tiles), and where no tile
    size makes this machine's float32 GEMM row-invariant that is refused (``model_f32_row_block``).
    """
    if compute not in ("float32", "bfloat16", "int4"):
        raise ValueError(f"compute must be float32, bfloat16 or int4, got {compute!r}")
    if prefill not in ("bfloat16", "float32", "int4"):
        raise ValueError(f"an int4 prefill runs on bfloat16, float32 or int4, got {prefill!r}")
    fallback = None
    if compute == "int4" and torch.device(device).type != "cpu":
        fallback = (f"int4 on {device}: Int4Linear runs torch's CPU int4 kernel; the linear layers run in bfloat16 "
                    f"on {device} instead")
        log.warning(fallback)
        compute = "bfloat16"
    summary: dict[str, Any] = {"compute": compute, "from_codes": 0, "quantised_at_load": 0,
                               "bf16_fallback": [], "linear_weight_bytes": 0,
                               "prefill": prefill if compute == "int4" else compute,
                               **({"int4_fallback": fallback} if fallback else {})}
    uses_f32 = compute == "float32" or (compute == "int4" and prefill == "float32")
    row_block = 1
    if row_invariant and uses_f32 and torch.device(device).type == "cpu":
        row_block = model_f32_row_block(model)
        if row_block is None:
            raise ValueError("float32 cannot compute each row the same whatever shares its batch on this machine "
                             f"(no row block of {F32_ROW_BLOCKS} makes its GEMM row-invariant): serve with "
                             "--compute int4 or bfloat16")
        summary["f32_row_block"] = row_block
    dense = compute == "int4" and prefill in DENSE_DTYPES
    fmt = _Format(compute, quantized, group_size, Phase() if dense else None,
                  DENSE_DTYPES[prefill] if dense else torch.bfloat16, row_block)
    if fmt.phase is not None:
        track_phase(model, fmt.phase)
    head = model.get_output_embeddings()
    for name, lin in _linear_modules(model).items():
        new = _swap_linear(model, name, lin, lin is head, fmt, summary)
        if new is not None:
            _set_module(model, name, new)
    if summary["bf16_fallback"]:
        log.warning("%d linear layers have no usable int4 codes, kept in bfloat16: %s",
                    len(summary["bf16_fallback"]), summary["bf16_fallback"][:8])
    return summary


@dataclass(frozen=True)
class _Format:
    """What ``apply_compute`` makes of every linear."""

    compute: Compute
    quantized: dict[str, Any] | None  # what the QD04 file holds (None: float weights, quantised at load)
    group_size: int  # of the codes made at load
    phase: Phase | None  # set while an int4 model prefills, when its prefill runs on a dense copy
    dense_dtype: torch.dtype  # that copy's
    row_block: int  # float32 rows padded to this many (1: unpadded)


def _swap_linear(model: nn.Module, name: str, lin: nn.Linear, is_head: bool, fmt: _Format,
                 summary: dict[str, Any]) -> nn.Module | None:
    """The module that runs ``lin`` in ``fmt`` (None: keep it as it is), its weight bytes and its kind counted in
    ``summary``."""
    bias = lin.bias
    if fmt.compute == "float32":
        summary["linear_weight_bytes"] += lin.weight.numel() * lin.weight.element_size()
        return None if fmt.row_block == 1 else F32Linear(lin.weight, bias, fmt.row_block)
    top_k, layer_phase = (RESCORE_TOP_K, None) if is_head else (0, fmt.phase)
    new: BF16Linear | Int4Linear
    if fmt.compute == "bfloat16":
        new = BF16Linear(lin.weight, bias)
    elif fmt.quantized is not None:  # a QD04 file: its own codes, or bf16 where it holds none usable
        stored = fmt.quantized.get(_weight_name_for(model, name, lin))
        if isinstance(stored, q4g.QuantizedTensor) and int4_unsupported(stored.shape, stored.group_size) is None:
            new = Int4Linear(stored, bias, top_k, layer_phase, dense_dtype=fmt.dense_dtype, row_block=fmt.row_block)
            summary["from_codes"] += 1
        elif (is_head and isinstance(stored, torch.Tensor)
              and int4_unsupported(tuple(stored.shape), HEAD_SEARCH_GROUP_SIZE) is None):
            # a head kept raw on purpose: search on codes made now, rescore the candidates from its rows
            new = Int4Linear(q4g.quantize(stored.float(), HEAD_SEARCH_GROUP_SIZE), bias, top_k, exact_rows=stored)
            summary["head_search_codes"] = f"q4g G{HEAD_SEARCH_GROUP_SIZE}, rescored from {stored.dtype}"
        else:  # stored raw (e.g. an f16 embedding kept on purpose) or a shape the kernel cannot take
            new = BF16Linear(lin.weight, bias)
            summary["bf16_fallback"].append(name)
    elif int4_unsupported(tuple(lin.weight.shape), fmt.group_size) is None:  # float weights: quantise now
        new = Int4Linear(q4g.quantize(lin.weight.detach().float(), fmt.group_size), bias, top_k, layer_phase,
                         dense_dtype=fmt.dense_dtype, row_block=fmt.row_block)
        summary["quantised_at_load"] += 1
    else:
        new = BF16Linear(lin.weight, bias)
        summary["bf16_fallback"].append(name)
    summary["linear_weight_bytes"] += new.weight_bytes()
    return new
