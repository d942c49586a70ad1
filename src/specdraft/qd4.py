"""QD04: a versioned 4-bit weight file for draft models (the format is specified in docs/qd4.md).

Pure, paired primitives first (like gpt-fast's quantize.py), then the file:

  quantize_groups / dequantize_groups   a 2-D weight <-> 4-bit codes + fp16 scale and min per group of G
  pack_codes / unpack_codes             codes 0..15 <-> two codes per byte (even index in the high nibble)
  quantize / dequantize                 the two above together: weight <-> QuantizedTensor
  write_qd4 / read_qd4                  tensors + encodings <-> file (streamed, 64-byte aligned, sha256)
  load_qd4                              file -> {name: dequantised tensor}, for load_state_dict
  load_qd4_quantized                    file -> {name: QuantizedTensor | raw tensor}, for an int4 kernel

Every structural problem with a file raises ``QD4Error`` (a ValueError) naming the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

import torch

from .provenance import make_shareable_file

MAGIC = b"QD04"
FORMAT_VERSION = 2  # v2: every q4g entry names its own group size (v1: the header's, for all)
SUPPORTED_VERSIONS = (1, 2)
ALIGN = 64
BITS = 4
QMAX = (1 << BITS) - 1  # codes are 0..15
DEFAULT_GROUP_SIZE = 64
# Finer grids a weight may already sit on exactly (Q4_0/Q4_1 GGUF blocks are 32 wide): such a tensor is stored
# on that grid, losslessly, instead of being re-rounded to a coarser one (``lossless_group_size``).
LOSSLESS_GROUP_SIZES = (32,)
PREFIX = struct.Struct("<4sIQ")  # magic, format version (u32), header length in bytes (u64)
RAW_ENCODINGS: dict[str, torch.dtype] = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
ENCODINGS = ("q4g", *RAW_ENCODINGS)
FP16_MAX = torch.finfo(torch.float16).max
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}
_HASH_CHUNK = 64 << 20
_BLOCK_ROWS = 8192
FITS = ("minmax", "lsq")  # per-tensor encoders; "gptq" (calibrated, whole-model) hands write_qd4 its codes
PRODUCER_FITS = (*FITS, "gptq")
# GPTQ defaults, measured on the trained draft (BENCHMARKS.md): damping as a fraction of the mean Hessian diagonal
# (GPTQ's usual 0.01 accepted less), columns by decreasing input energy with static groups
DEFAULT_GPTQ_DAMP = 0.1
DEFAULT_GPTQ_ACT_ORDER = True


class QD4Error(ValueError):
    """A QD04 file (or the packed directory around it) that cannot be used; names the path and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


class QuantizedTensor(NamedTuple):
    """One ``q4g`` tensor as stored: ``codes`` uint8 [N, Kp/2] (packed), ``scales`` and ``mins`` fp16 [N, Kp/G].

    ``shape`` is the original (N, K); Kp = ceil(K / G) * G. Element k of row n is
    ``code(n, k) * scales[n, k // G] + mins[n, k // G]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    shape: tuple[int, int]

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] * 2 // self.scales.shape[1]


@dataclass(frozen=True)
class QD4Entry:
    """One row of the tensor directory; ``offset`` is relative to the start of the data section."""

    name: str
    shape: tuple[int, ...]
    source_dtype: str
    encoding: str
    offset: int
    nbytes: int
    group_size: int | None = None  # q4g only

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "source_dtype": self.source_dtype,
               "encoding": self.encoding, "offset": self.offset, "nbytes": self.nbytes}
        if self.group_size is not None:
            out["group_size"] = self.group_size
        return out


@dataclass(frozen=True)
class QD4Header:
    format_version: int
    bits: int
    group_size: int  # the pack's G; a q4g tensor's own is its entry's group_size
    alignment: int
    data_offset: int  # absolute offset of the data section (a multiple of ALIGN)
    data_nbytes: int
    payload_sha256: str
    producer: dict[str, Any]
    entries: tuple[QD4Entry, ...]

    @property
    def file_nbytes(self) -> int:
        return self.data_offset + self.data_nbytes

    def q4g_group_sizes(self) -> dict[int, int]:
        """{G: number of q4g tensors stored at it}, by increasing G."""
        counts: dict[int, int] = {}
        for e in self.entries:
            if e.group_size is not None:
                counts[e.group_size] = counts.get(e.group_size, 0) + 1
        return dict(sorted(counts.items()))

    def entry(self, name: str) -> QD4Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)


# ------------------------------------------------------------------------------------------ primitives

def _check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"group size must be an even integer >= 2, got {group_size!r}")


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def quantize_groups(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, fit: str = "minmax"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantisation of a 2-D weight in groups of G along the input (last) dim.

    w [N, K] -> codes uint8 [N, Kp] in 0..15, scales fp16 [N, Kp/G], mins fp16 [N, Kp/G], Kp = ceil(K/G)*G.
    A last partial group is padded by repeating the row's last value, so its range is that of its real
    values. ``fit`` chooses each group's (scale, min):
      * ``minmax`` (default): min = the group's minimum, scale = range / 15. Codes are computed against
        the fp16-rounded scale and min, so the error is at most half a step plus fp16 rounding of the two.
      * ``lsq``: start from minmax, then alternate codes <-> least-squares (scale, min) for a few rounds,
        keeping each group's best; never a larger squared error than minmax, but values may be clipped.
    Only the encoder differs; the stored format and the dequantisation are the same.
    """
    _check_group_size(group_size)
    if fit not in FITS:
        raise ValueError(f"unknown fit {fit!r} (known: {', '.join(FITS)})")
    if w.dim() != 2:
        raise ValueError(f"q4g quantises 2-D tensors, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"q4g quantises floating-point tensors, got {w.dtype}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"q4g cannot quantise an empty tensor of shape {tuple(w.shape)}")
    ng = num_groups(k, group_size)
    codes = torch.empty(n, ng * group_size, dtype=torch.uint8)
    scales = torch.empty(n, ng, dtype=torch.float16)
    mins = torch.empty(n, ng, dtype=torch.float16)
    for r in range(0, n, _BLOCK_ROWS):  # row blocks bound the float32 temporaries for a large embedding
        x = w[r:r + _BLOCK_ROWS].detach().to(torch.float32)
        if ng * group_size > k:
            x = torch.cat([x, x[:, -1:].expand(x.shape[0], ng * group_size - k)], dim=1)   # [n', Kp]
        g = x.view(x.shape[0], ng, group_size)                                             # [n', Ng, G]
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)                                            # [n', Ng]
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise ValueError("q4g: tensor holds NaN or infinite values")
        s, m = _minmax_grid(lo, hi, check_range=True)
        if fit == "lsq":
            s, m = _refine_lsq(g, s, m)
        codes[r:r + _BLOCK_ROWS] = _codes(g, s, m).view(x.shape[0], -1)
        scales[r:r + _BLOCK_ROWS], mins[r:r + _BLOCK_ROWS] = s, m
    return codes, scales, mins


