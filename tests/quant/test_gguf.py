"""q4g -> Q4_1 blocks: Hypothesis properties that the bytes hold the q4g tensor exactly, read back by gguf-py."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from specdraft.quant import q4g
from specdraft.quant.gguf import (
    Q4_1_BYTES,
    QK4_1,
    dequantize_q4_1,
    maps_to_q4_1,
    permute_rows,
    q4_1_blocks,
    q4g_from_q4_1,
)
from specdraft.quant.q4g import QuantizedTensor

SETTINGS = settings(max_examples=60, deadline=None)
finite_fp16 = st.floats(-65504, 65504, width=16, allow_nan=False, allow_infinity=False)


@st.composite
def q4g_tensors(draw, group_sizes=(32, 64)):
    """A q4g tensor as the QD04 file stores it, with any codes and any finite fp16 scales and mins (subnormals
    and negative zero included); K a multiple of 32, so that at G=64 the last group may be half padding."""
    g = draw(st.sampled_from(group_sizes))
    n = draw(st.integers(1, 5))
    k = QK4_1 * draw(st.integers(1, 6))
    ng = -(-k // g)
    codes = torch.from_numpy(draw(arrays(np.uint8, (n, ng * g), elements=st.integers(0, 15))))
    scales = torch.from_numpy(draw(arrays(np.float16, (n, ng), elements=finite_fp16)))
    mins = torch.from_numpy(draw(arrays(np.float16, (n, ng), elements=finite_fp16)))
    return QuantizedTensor(q4g.pack_codes(codes), scales, mins, (n, k))


def _at_32(q: QuantizedTensor) -> QuantizedTensor:
    """The same tensor on the G=32 grid: its codes cut to K, every group's (scale, min) repeated per 32."""
    n, k = q.shape
    rep = q.group_size // QK4_1
    codes = q4g.unpack_codes(q.codes)[:, :k]
    return QuantizedTensor(q4g.pack_codes(codes), q.scales.repeat_interleave(rep, 1)[:, :k // QK4_1],
                           q.mins.repeat_interleave(rep, 1)[:, :k // QK4_1], (n, k))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@SETTINGS
@given(q=q4g_tensors())
def test_q4_1_blocks_hold_the_q4g_tensor_exactly(q):
    blocks = q4_1_blocks(q)
    n, k = q.shape
    assert blocks.dtype == np.uint8 and blocks.shape == (n, k // QK4_1 * Q4_1_BYTES)
    # the codes, scales and mins come back bit for bit (at G=32: a G=64 group is two blocks with its d, m)
    back, ref = q4g_from_q4_1(blocks), _at_32(q)
    assert back.shape == q.shape
    assert torch.equal(back.codes, ref.codes)
    assert torch.equal(back.scales.view(torch.int16), ref.scales.view(torch.int16))
    assert torch.equal(back.mins.view(torch.int16), ref.mins.view(torch.int16))


@SETTINGS
@given(q=q4g_tensors())
def test_gguf_py_reads_the_values_q4g_decodes(q):
    """gguf-py (llama.cpp's reference reader, what transformers' gguf_file= loader calls) decodes the blocks to
    the float32 values specdraft's loader computes from the QD04 file, bit for bit."""
    blocks = q4_1_blocks(q)
    theirs = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType.Q4_1).copy())
    ours = q4g.dequantize(q)
    assert _bits_equal(theirs, ours)
    assert _bits_equal(dequantize_q4_1(blocks), ours)


@SETTINGS
@given(w=arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([32, 64, 96, 160, 192])),
                elements=st.floats(-4.0, 4.0, width=32)),
       group_size=st.sampled_from([32, 64]))
def test_a_quantised_weight_maps_exactly(w, group_size):
    q = q4g.quantize(torch.from_numpy(w), group_size)
    assert maps_to_q4_1(q)
    theirs = torch.from_numpy(gguf_dequantize(q4_1_blocks(q), GGMLQuantizationType.Q4_1).copy())
    assert _bits_equal(theirs, q4g.dequantize(q))


@SETTINGS
@given(q=q4g_tensors(), seed=st.integers(0, 2**16))
def test_a_row_permutation_moves_whole_blocks(q, seed):
    order = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(seed))
    assert np.array_equal(q4_1_blocks(permute_rows(q, order)), q4_1_blocks(q)[order.numpy()])
    assert torch.equal(q4g.dequantize(permute_rows(q, order)), q4g.dequantize(q)[order])


def test_nibble_order_is_ggml_s():
    """Element j in the low nibble of qs[j], element j + 16 in its high nibble (QD04: 2j high, 2j + 1 low)."""
    codes = (torch.arange(32, dtype=torch.uint8) % 16).view(1, 32)
    q = QuantizedTensor(q4g.pack_codes(codes), torch.ones(1, 1, dtype=torch.float16),
                        torch.zeros(1, 1, dtype=torch.float16), (1, 32))
    blocks = q4_1_blocks(q)[0]
    assert blocks[:2].view(np.float16)[0] == 1 and blocks[2:4].view(np.float16)[0] == 0
    assert list(blocks[4:]) == [j | ((j + 16) % 16) << 4 for j in range(16)]


@pytest.mark.parametrize("group_size, k", [(16, 64), (64, 48), (32, 40)])
def test_grids_q4_1_cannot_hold_are_refused(group_size, k):
    q = q4g.quantize(torch.randn(3, k), group_size)
    assert not maps_to_q4_1(q)
    with pytest.raises(ValueError, match="does not map to Q4_1"):
        q4_1_blocks(q)


def test_bad_blocks_and_orders_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        q4g_from_q4_1(np.zeros((2, 21), dtype=np.uint8))
    q = q4g.quantize(torch.randn(4, 32), 32)
    with pytest.raises(ValueError, match="row order"):
        permute_rows(q, torch.arange(3))
