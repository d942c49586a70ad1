"""q4g <-> GGUF Q4_1 blocks, as pure paired primitives (the GGUF file around them: ``model.export``).

  q4_1_blocks / q4g_from_q4_1     a QuantizedTensor <-> Q4_1 blocks (uint8 [N, K/32 * 20]), losslessly
  maps_to_q4_1                    whether a q4g tensor's grid is one Q4_1 can hold exactly
  permute_rows                    a QuantizedTensor with its rows reordered (every group, hence block, intact)
  dequantize_q4_1                 Q4_1 blocks -> float32 [N, K], computed as ggml does (q * d + m)

ggml's Q4_1 block (``block_q4_1``, 20 bytes) covers 32 consecutive elements of a row:

    d: fp16 | m: fp16 | qs: 16 bytes        x[j] = (qs[j] & 0xF) * d + m,  x[j + 16] = (qs[j] >> 4) * d + m

q4g stores ``w = code * scale + min`` with an fp16 scale and min per group of G along the same axis, so a
group whose G is a multiple of 32 is G/32 Q4_1 blocks with the group's (scale, min) as every block's (d, m):
the same codes, the same two fp16 numbers, the same float32 arithmetic. Only the nibble order differs: a
q4g byte holds two consecutive codes (the even one in the high nibble), a Q4_1 byte holds codes j and j + 16.
A last q4g group padded past K (K % G != 0) maps too, as long as K % 32 == 0: its padding is simply dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from specdraft.quant.q4g import QuantizedTensor, pack_codes, unpack_codes

QK4_1 = 32          # elements per Q4_1 block
Q4_1_BYTES = 20     # bytes per block: fp16 d, fp16 m, 16 bytes of nibbles


def maps_to_q4_1(q: QuantizedTensor) -> bool:
    """True when ``q4_1_blocks`` holds q exactly: its G is a multiple of 32 and its width K is too."""
    return q.group_size % QK4_1 == 0 and q.shape[1] % QK4_1 == 0


def q4_1_blocks(q: QuantizedTensor) -> np.ndarray:
    """The Q4_1 blocks of a q4g tensor, uint8 [N, K/32 * 20], bit-exact (``maps_to_q4_1`` must hold).

    ``gguf.GGUFWriter.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType.Q4_1)`` writes them as they are.
    """
    n, k = q.shape
    if not maps_to_q4_1(q):
        raise ValueError(f"q4g tensor {list(q.shape)} at G={q.group_size} does not map to Q4_1 blocks exactly "
                         f"(needs G and K multiples of {QK4_1})")
    nb = k // QK4_1
    codes = unpack_codes(q.codes)[:, :k].reshape(n, nb, QK4_1)                          # [N, nb, 32]
    qs = codes[..., :QK4_1 // 2] | (codes[..., QK4_1 // 2:] << 4)                        # [N, nb, 16]
    per_group = q.group_size // QK4_1
    d = q.scales.repeat_interleave(per_group, dim=1)[:, :nb].contiguous()                # [N, nb] fp16
    m = q.mins.repeat_interleave(per_group, dim=1)[:, :nb].contiguous()
    blocks = torch.cat([d.view(torch.uint8).view(n, nb, 2), m.view(torch.uint8).view(n, nb, 2), qs], dim=-1)
    return blocks.reshape(n, nb * Q4_1_BYTES).numpy()


def _split(blocks: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d fp16 [N, nb], m fp16 [N, nb], codes uint8 [N, nb, 32]) of Q4_1 blocks [N, nb * 20]."""
    b = torch.as_tensor(np.ascontiguousarray(blocks) if isinstance(blocks, np.ndarray) else blocks)
    if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] % Q4_1_BYTES:
        raise ValueError(f"Q4_1 blocks must be uint8 [N, nb * {Q4_1_BYTES}], got {b.dtype} {list(b.shape)}")
    n, nb = b.shape[0], b.shape[1] // Q4_1_BYTES
    b = b.reshape(n, nb, Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, nb)
    m = b[..., 2:4].contiguous().view(torch.float16).reshape(n, nb)
    qs = b[..., 4:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)                                       # [N, nb, 32]
    return d, m, codes


def q4g_from_q4_1(blocks: np.ndarray | torch.Tensor) -> QuantizedTensor:
    """The inverse of ``q4_1_blocks`` at G = 32: Q4_1 blocks [N, nb * 20] -> a q4g tensor [N, nb * 32]."""
    d, m, codes = _split(blocks)
    n, nb = d.shape
    return QuantizedTensor(pack_codes(codes.reshape(n, nb * QK4_1)), d, m, (n, nb * QK4_1))


def dequantize_q4_1(blocks: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [N, nb * 20] -> float32 [N, nb * 32]: ``q * d + m`` per element, as ggml computes it."""
    d, m, codes = _split(blocks)
    n, nb = d.shape
    x = codes.float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    return x.reshape(n, nb * QK4_1)


def permute_rows(q: QuantizedTensor, order: torch.Tensor) -> QuantizedTensor:
    """q with row i taken from row ``order[i]``: codes, scales and mins move together, so every value is kept."""
    if order.shape != (q.shape[0],):
        raise ValueError(f"row order of length {tuple(order.shape)} for a tensor of {q.shape[0]} rows")
    return QuantizedTensor(q.codes[order].contiguous(), q.scales[order].contiguous(), q.mins[order].contiguous(),
                           q.shape)