def _minmax_grid(lo: torch.Tensor, hi: torch.Tensor, check_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (scale, min) of groups whose float32 range is [lo, hi]: the one grid every q4g encoder starts from."""
    if check_range and max(-float(lo.min()), float(hi.max())) > FP16_MAX:
        raise ValueError(f"q4g: values beyond the fp16 range (|x| > {FP16_MAX:g}) cannot be stored")
    return ((hi - lo) / QMAX).to(torch.float16), lo.to(torch.float16)


def _codes(g: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Nearest code for every value of g [n, Ng, G] given fp16 scales/mins [n, Ng] (uint8 [n, Ng, G])."""
    s, m = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)                          # [n, Ng, 1]
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    return ((g - m) * inv).round_().clamp_(0, QMAX).to(torch.uint8)


def _refine_lsq(g: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, rounds: int = 6
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Alternate nearest codes and the least-squares (scale, min) for them; keep each group's best."""
    def sq_err(s, m):
        q = _codes(g, s, m).float()
        return q, (q * s.float().unsqueeze(-1) + m.float().unsqueeze(-1) - g).pow(2).sum(-1)   # [n, Ng]

    size = g.shape[-1]
    q, best = sq_err(scales, mins)
    sx = g.sum(-1)
    for _ in range(rounds):
        sq, sqq, sqx = q.sum(-1), (q * q).sum(-1), (q * g).sum(-1)
        den = size * sqq - sq * sq
        s = torch.where(den > 0, (size * sqx - sq * sx) / den.clamp(min=1e-30), scales.float()).clamp(0, FP16_MAX)
        m = ((sx - s * sq) / size).clamp(-FP16_MAX, FP16_MAX)
        s, m = s.to(torch.float16), m.to(torch.float16)
        q, err = sq_err(s, m)
        better = err < best
        scales, mins, best = torch.where(better, s, scales), torch.where(better, m, mins), torch.minimum(err, best)
    return scales, mins


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, k: int | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_groups``: codes uint8 [N, Kp], scales/mins [N, Ng] -> [N, k] in ``dtype``."""
    n, kp = codes.shape
    ng = scales.shape[1]
    if scales.shape != mins.shape or scales.shape[0] != n or ng == 0 or kp % ng:
        raise ValueError(f"q4g: codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and mins "
                         f"{tuple(mins.shape)} do not fit together")
    k = kp if k is None else k
    if not kp - kp // ng < k <= kp:
        raise ValueError(f"q4g: width {k} does not match {kp} codes in {ng} groups")
    g = kp // ng
    out = torch.empty(n, k, dtype=dtype)
    for r in range(0, n, _BLOCK_ROWS):  # row blocks bound the float32 temporary for a large embedding
        c = codes[r:r + _BLOCK_ROWS].view(-1, ng, g).to(torch.float32)                    # [n', Ng, G]
        s = scales[r:r + _BLOCK_ROWS].float().unsqueeze(-1)                                # [n', Ng, 1]
        m = mins[r:r + _BLOCK_ROWS].float().unsqueeze(-1)
        if dtype == torch.float32 and k == kp:  # straight into the output: one fused pass
            torch.addcmul(m, c, s, out=out[r:r + _BLOCK_ROWS].view(-1, ng, g))
        else:
            out[r:r + _BLOCK_ROWS] = torch.addcmul(m, c, s).view(-1, kp)[:, :k]
    return out


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., 2m] in 0..15 -> uint8 [..., m]; byte j = code[2j] << 4 | code[2j+1].

    The nibble order is that of ``torch.ops.aten._convert_weight_to_int4pack`` (CUDA), which takes this
    packed uint8 matrix directly.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes need an even last dimension to pack two per byte, got {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > QMAX:
        raise ValueError(f"codes must lie in 0..{QMAX}, found {int(codes.max())}")
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> codes uint8 [..., 2m]; the inverse of ``pack_codes``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).flatten(-2)


def quantize(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, fit: str = "minmax") -> QuantizedTensor:
    codes, scales, mins = quantize_groups(w, group_size, fit)
    return QuantizedTensor(pack_codes(codes), scales, mins, (w.shape[0], w.shape[1]))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_groups(unpack_codes(q.codes), q.scales, q.mins, q.shape[1], dtype)


def fake_quantize(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """``dequantize(quantize(w, group_size))`` (minmax fit) computed on w's own device and dtype, without the
    packed codes: what the packed model will hold for this weight. Quantisation-aware training uses it."""
    _check_group_size(group_size)
    if w.dim() != 2:
        raise ValueError(f"q4g quantises 2-D tensors, got shape {tuple(w.shape)}")
    n, k = w.shape
    ng = num_groups(k, group_size)
    x = w.float()
    if ng * group_size > k:
        x = torch.cat([x, x[:, -1:].expand(n, ng * group_size - k)], dim=1)
    g = x.view(n, ng, group_size)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    s, m = (t.float() for t in _minmax_grid(lo, hi))  # no range check: no host sync inside a training step
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = ((g - m) * inv).round().clamp(0, QMAX)
    return torch.addcmul(m, q, s).view(n, -1)[:, :k].to(w.dtype)


def is_lossless(w: torch.Tensor, group_size: int) -> bool:
    """Whether plain rounding at this G reproduces w exactly (w already sits on that 4-bit grid)."""
    def exact(x: torch.Tensor) -> bool:
        return torch.equal(dequantize(quantize(x, group_size), x.dtype), x)
    try:
        return exact(w[:64]) and (w.shape[0] <= 64 or exact(w))  # a few rows first: most tensors fail there
    except ValueError:  # NaN/inf or beyond fp16: not on any grid (the writer reports it, with the name)
        return False


def lossless_group_size(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                        finer: Iterable[int] = LOSSLESS_GROUP_SIZES) -> int:
    """The G to store w at: a finer one from ``finer`` on whose grid w sits exactly (e.g. a layer taken
    unchanged from a Q4_1 GGUF, G = 32), when re-rounding at ``group_size`` would lose that; else
    ``group_size``. A finer grid costs 32/G' - 32/G bits per weight (+0.5 for 32 vs 64) and loses nothing."""
    if w.dim() != 2 or not w.is_floating_point() or w.numel() == 0:
        return group_size
    # group_size itself first (nothing to gain), then the cheapest finer grid
    for g in (group_size, *sorted((x for x in finer if x < group_size), reverse=True)):
        if is_lossless(w, g):
            return g
    return group_size


def lossless_group_sizes(tensors: Mapping[str, torch.Tensor], group_size: int = DEFAULT_GROUP_SIZE,
                         names: Iterable[str] | None = None) -> dict[str, int]:
    """{name: G} for those of ``names`` (default: all) whose ``lossless_group_size`` is not ``group_size``:
    what ``write_qd4(..., group_sizes=)`` takes to keep them on their finer grid."""
    out = {}
    for name in tensors if names is None else names:
        g = lossless_group_size(tensors[name], group_size)
        if g != group_size:
            out[name] = g
    return out


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE,
                  damp: float = DEFAULT_GPTQ_DAMP, act_order: bool = DEFAULT_GPTQ_ACT_ORDER) -> QuantizedTensor:
    """Calibrated q4g (GPTQ, Frantar et al. 2022): the same grid and file as ``quantize``, other codes.

    ``hessian`` [K, K] is the mean of x xᵀ over calibration inputs x of this layer. Columns are rounded one
    at a time; each column's rounding error is pushed onto the columns not yet rounded, weighted by the
    inverse Hessian, so the layer's output error on the calibration inputs is (approximately) least squares
    instead of each weight's. ``damp`` (a fraction of the mean diagonal) keeps the inverse stable.

    With ``act_order`` (the default) the columns go in decreasing order of their input energy (the Hessian
    diagonal) and every group's grid (minmax, fp16) is fitted first, on the original weights ("static
    groups": the file's groups stay contiguous). Left to right, a group's grid is fitted when its first
    column is reached, on the weights updated so far. With an identity Hessian no error moves and
    either way the result is exactly ``quantize(w, group_size)``.
    """
    _check_group_size(group_size)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"q4g quantises 2-D floating-point tensors, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}] for a weight of shape {tuple(w.shape)}, got "
                         f"{tuple(hessian.shape)}")
    if not (torch.isfinite(w).all() and torch.isfinite(hessian).all()):
        raise ValueError("gptq: weight or hessian holds NaN or infinite values")
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) <= 0  # inputs never seen: nothing to protect, round them plainly
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1
    h.diagonal().add_(damp * float(torch.diagonal(h).mean()))
    order = (torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order
             else torch.arange(k))
    weight = w.detach().to(torch.float64)[:, order].clone()       # columns in processing order
    h = h[order][:, order]
    # upper Cholesky factor of H^-1: row i holds the weights that spread column i's error onto columns > i
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    ng = num_groups(k, group_size)
    codes = torch.empty(n, ng * group_size, dtype=torch.uint8)
    scales = torch.empty(n, ng, dtype=torch.float16)
    mins = torch.empty(n, ng, dtype=torch.float16)

    def fit_grid(g: int, block: torch.Tensor) -> None:  # block: float32, as quantize_groups sees its groups
        scales[:, g], mins[:, g] = _minmax_grid(block.amin(dim=1), block.amax(dim=1), check_range=True)

    if act_order:
        original = w.detach().float()
        for g in range(ng):
            fit_grid(g, original[:, g * group_size:(g + 1) * group_size])
    # left to right, a block is one group so that its grid sees every earlier group's error
    block = 128 if act_order else group_size
    col_of = order.tolist()
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        if not act_order:
            fit_grid(b0 // group_size, weight[:, b0:b1].float())
        errors = torch.empty(n, b1 - b0, dtype=torch.float64)
        for i in range(b0, b1):
            j = col_of[i]
            s, m = scales[:, j // group_size].float(), mins[:, j // group_size].float()
            inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
            col = weight[:, i]
            q = ((col.float() - m) * inv).round_().clamp_(0, QMAX)  # codes as _codes computes them
            codes[:, j] = q.to(torch.uint8)
            err = (col - torch.addcmul(m, q, s).double()) / hinv[i, i]
            weight[:, i + 1:b1] -= err.unsqueeze(1) * hinv[i, i + 1:b1].unsqueeze(0)
            errors[:, i - b0] = err
        weight[:, b1:] -= errors @ hinv[b0:b1, b1:]   # the block's error, onto the columns after it
    if ng * group_size > k:  # padding repeats the last real code, as quantize_groups' padding does
        codes[:, k:] = codes[:, k - 1:k]
    return QuantizedTensor(pack_codes(codes), scales, mins, (n, k))


def int4pack_scales_and_zeros(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[Ng, N, 2] (scale, zero) for ``aten._weight_int4pack_mm_for_cpu``, whose dequantisation is
    ``(code - 8) * scale + zero``: so zero = min + 8 * scale. Needs K % G == 0 (no padded group)."""
    s, m = q.scales.float(), q.mins.float()
    return torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().to(dtype)


# -------------------------------------------------------------------------------------------- layout

def _align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def q4g_parts(shape: tuple[int, ...], group_size: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(offset, nbytes) of codes, scales and mins inside one q4g payload; each part starts 64-aligned."""
    n, k = shape
    ng = num_groups(k, group_size)
    codes = n * ng * group_size // 2
    params = n * ng * 2
    s_off = _align(codes)
    m_off = s_off + _align(params)
    return (0, codes), (s_off, params), (m_off, params)


def encoded_nbytes(shape: tuple[int, ...], encoding: str, group_size: int | None) -> int:
    if encoding == "q4g":
        if len(shape) != 2:
            raise ValueError(f"q4g stores 2-D tensors, got shape {shape}")
        (_, _), (_, _), (m_off, m_n) = q4g_parts(shape, group_size)
        return m_off + m_n
    if encoding in RAW_ENCODINGS:
        return math.prod(shape) * RAW_ENCODINGS[encoding].itemsize
    raise ValueError(f"unknown encoding {encoding!r} (known: {', '.join(ENCODINGS)})")


def plan_layout(specs: Iterable[tuple[str, tuple[int, ...], str, str]], group_size: int,
                group_sizes: Mapping[str, int] | None = None) -> tuple[tuple[QD4Entry, ...], int]:
    """(name, shape, source_dtype, encoding) in file order -> directory entries and the data section size.

    A q4g tensor uses ``group_sizes[name]`` when given, else ``group_size``."""
    _check_group_size(group_size)
    group_sizes = dict(group_sizes or {})
    entries, offset, seen = [], 0, set()
    for name, shape, source_dtype, encoding in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} listed twice")
        seen.add(name)
        g = None
        if encoding == "q4g":
            g = group_sizes.pop(name, group_size)
            _check_group_size(g)
        offset = _align(offset)
        nbytes = encoded_nbytes(tuple(shape), encoding, g)
        entries.append(QD4Entry(name, tuple(int(d) for d in shape), source_dtype, encoding, offset, nbytes, g))
        offset += nbytes
    if group_sizes:
        raise ValueError(f"group sizes given for tensors that are not stored as q4g: {sorted(group_sizes)}")
    return tuple(entries), _align(offset)


def _producer(fit: str = "minmax") -> dict[str, Any]:
    """Who wrote the file and how its q4g parameters were fitted (the reader does not need ``fit``)."""
    from . import __version__
    return {"name": "specdraft", "version": __version__, "fit": fit}


def _header_json(entries: tuple[QD4Entry, ...], group_size: int, data_nbytes: int, payload_sha256: str,
                 producer: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "format": MAGIC.decode(), "format_version": FORMAT_VERSION, "bits": BITS, "group_size": group_size,
        "alignment": ALIGN, "byte_order": "little", "data_nbytes": data_nbytes,
        "payload_sha256": payload_sha256, "producer": dict(producer),
        "tensors": [e.to_json() for e in entries],
    }


def _encode_header(header: dict[str, Any]) -> bytes:
    """Prefix + JSON, padded with spaces so that the data section starts on a 64-byte boundary."""
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    body += b" " * (_align(PREFIX.size + len(body)) - PREFIX.size - len(body))
    return PREFIX.pack(MAGIC, FORMAT_VERSION, len(body)) + body


def file_nbytes(entries: tuple[QD4Entry, ...], data_nbytes: int, group_size: int, fit: str = "minmax") -> int:
    """Exact size of the file these entries make (the sha256 is fixed-width, so a placeholder will do)."""
    header = _header_json(entries, group_size, data_nbytes, "0" * 64, _producer(fit))
    return len(_encode_header(header)) + data_nbytes


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------- write

def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _encode(t: torch.Tensor, encoding: str, group_size: int | None, fit: str, q: QuantizedTensor | None = None
            ) -> list[tuple[int, memoryview]]:
    """(offset inside the payload, bytes) for one tensor; ``q``: its q4g codes, when already computed."""
    if encoding == "q4g":
        if q is None:
            q = quantize(t, group_size, fit if fit in FITS else "minmax")
        elif q.shape != tuple(t.shape) or q.group_size != group_size:
            raise ValueError(f"precomputed codes are for shape {list(q.shape)} at G={q.group_size}, "
                             f"not {list(t.shape)} at G={group_size}")
        (c_off, _), (s_off, _), (m_off, _) = q4g_parts(tuple(t.shape), group_size)
        return [(c_off, _tensor_bytes(q.codes)), (s_off, _tensor_bytes(q.scales)), (m_off, _tensor_bytes(q.mins))]
    if not t.is_floating_point():
        raise ValueError(f"raw encodings store floating-point tensors, got {t.dtype}")
    raw = t.detach().to(RAW_ENCODINGS[encoding])
    if encoding == "f16" and not torch.isfinite(raw).all() and torch.isfinite(t).all():
        raise ValueError("values beyond the fp16 range cannot be stored as f16 (use bf16 or f32)")
    return [(0, _tensor_bytes(raw))]


def _progress(entries: tuple[QD4Entry, ...], enabled: bool, name: str):
    if not enabled:
        return entries
    from tqdm import tqdm
    return tqdm(entries, desc=f"packing {name}", unit="tensor")


def write_qd4(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], encodings: Mapping[str, str],
              group_size: int = DEFAULT_GROUP_SIZE, fit: str = "minmax", progress: bool = False,
              quantized: Mapping[str, QuantizedTensor] | None = None,
              group_sizes: Mapping[str, int] | None = None) -> QD4Header:
    """Write ``tensors`` (file order = mapping order) with one encoding each; atomic (temp file + rename).

    q4g tensors use ``group_size`` unless ``group_sizes`` names their own (``lossless_group_size``).
    ``quantized`` holds codes already chosen for some q4g tensors (by ``gptq_quantize``); the others are
    encoded here with ``fit`` (minmax when ``fit`` names no per-tensor encoder). ``fit`` is recorded.

    The data is streamed: a header with a placeholder checksum goes first, the payload is hashed as it is
    written, then the header is rewritten in place with the real sha256 (same width, same length).
    """
    if sys.byteorder != "little":
        raise RuntimeError("QD04 is little-endian; writing on a big-endian host is not supported")
    missing = [n for n in tensors if n not in encodings]
    if missing:
        raise ValueError(f"no encoding given for {missing}")
    if fit not in PRODUCER_FITS:
        raise ValueError(f"unknown fit {fit!r} (known: {', '.join(PRODUCER_FITS)})")
    quantized = dict(quantized or {})
    stray = [n for n in quantized if n not in tensors or encodings[n] != "q4g"]
    if stray:
        raise ValueError(f"precomputed codes for tensors that are not stored as q4g: {stray}")
    producer = _producer(fit)
    specs = [(n, tuple(t.shape), dtype_name(t.dtype), encodings[n]) for n, t in tensors.items()]
    entries, data_nbytes = plan_layout(specs, group_size, group_sizes)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            head = _encode_header(_header_json(entries, group_size, data_nbytes, "0" * 64, producer))
            f.write(head)
            pos = 0
            for entry in _progress(entries, progress, path.name):
                try:
                    parts = _encode(tensors[entry.name], entry.encoding, entry.group_size, fit,
                                    quantized.get(entry.name))
                except ValueError as e:
                    raise ValueError(f"{entry.name}: {e}") from e
                for rel, data in parts:
                    gap = entry.offset + rel - pos
                    f.write(b"\0" * gap)
                    digest.update(b"\0" * gap)
                    f.write(data)
                    digest.update(data)
                    pos = entry.offset + rel + len(data)
            tail = b"\0" * (data_nbytes - pos)
            f.write(tail)
            digest.update(tail)
            header = _header_json(entries, group_size, data_nbytes, digest.hexdigest(), producer)
            final_head = _encode_header(header)
            assert len(final_head) == len(head), "header length changed with the checksum"
            f.seek(0)
            f.write(final_head)
            f.flush()
            os.fsync(f.fileno())
        make_shareable_file(tmp)  # the server may run as another user than the packer
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return QD4Header(FORMAT_VERSION, BITS, group_size, ALIGN, len(head), data_nbytes, digest.hexdigest(),
                     producer, entries)


# ----------------------------------------------------------------------------------------------- read

def _parse_header(path: Path, buf: mmap.mmap | bytes, size: int) -> QD4Header:
    if size < PREFIX.size:
        raise QD4Error(path, f"truncated: {size} bytes is shorter than the {PREFIX.size}-byte QD04 prefix")
    magic, version, header_len = PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise QD4Error(path, f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a QD04 file")
    if version not in SUPPORTED_VERSIONS:
        raise QD4Error(path, f"unknown QD04 format version {version} (this reader knows "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))}); upgrade specdraft")
    data_offset = PREFIX.size + header_len
    if data_offset > size:
        raise QD4Error(path, f"truncated: header claims {header_len} bytes, the file has {size}")
    if data_offset % ALIGN:
        raise QD4Error(path, f"corrupt header: data section at {data_offset} is not {ALIGN}-byte aligned")
    try:
        h = json.loads(bytes(buf[PREFIX.size:data_offset]).decode("ascii"))
        file_group_size = int(h["group_size"])
        entries = tuple(QD4Entry(str(t["name"]), tuple(int(d) for d in t["shape"]), str(t["source_dtype"]),
                                 str(t["encoding"]), int(t["offset"]), int(t["nbytes"]),
                                 _entry_group_size(t, version, file_group_size)) for t in h["tensors"])
        header = QD4Header(int(h["format_version"]), int(h["bits"]), file_group_size, int(h["alignment"]),
                           data_offset, int(h["data_nbytes"]), str(h["payload_sha256"]), dict(h["producer"]),
                           entries)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise QD4Error(path, f"corrupt header JSON ({e.__class__.__name__}: {e})") from None
    if header.format_version != version:
        raise QD4Error(path, f"corrupt header: format_version {header.format_version} disagrees with the "
                             f"prefix's {version}")
    if header.bits != BITS or header.alignment != ALIGN:
        raise QD4Error(path, f"unsupported bits={header.bits} alignment={header.alignment} "
                             f"(this reader: bits={BITS} alignment={ALIGN})")
    if size < header.file_nbytes:
        raise QD4Error(path, f"truncated: {size} bytes, the header describes {header.file_nbytes}")
    if size > header.file_nbytes:
        raise QD4Error(path, f"{size - header.file_nbytes} trailing bytes after the data section "
                             f"(expected {header.file_nbytes} bytes)")
    unknown = sorted({e.encoding for e in entries} - set(ENCODINGS))
    if unknown:
        raise QD4Error(path, f"unknown encoding(s) {unknown} (known: {', '.join(ENCODINGS)})")
    try:
        expected, data_nbytes = plan_layout([(e.name, e.shape, e.source_dtype, e.encoding) for e in entries],
                                            header.group_size, {e.name: e.group_size for e in entries
                                                                if e.encoding == "q4g" and e.group_size})
    except ValueError as e:
        raise QD4Error(path, f"corrupt tensor directory: {e}") from None
    if expected != entries or data_nbytes != header.data_nbytes:
        bad = next((e.name for e, x in zip(entries, expected) if e != x), "(data_nbytes)")
        raise QD4Error(path, f"corrupt tensor directory: offsets/sizes of {bad!r} do not follow the "
                             "QD04 layout for its shape and encoding")
    return header


