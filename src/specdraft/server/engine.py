"""The model side of the server: load the draft, set its compute format, run ``draft_batch``.

Three compute formats for the linear layers (everything else -- embeddings, norms, attention, the
residual stream -- stays float32):

  float32   the weights as loaded (the QD04 values dequantised to float32)
  bfloat16  each nn.Linear swapped for ``BF16Linear``: bf16 weights, bf16 matmul, float32 out
  int4      each nn.Linear swapped for ``Int4Linear``: the QD04 4-bit codes themselves, run by torch's
            CPU weight-only int4 kernel (``aten._weight_int4pack_mm_for_cpu``, bf16 activations) in
            decode steps; a tied lm_head uses the embedding's codes (or, for an embedding stored raw,
            codes made at load), its top candidates rescored in float32; the prefill pass runs a dense
            bf16 copy of the layer weights (``dense_prefill``)

At batch 1 every generated token reads every weight once, so bytes per weight set the latency:
4 (float32) > 2 (bfloat16) > ~0.56 (int4 codes + fp16 scale/zero per group of 64).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from .. import qd4
from ..decode import draft_batch
from ..lean import lean_forward, lean_unsupported

log = logging.getLogger("specdraft.server")

Compute = Literal["float32", "bfloat16", "int4"]
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
INT4_N_MULTIPLE = 16  # the CPU int4 packer needs out_features % 16 == 0
RESCORE_TOP_K = 8  # lm_head candidates recomputed in float32 (Int4Linear)
# A head the file stores raw (an f16 embedding kept on purpose) runs its candidate search on codes made at load
# at this G and rescores the top candidates from the stored rows: 4x fewer bytes per step than a bf16 matmul
HEAD_SEARCH_GROUP_SIZE = 32
# Longest extension of a kept cache still run on the int4 kernel (is_prefill); past this the dense bf16 GEMM wins
INT4_EXTEND_MAX_TOKENS = 16


class ModelLoadError(ValueError):
    """The model dir or weight file cannot be served; the message names the path and the reason."""


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
        # transposed on every call: 200 ms instead of 10 ms for a 49152 x 576 head (BENCHMARKS.md).
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
    reads 4x fewer bytes than the dense bf16 copy (on the 24-layer draft a 2-3 token catch-up took 70-137 ms
    dense against 26 ms for a one-token step; BENCHMARKS.md). This needs nothing from the cache, so it
    holds for every decode engine, and a row is classified the same way alone or batched."""
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
    w = (q - 8) * scale + zero, so zero = min + 8 * scale (``qd4.int4pack_scales_and_zeros``).
    The kernel takes bf16 activations and returns bf16, so outputs carry bf16 rounding (2^-8 relative).
    With ``rescore_top_k`` (used for the lm_head) each row's k largest outputs are recomputed exactly in
    float32 from the same codes, so that the greedy argmax is the float32 one unless the true winner is
    not among the kernel's top k.

    With ``phase`` the prefill pass (many rows) runs a dense bf16 matmul on a bf16 copy of the same
    dequantised weights instead: the int4 kernel is built for few rows and is ~2.3x slower than a bf16
    GEMM at hundreds of rows, while decode steps (one row per sequence) stay on the 4-bit codes. Both
    kernels compute each row independently of the others, so a row gets the same result alone or batched.
    The prefill rows are padded up to ``bucket_rows(M)``: the bf16 GEMM keeps per-shape state, and with a
    new M for every batch the server's memory would grow with the number of shapes it has seen.

    ``exact_rows``: the weight as the file stores it, when ``q`` was made from it at load (a raw f16 head):
    the rescoring then recomputes the candidates from these rows, so the top logits are the float model's
    although the codes only approximate the weight.
    """

    def __init__(self, q: qd4.QuantizedTensor, bias: torch.Tensor | None = None, rescore_top_k: int = 0,
                 phase: Phase | None = None, exact_rows: torch.Tensor | None = None):
        super().__init__()
        n, k = q.shape
        g = q.group_size
        reason = int4_unsupported(q.shape, g)
        if reason:
            raise ValueError(reason)
        self.out_features, self.in_features, self.group_size = n, k, g
        self.rescore_top_k = rescore_top_k
        codes = qd4.unpack_codes(q.codes).to(torch.int32)  # [N, K] values 0..15
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))  # [N, K/2]
        self.register_buffer("scales_and_zeros", qd4.int4pack_scales_and_zeros(q, torch.bfloat16))  # [K/G, N, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))
        self.phase = phase
        if phase is not None:
            self.register_buffer("dense", qd4.dequantize(q, torch.bfloat16))  # [N, K] for the prefill pass
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
            codes = qd4.unpack_codes(self.q_codes[top]).float()  # [M, k, K]
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
                  group_size: int = qd4.DEFAULT_GROUP_SIZE, dense_prefill: bool = True) -> dict[str, Any]:
    """Swap the model's nn.Linear modules for the chosen format, in place; return a summary.

    For int4, ``quantized`` maps stored tensor names to what a QD04 file holds (``qd4.load_qd4_quantized``):
    a linear runs on its own 4-bit codes, or in bfloat16 where the file stores it raw or the kernel cannot
    take its shape -- except a raw head (an f16 embedding kept on purpose), which searches on codes made at
    load and rescores its top candidates from the stored rows (``Int4Linear(exact_rows=)``). With no file
    (``quantized`` None: float weights from from_pretrained) each linear is quantised now with ``qd4.quantize``
    (the packer's quantiser).
    """
    if compute not in ("float32", "bfloat16", "int4"):
        raise ValueError(f"compute must be float32, bfloat16 or int4, got {compute!r}")
    summary: dict[str, Any] = {"compute": compute, "from_codes": 0, "quantised_at_load": 0,
                               "bf16_fallback": [], "linear_weight_bytes": 0,
                               "dense_prefill": bool(dense_prefill and compute == "int4")}
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
            if isinstance(stored, qd4.QuantizedTensor) and int4_unsupported(stored.shape, stored.group_size) is None:
                new, summary["from_codes"] = Int4Linear(stored, bias, top_k, layer_phase), summary["from_codes"] + 1
            elif (lin is head and isinstance(stored, torch.Tensor)
                  and int4_unsupported(tuple(stored.shape), HEAD_SEARCH_GROUP_SIZE) is None):
                # a head kept raw on purpose: search on codes made now, rescore the candidates from its rows
                new = Int4Linear(qd4.quantize(stored.float(), HEAD_SEARCH_GROUP_SIZE), bias, top_k,
                                 exact_rows=stored)
                summary["head_search_codes"] = f"q4g G{HEAD_SEARCH_GROUP_SIZE}, rescored from {stored.dtype}"
            else:  # stored raw (e.g. an f16 embedding kept on purpose) or a shape the kernel cannot take
                new = BF16Linear(lin.weight, bias)
                summary["bf16_fallback"].append(name)
        elif int4_unsupported(tuple(lin.weight.shape), group_size) is None:  # float weights: quantise now
            new = Int4Linear(qd4.quantize(lin.weight.detach().float(), group_size), bias, top_k, layer_phase)
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


# ---------------------------------------------------------------------------------------------- engine

@dataclass
class Engine:
    """A loaded draft model and what the HTTP layer needs to know about it."""

    model: nn.Module
    name: str
    compute: str
    vocab_size: int
    max_positions: int | None
    weights: str | None
    load_info: dict[str, Any] = field(default_factory=dict)
    lean: bool = True  # decode steps through specdraft.lean where the model allows it

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        return draft_batch(self.model, contexts, num_tokens, lean=self.lean)

    def bytes_per_token(self) -> int:
        """Weight bytes one decode step reads at batch 1 (linear layers; the embedding row is negligible)."""
        return int(self.load_info.get("linear_weight_bytes", 0))


def heap_trimmer() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` (frees every unused heap page back to the OS), or None without glibc.

    Each draft step allocates KV caches and activations sized by its batch and context lengths; glibc keeps
    the freed chunks as a high-water mark (bench/bench_memory.py: 1,255 MB after 40 steps untrimmed, 697 MB
    trimmed, for a 784 MB model, at no measurable step-time cost once the KV cache is freed promptly).
    """
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols (libc is loaded): ctypes.util.find_library would spawn ldconfig, and the
        # audit's sandbox rightly counts a server that starts processes as a failure.
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def default_weights(model_dir: str | os.PathLike) -> Path | None:
    from ..pack import WEIGHT_FILE
    path = Path(model_dir) / WEIGHT_FILE
    return path if path.is_file() else None


def load_engine(model_dir: str | os.PathLike, weights: str | os.PathLike | None, compute: Compute,
                name: str | None = None, dense_prefill: bool = True, lean: bool = True) -> Engine:
    """Load the draft for serving: the strict QD04 loader when there is a weight file, else from_pretrained."""
    started = time.time()
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: not a model dir (config.json is missing)")
    weight_path = Path(weights) if weights else default_weights(model_dir)
    quantized: dict[str, Any] | None = None
    info: dict[str, Any] = {}
    if weight_path is not None:
        from ..pack import load_packed_model
        _check_weight_file(model_dir, weight_path)
        model, load_info = load_packed_model(model_dir, dtype=torch.float32)
        info.update(load_info.to_json())
        log.info("loaded qd4 missing=%d unexpected=%d (%s)", load_info.missing, load_info.unexpected, weight_path)
        if compute == "int4":
            quantized = qd4.load_qd4_quantized(weight_path, verify=False)  # verified by the loader
        group_size = load_info.group_size
    else:
        from transformers import AutoModelForCausalLM

        from ..models import weight_file_problems
        corrupt = weight_file_problems(model_dir)
        if corrupt:
            raise ModelLoadError("corrupt weight file: " + "; ".join(corrupt))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        log.info("loaded %s with from_pretrained (no QD04 weight file)", model_dir)
        group_size = qd4.DEFAULT_GROUP_SIZE
    summary = apply_compute(model, compute, quantized, group_size, dense_prefill)
    info.update(summary)
    model.eval()
    # Built now (q/k/v fused once) so that the first request does not pay for it.
    lean_reason = ("off (--no-lean)" if not lean else
                   f"off: {lean_unsupported(model)}" if lean_forward(model) is None else "on")
    info["lean_forward"] = lean_reason
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    info["seconds"] = round(time.time() - started, 3)
    log.info("draft ready: compute=%s, %d linear layers from QD04 codes, %d quantised at load, "
             "%.1f MB of linear weights per token, lean decode %s, %.2fs", compute, summary["from_codes"],
             summary["quantised_at_load"], summary["linear_weight_bytes"] / 1e6, lean_reason, info["seconds"])
    return Engine(model=model, name=name or model_dir.resolve().name, compute=compute,
                  vocab_size=int(text.vocab_size),
                  max_positions=getattr(text, "max_position_embeddings", None),
                  weights=str(weight_path) if weight_path else None, load_info=info, lean=lean)


def _check_weight_file(model_dir: Path, weight_path: Path) -> None:
    """The strict loader reads the weight file named by the packed dir; refuse a different one."""
    from ..pack import ARCHITECTURE_FILE, WEIGHT_FILE
    from ..provenance import read_json

    if not weight_path.is_file():
        raise ModelLoadError(f"{weight_path}: weight file not found")
    arch = model_dir / ARCHITECTURE_FILE
    named = model_dir / (read_json(arch).get("weight_file", WEIGHT_FILE) if arch.is_file() else WEIGHT_FILE)
    if not named.is_file() or not os.path.samefile(named, weight_path):
        raise ModelLoadError(f"{weight_path}: not the weight file of the packed dir {model_dir} ({named}); "
                             "pack the weights into their own dir with `specdraft pack`")
