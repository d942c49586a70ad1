"""q4g: groupwise 4-bit quantisation, as pure paired primitives (like gpt-fast's quantize.py).

  quantize_groups / dequantize_groups   a 2-D weight <-> 4-bit codes + fp16 scale and min per group of G
  pack_codes / unpack_codes             codes 0..15 <-> two codes per byte (even index in the high nibble)
  quantize / dequantize                 the two above together: weight <-> QuantizedTensor
  fake_quantize                         dequantize(quantize(w)) on w's device, for quantisation-aware training
  lossless_group_size                   the G on whose grid a weight already sits exactly (e.g. from a Q4_1 GGUF)

Element k of row n is ``code * scale + min`` (asymmetric, codes 0..15). The QD04 file (``qd4``) stores these.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

import torch

BITS = 4
QMAX = (1 << BITS) - 1  # codes are 0..15
DEFAULT_GROUP_SIZE = 64
# Finer grids a weight may already sit on exactly (Q4_0/Q4_1 GGUF blocks are 32 wide): such a tensor is stored
# on that grid, losslessly, instead of being re-rounded to a coarser one (``lossless_group_size``).
LOSSLESS_GROUP_SIZES = (32,)
FP16_MAX = torch.finfo(torch.float16).max
_BLOCK_ROWS = 8192  # rows quantised / dequantised at once: bounds the float32 temporaries of a large embedding
FITS = ("minmax", "lsq")  # per-tensor encoders; "gptq" (calibrated, whole-model) hands write_qd4 its codes


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


def check_group_size(group_size: int) -> None:
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
    check_group_size(group_size)
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
        s, m = minmax_grid(lo, hi, check_range=True)
        if fit == "lsq":
            s, m = _refine_lsq(g, s, m)
        codes[r:r + _BLOCK_ROWS] = _codes(g, s, m).view(x.shape[0], -1)
        scales[r:r + _BLOCK_ROWS], mins[r:r + _BLOCK_ROWS] = s, m
    return codes, scales, mins


def minmax_grid(lo: torch.Tensor, hi: torch.Tensor, check_range: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
    check_group_size(group_size)
    if w.dim() != 2:
        raise ValueError(f"q4g quantises 2-D tensors, got shape {tuple(w.shape)}")
    n, k = w.shape
    ng = num_groups(k, group_size)
    x = w.float()
    if ng * group_size > k:
        x = torch.cat([x, x[:, -1:].expand(n, ng * group_size - k)], dim=1)
    g = x.view(n, ng, group_size)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    s, m = (t.float() for t in minmax_grid(lo, hi))  # no range check: no host sync inside a training step
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


def int4pack_scales_and_zeros(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[Ng, N, 2] (scale, zero) for ``aten._weight_int4pack_mm_for_cpu``, whose dequantisation is
    ``(code - 8) * scale + zero``: so zero = min + 8 * scale. Needs K % G == 0 (no padded group)."""
    s, m = q.scales.float(), q.mins.float()
    return torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().to(dtype)