def _entry_group_size(t: Mapping[str, Any], version: int, file_group_size: int) -> int | None:
    """A directory entry's G: its own field (v2, q4g entries only), the header's for every q4g entry in v1."""
    if version == 1:
        return file_group_size if t["encoding"] == "q4g" else None
    if "group_size" in t:
        g = t["group_size"]
        if not isinstance(g, int) or isinstance(g, bool):
            raise TypeError(f"group_size of {t['name']!r} is not an integer: {g!r}")
        return g
    if t["encoding"] == "q4g":
        raise KeyError(f"group_size of q4g tensor {t['name']!r}")
    return None


def read_qd4_header(path: str | os.PathLike) -> QD4Header:
    """Parse and validate the prefix, header and directory (no payload read, no checksum)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(min(size, PREFIX.size))
        if len(head) == PREFIX.size:
            _, _, header_len = PREFIX.unpack(head)
            head += f.read(min(header_len, max(size - PREFIX.size, 0)))
    return _parse_header(path, head, size)


def _open(path: Path) -> tuple[mmap.mmap, QD4Header]:
    size = path.stat().st_size
    if size == 0:
        raise QD4Error(path, "truncated: the file is empty")  # mmap cannot map an empty file
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return mm, _parse_header(path, mm, size)
    except BaseException:
        mm.close()
        raise


def _payload_sha256(mm: mmap.mmap, start: int) -> str:
    digest = hashlib.sha256()
    view = memoryview(mm)
    try:
        for i in range(start, len(mm), _HASH_CHUNK):  # hashlib releases the GIL on large buffers
            digest.update(view[i:i + _HASH_CHUNK])
    finally:
        view.release()
    return digest.hexdigest()


def _check_sha256(path: Path, header: QD4Header, actual: str) -> None:
    if actual != header.payload_sha256:
        raise QD4Error(path, f"payload checksum mismatch: sha256 {actual}, header says {header.payload_sha256} "
                             "(the file is corrupt)")


def verify_qd4(path: str | os.PathLike) -> QD4Header:
    """Full structural check plus the payload sha256 (one pass over an mmap of the file)."""
    path = Path(path)
    mm, header = _open(path)
    try:
        _check_sha256(path, header, _payload_sha256(mm, header.data_offset))
    finally:
        mm.close()
    return header


def _read_data(path: Path, header: QD4Header) -> torch.Tensor:
    """The data section as one uint8 tensor (a single read; every tensor is then a view of it)."""
    data = torch.empty(header.data_nbytes, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(header.data_offset)
        got = f.readinto(memoryview(data.numpy()))
    if got != header.data_nbytes:
        raise QD4Error(path, f"truncated: read {got} of {header.data_nbytes} data bytes")
    return data


def _part(data: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return data[offset:offset + nbytes].view(dtype).view(shape)  # offsets are 64-aligned: views are aligned


def _decode_entry(data: torch.Tensor, e: QD4Entry) -> QuantizedTensor | torch.Tensor:
    if e.encoding == "q4g":
        n, k = e.shape
        ng = num_groups(k, e.group_size)
        (c_off, c_n), (s_off, s_n), (m_off, m_n) = q4g_parts(e.shape, e.group_size)
        return QuantizedTensor(_part(data, e.offset + c_off, c_n, torch.uint8, (n, ng * e.group_size // 2)),
                               _part(data, e.offset + s_off, s_n, torch.float16, (n, ng)),
                               _part(data, e.offset + m_off, m_n, torch.float16, (n, ng)), (n, k))
    return _part(data, e.offset, e.nbytes, RAW_ENCODINGS[e.encoding], e.shape)


def read_qd4(path: str | os.PathLike, *, verify: bool = True
             ) -> tuple[QD4Header, dict[str, QuantizedTensor | torch.Tensor]]:
    """Header plus every tensor as stored: QuantizedTensor for q4g, the raw tensor otherwise.

    The tensors are views of one buffer holding the data section (read once, then hashed in memory).
    """
    path = Path(path)
    header = read_qd4_header(path)
    data = _read_data(path, header)
    if verify:  # in memory, one shot: hashlib releases the GIL on large buffers
        _check_sha256(path, header, hashlib.sha256(memoryview(data.numpy())).hexdigest())
    return header, {e.name: _decode_entry(data, e) for e in header.entries}


def load_qd4_quantized(path: str | os.PathLike, *, verify: bool = True
                       ) -> dict[str, QuantizedTensor | torch.Tensor]:
    """{name: QuantizedTensor(codes uint8 [N, Kp/2], scales fp16 [N, Ng], mins fp16 [N, Ng], (N, K))} for
    q4g tensors and the stored raw tensor for the others: what an int4 kernel needs, without re-quantising.
    All are views of one buffer holding the file's data section.
    ``unpack_codes(q.codes).to(torch.int32)`` and ``int4pack_scales_and_zeros(q)`` feed
    ``aten._convert_weight_to_int4pack_for_cpu`` / ``aten._weight_int4pack_mm_for_cpu``."""
    return read_qd4(path, verify=verify)[1]


def load_qd4(path: str | os.PathLike, dtype: torch.dtype = torch.float32, *, verify: bool = True
             ) -> dict[str, torch.Tensor]:
    """{name: tensor in ``dtype``}: q4g tensors dequantised, raw ones converted; checksum verified first."""
    return dequantize_state(read_qd4(path, verify=verify)[1], dtype)


def dequantize_state(stored: Mapping[str, QuantizedTensor | torch.Tensor], dtype: torch.dtype = torch.float32
                     ) -> dict[str, torch.Tensor]:
    """What read_qd4 returns -> plain tensors in ``dtype`` (a state dict for load_state_dict)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in stored.items():
        # copy=True: a raw tensor already in ``dtype`` must not keep the whole data buffer alive
        out[name] = dequantize(value, dtype) if isinstance(value, QuantizedTensor) else value.to(dtype, copy=True)
    return out


# -------------------------------------------------------------------------------- what a model stores

def stored_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with each tied parameter once (under its first name, e.g. the input embedding)."""
    unique = dict(model.named_parameters())  # remove_duplicate=True drops later names of a shared parameter
    every = dict(model.named_parameters(remove_duplicate=False))
    return {k: v for k, v in model.state_dict().items() if k not in every or k in unique}


def choose_encodings(shapes: Mapping[str, tuple[int, ...]], embedding: str | None = None, *,
                     embedding_encoding: str = "q4g", raw_encoding: str = "f16") -> dict[str, str]:
    """q4g for every 2-D matrix (the embedding included unless ``embedding_encoding`` says otherwise),
    ``raw_encoding`` for everything else (norms, biases)."""
    for label, value, allowed in (("embedding_encoding", embedding_encoding, ENCODINGS),
                                  ("raw_encoding", raw_encoding, tuple(RAW_ENCODINGS))):
        if value not in allowed:
            raise ValueError(f"{label} {value!r} is not one of {allowed}")
    out = {}
    for name, shape in shapes.items():
        if name == embedding:
            out[name] = embedding_encoding
        else:
            out[name] = "q4g" if len(shape) == 2 else raw_encoding
    return out


def embedding_name(model: torch.nn.Module) -> str | None:
    """The parameter name of the input embedding's weight (None when the model has none)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        return None
    return next((n for n, p in model.named_parameters() if p is emb.weight), None)


def meta_model(config):
    """The model this config builds, on the meta device: names and shapes, no memory, no init."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def source_dtype_name(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        return dtype_name(getattr(torch, dtype)) if hasattr(torch, dtype) else "float32"
    return dtype_name(dtype)


def load_config(config: Any):
    """A transformers config from a config object, a dict, a config.json path or a model directory."""
    from transformers import PretrainedConfig
    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, Mapping):
        return _checked_config(dict(config), "config")
    given = Path(config)
    path = given / "config.json" if given.is_dir() else given
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable config.json ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a model config.json (not a JSON object)")
    # a model directory through from_pretrained, as transformers reads it when it loads the model
    return _checked_config(data, str(path), directory=given if given.is_dir() else None)


# the sizes a packed model is built from: a bad one would fail deep inside model construction
_CONFIG_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "vocab_size", "head_dim")


def _checked_config(data: dict, where: str, directory: Path | None = None):
    """The config of a config.json's fields (``AutoConfig.for_model``, or ``from_pretrained`` of ``directory``),
    its errors (transformers raises ValueError, KeyError or huggingface_hub's strict-dataclass errors for a wrong
    type) as ValueError naming the file."""
    from transformers import AutoConfig
    data = dict(data)
    if "model_type" not in data:
        raise ValueError(f"{where}: not a model config.json (no model_type)")
    bad = [f"{k}={data[k]!r}" for k in _CONFIG_SIZES
           if data.get(k) is not None and (not isinstance(data[k], int) or isinstance(data[k], bool) or data[k] <= 0)]
    if bad:
        raise ValueError(f"{where}: sizes must be positive integers: {', '.join(bad)}")
    try:
        if directory is not None:
            return AutoConfig.from_pretrained(directory)
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as e:  # whatever transformers' own validation raises, the file is what is wrong
        raise ValueError(f"{where}: not a usable model config ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]})") from e


def estimate_packed_bytes(config: Any, group_size: int = DEFAULT_GROUP_SIZE, *, embedding_encoding: str = "q4g",
                          raw_encoding: str = "f16", fit: str = "minmax") -> int:
    """Exact byte size of the draft.qd4 that ``specdraft pack`` writes for a model with this config.

    Built from a meta-device model (no memory, no weights), with the same tensor list, encodings and
    layout as the writer; exact when the checkpoint's tensors have the config's dtype.
    """
    config = load_config(config)
    model = meta_model(config)
    shapes = {n: tuple(t.shape) for n, t in stored_tensors(model).items()}
    encodings = choose_encodings(shapes, embedding_name(model), embedding_encoding=embedding_encoding,
                                 raw_encoding=raw_encoding)
    src = source_dtype_name(config)
    entries, data_nbytes = plan_layout([(n, s, src, encodings[n]) for n, s in shapes.items()], group_size)
    return file_nbytes(entries, data_nbytes, group_size, fit)
