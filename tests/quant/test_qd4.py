"""QD04 primitives and file: Hypothesis round-trip properties, error bounds and one test per corruption."""

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from specdraft.quant import gptq, q4g, qd4
from specdraft.quant.q4g import QuantizedTensor
from specdraft.quant.qd4 import QD4Error

SETTINGS = settings(max_examples=40, deadline=None)
group_sizes = st.sampled_from([2, 4, 8, 32, 64])


@st.composite
def matrices(draw, max_rows=6, max_cols=150):
    """Float32 matrices with adversarial values: constant runs, tiny and large magnitudes, any width."""
    n = draw(st.integers(1, max_rows))
    k = draw(st.integers(1, max_cols))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0]))
    values = arrays(np.float32, (n, k), elements=st.floats(-4.0, 4.0, width=32))
    return torch.from_numpy(draw(values) * np.float32(scale))


def _error_bound(w, scales, mins, group_size):
    """Half a step plus fp16 rounding of the stored scale and min (see quantize_groups), per element."""
    n, k = w.shape
    ng = scales.shape[1]
    x = torch.cat([w, w[:, -1:].expand(n, ng * group_size - k)], 1).view(n, ng, group_size)
    lo, hi = x.amin(-1), x.amax(-1)
    s_true, s, m = (hi - lo) / q4g.QMAX, scales.float(), mins.float()
    bound = s / 2 + q4g.QMAX * (s_true - s).abs() + (lo - m).abs()
    f32 = torch.finfo(torch.float32)
    slack = 4 * f32.eps * (lo.abs() + hi.abs() + s) + f32.tiny  # float32 arithmetic (and its subnormals)
    return (bound + slack).repeat_interleave(group_size, dim=1)[:, :k]


@SETTINGS
@given(w=matrices(), group_size=group_sizes)
def test_codes_in_range_and_error_within_half_step(w, group_size):
    codes, scales, mins = q4g.quantize_groups(w, group_size)
    ng = -(-w.shape[1] // group_size)
    assert codes.dtype == torch.uint8 and codes.shape == (w.shape[0], ng * group_size)
    assert int(codes.max()) <= 15
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape == mins.shape == (w.shape[0], ng)
    back = q4g.dequantize_groups(codes, scales, mins, w.shape[1])
    assert back.shape == w.shape
    assert ((w - back).abs() <= _error_bound(w, scales, mins, group_size)).all()


@SETTINGS
@given(w=matrices(), group_size=group_sizes)
def test_fake_quantize_is_exactly_what_the_packer_stores(w, group_size):
    """QAT trains through fake_quantize: it must equal the packed weight bit for bit."""
    assume(torch.isfinite(w).all() and w.abs().max() < q4g.FP16_MAX)
    assert torch.equal(q4g.fake_quantize(w, group_size), q4g.dequantize(q4g.quantize(w, group_size)))


@SETTINGS
@given(w=matrices(), group_size=group_sizes)
def test_lsq_fit_never_worse_than_minmax(w, group_size):
    """The lsq encoder only changes (scale, min); per group its squared error is at most minmax's."""
    w = w[:, : w.shape[1] // group_size * group_size]  # whole groups (padding copies would weigh in the fit)
    assume(w.shape[1] > 0)

    def group_sq_err(fit):
        codes, scales, mins = q4g.quantize_groups(w, group_size, fit)
        assert int(codes.max()) <= 15
        err = (q4g.dequantize_groups(codes, scales, mins) - w).double().pow(2)
        return err.view(w.shape[0], -1, group_size).sum(-1)

    minmax, lsq = group_sq_err("minmax"), group_sq_err("lsq")
    assert (lsq <= minmax * (1 + 1e-5) + 1e-30).all()


@SETTINGS
@given(w=matrices(), group_size=group_sizes, act_order=st.booleans())
def test_gptq_with_identity_hessian_is_minmax(w, group_size, act_order):
    """No correlation between inputs: no error moves, so the calibrated codes are the plain ones."""
    assume(torch.isfinite(w).all() and w.abs().max() < q4g.FP16_MAX)
    got = gptq.gptq_quantize(w, torch.eye(w.shape[1]), group_size, act_order=act_order)
    expect = q4g.quantize(w, group_size)
    assert got.shape == expect.shape
    for a, b in zip(got[:3], expect[:3]):
        assert torch.equal(a, b)


@SETTINGS
@given(seed=st.integers(0, 2**16), n=st.integers(1, 12), k=st.integers(2, 150), group_size=group_sizes)
def test_gptq_codes_in_range_and_grids_are_minmax_where_fitted_on_the_weights(seed, n, k, group_size):
    """Codes 0..15 in the q4g layout. Act order fits every group's grid on the original weights (static
    groups), so all grids are plain minmax's; left to right only the first group's is (later groups are
    fitted on weights already updated)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(4 * k, k, generator=gen) @ torch.randn(k, k, generator=gen)
    plain = q4g.quantize(w, group_size)
    for act_order in (True, False):
        q = gptq.gptq_quantize(w, x.T @ x / len(x), group_size, act_order=act_order)
        codes = q4g.unpack_codes(q.codes)
        assert q.shape == (n, k) and codes.shape[1] == -(-k // group_size) * group_size and int(codes.max()) <= 15
        assert torch.isfinite(q.scales).all() and (q.scales >= 0).all() and torch.isfinite(q.mins).all()
        fitted = slice(None) if act_order else slice(0, 1)
        assert torch.equal(q.scales[:, fitted], plain.scales[:, fitted])
        assert torch.equal(q.mins[:, fitted], plain.mins[:, fitted])
        assert q4g.dequantize(q).shape == w.shape


def test_gptq_lowers_the_layer_output_error():
    """What GPTQ is for: on correlated inputs, X Wq^T stays closer to X W^T than with plain rounding."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 192, generator=gen)
    x = torch.randn(2048, 192, generator=gen) @ torch.randn(192, 192, generator=gen) + torch.randn(2048, 1,
                                                                                                  generator=gen)
    h = x.T @ x / len(x)

    def output_error(q):
        return float((x @ (q4g.dequantize(q) - w).T).pow(2).mean())

    plain = output_error(q4g.quantize(w, 64))
    assert output_error(gptq.gptq_quantize(w, h, 64)) < 0.7 * plain
    assert output_error(gptq.gptq_quantize(w, h, 64, act_order=True)) < 0.7 * plain


def test_gptq_bad_inputs_refused():
    with pytest.raises(ValueError, match="hessian must be"):
        gptq.gptq_quantize(torch.randn(4, 8), torch.eye(6), 4)
    with pytest.raises(ValueError, match="2-D"):
        gptq.gptq_quantize(torch.randn(8), torch.eye(8), 4)
    with pytest.raises(ValueError, match="NaN"):
        gptq.gptq_quantize(torch.full((2, 8), float("nan")), torch.eye(8), 4)


@SETTINGS
@given(codes=arrays(np.uint8, st.tuples(st.integers(0, 5), st.integers(0, 20).map(lambda m: 2 * m)),
                    elements=st.integers(0, 15)))
def test_unpack_inverts_pack(codes):
    codes = torch.from_numpy(codes)
    packed = q4g.pack_codes(codes)
    assert packed.shape == (codes.shape[0], codes.shape[1] // 2)
    assert torch.equal(q4g.unpack_codes(packed), codes)


def test_pack_nibble_order_even_index_high():
    assert q4g.pack_codes(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x12, 0xF0]]


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match="0..15"):
        q4g.pack_codes(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        q4g.pack_codes(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        q4g.quantize_groups(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="even integer"):
        q4g.quantize_groups(torch.zeros(4, 8), group_size=3)
    with pytest.raises(ValueError, match="NaN"):
        q4g.quantize_groups(torch.tensor([[0.0, float("nan")]]), group_size=2)
    with pytest.raises(ValueError, match="fp16 range"):
        q4g.quantize_groups(torch.tensor([[0.0, 1e6]]), group_size=2)
    with pytest.raises(ValueError, match="unknown fit"):
        q4g.quantize_groups(torch.zeros(2, 4), group_size=2, fit="gptq")


def test_ragged_width_is_padded_not_widened():
    """A last partial group keeps the range of its real values (the padding repeats the last value)."""
    w = torch.tensor([[0.0] * 64 + [1.0, 1.5, 2.0]])  # K = 67: one full group and a group of three
    codes, scales, mins = q4g.quantize_groups(w, 64)
    assert codes.shape == (1, 128)
    assert float(mins[0, 1]) == 1.0 and float(scales[0, 1]) == pytest.approx(1.0 / 15, rel=1e-3)
    assert torch.allclose(q4g.dequantize_groups(codes, scales, mins, 67), w, atol=1 / 30 + 1e-3)  # half a step


@SETTINGS
@given(w=matrices(max_rows=4, max_cols=100), norm=arrays(np.float32, st.integers(1, 9),
                                                             elements=st.floats(-10, 10, width=32)),
       group_size=group_sizes, raw=st.sampled_from(["f16", "bf16", "f32"]))
def test_write_read_bit_exact(tmp_path_factory, w, norm, group_size, raw):
    path = tmp_path_factory.mktemp("rt") / "x.qd4"
    tensors = {"w": w, "norm": torch.from_numpy(norm), "w_bf16": w.to(torch.bfloat16)}
    header = qd4.write_qd4(path, tensors, {"w": "q4g", "norm": raw, "w_bf16": "q4g"}, group_size)
    assert path.stat().st_size == header.file_nbytes == qd4.file_nbytes(header.entries, header.data_nbytes,
                                                                          group_size)
    assert all((header.data_offset + e.offset) % 64 == 0 for e in header.entries)
    read_header, stored = qd4.read_qd4(path)
    assert read_header == header
    expect = q4g.quantize(w, group_size)
    for name in ("w", "w_bf16"):
        got = stored[name]
        assert isinstance(got, QuantizedTensor) and got.shape == tuple(w.shape) and got.group_size == group_size
    for a, b in zip(stored["w"][:3], expect[:3]):
        assert torch.equal(a, b)
    assert torch.equal(stored["norm"], tensors["norm"].to(qd4.RAW_ENCODINGS[raw]))
    # Dequantised through the file == dequantised in memory, bit for bit.
    assert torch.equal(qd4.load_qd4(path)["w"], q4g.dequantize(expect))
    # Deterministic: the same input writes the same bytes.
    again = path.with_name("y.qd4")
    qd4.write_qd4(again, tensors, {"w": "q4g", "norm": raw, "w_bf16": "q4g"}, group_size)
    assert again.read_bytes() == path.read_bytes()


def test_write_precomputed_codes(tmp_path):
    """Codes chosen outside the writer (GPTQ) are stored as given; the rest are encoded with the fit."""
    w, v = torch.randn(6, 40), torch.randn(3, 40)
    x = torch.randn(200, 40) @ torch.randn(40, 40)
    calibrated = gptq.gptq_quantize(w, x.T @ x / 200, 8)
    header = qd4.write_qd4(tmp_path / "g.qd4", {"w": w, "v": v}, {"w": "q4g", "v": "q4g"}, 8, "gptq",
                           quantized={"w": calibrated})
    assert header.producer["fit"] == "gptq"
    _, stored = qd4.read_qd4(tmp_path / "g.qd4")
    for a, b in zip(stored["w"][:3], calibrated[:3]):
        assert torch.equal(a, b)
    for a, b in zip(stored["v"][:3], q4g.quantize(v, 8)[:3]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not stored as q4g"):
        qd4.write_qd4(tmp_path / "h.qd4", {"w": w}, {"w": "f16"}, 8, quantized={"w": calibrated})
    with pytest.raises(ValueError, match="at G=8, not"):
        qd4.write_qd4(tmp_path / "h.qd4", {"w": w}, {"w": "q4g"}, 4, quantized={"w": calibrated})
    assert not (tmp_path / "h.qd4").exists()


def _on_grid(n, k, group_size, seed=0):
    """A float32 [n, k] weight that sits exactly on a q4g grid of G: random codes (0 and 15 in every group, so
    minmax finds the grid again) dequantised with random fp16 scales and mins, as a Q4_1 GGUF layer is."""
    gen = torch.Generator().manual_seed(seed)
    ng = k // group_size
    codes = torch.randint(0, 16, (n, ng, group_size), generator=gen, dtype=torch.uint8)
    codes[..., 0], codes[..., 1] = 0, 15
    scales = (torch.rand(n, ng, generator=gen) * 0.02 + 1e-3).half()
    mins = (-8 * scales.float() + torch.randn(n, ng, generator=gen) * 0.01).half()
    return q4g.dequantize_groups(codes.view(n, -1), scales, mins, k)


@SETTINGS
@given(seed=st.integers(0, 2**16), n=st.integers(1, 8), groups=st.integers(1, 6))
def test_weight_on_a_finer_grid_is_stored_on_it_losslessly(seed, n, groups):
    w = _on_grid(n, 32 * groups, 32, seed)
    assert q4g.is_lossless(w, 32)
    g = q4g.lossless_group_size(w, 64)
    assert g == (64 if q4g.is_lossless(w, 64) else 32)
    assert torch.equal(q4g.dequantize(q4g.quantize(w, g)), w)


def test_lossless_group_size_keeps_the_default_otherwise():
    torch.manual_seed(0)
    assert q4g.lossless_group_size(torch.randn(16, 128), 64) == 64  # on no grid
    assert q4g.lossless_group_size(_on_grid(16, 128, 64), 64) == 64  # already on the default grid
    assert q4g.lossless_group_size(_on_grid(16, 128, 32), 64, finer=()) == 64
    assert q4g.lossless_group_size(_on_grid(16, 128, 32), 32) == 32
    assert q4g.lossless_group_size(torch.randn(16), 64) == 64  # not a matrix
    bad = _on_grid(4, 64, 32)
    bad[0, 0] = float("nan")
    assert q4g.lossless_group_size(bad, 64) == 64  # left for the writer to refuse, with the tensor's name
    tensors = {"fine": _on_grid(16, 128, 32), "default": _on_grid(16, 128, 64), "free": torch.randn(16, 128),
               "fine-skipped": _on_grid(16, 128, 32)}
    assert q4g.lossless_group_sizes(tensors, 64, ["fine", "default", "free"]) == {"fine": 32}
    assert q4g.lossless_group_sizes(tensors, 64) == {"fine": 32, "fine-skipped": 32}


def test_write_read_per_tensor_group_sizes(tmp_path):
    """Format v2: each q4g entry carries its own G; the reader decodes each tensor at it."""
    torch.manual_seed(0)
    tensors = {"a": _on_grid(5, 96, 32), "b": torch.randn(7, 96), "n": torch.randn(96)}
    encodings = {"a": "q4g", "b": "q4g", "n": "f16"}
    header = qd4.write_qd4(tmp_path / "m.qd4", tensors, encodings, 64, group_sizes={"a": 32})
    assert header.format_version == 2
    assert [e.group_size for e in header.entries] == [32, 64, None]
    read, stored = qd4.read_qd4(tmp_path / "m.qd4")
    assert read == header
    assert stored["a"].group_size == 32 and stored["b"].group_size == 64
    assert torch.equal(q4g.dequantize(stored["a"]), tensors["a"])  # lossless at its own grid
    for x, y in zip(stored["b"][:3], q4g.quantize(tensors["b"], 64)[:3]):
        assert torch.equal(x, y)
    assert header.entries[0].nbytes == qd4.encoded_nbytes((5, 96), "q4g", 32)
    with pytest.raises(ValueError, match="not stored as q4g"):
        qd4.write_qd4(tmp_path / "x.qd4", tensors, encodings, 64, group_sizes={"n": 32})
    with pytest.raises(ValueError, match="even integer"):
        qd4.write_qd4(tmp_path / "x.qd4", tensors, encodings, 64, group_sizes={"a": 7})
    with pytest.raises(ValueError, match="at G=32, not"):
        qd4.write_qd4(tmp_path / "x.qd4", tensors, encodings, 64, quantized={"b": q4g.quantize(tensors["b"], 32)})


def _with_header(path, edit, version=None):
    """Rewrite a file's JSON header with ``edit(header)`` (and the prefix's version), re-padded to 64 bytes."""
    data = path.read_bytes()
    _, old_version, hlen = struct.unpack_from("<4sIQ", data)
    header = json.loads(data[16:16 + hlen])
    edit(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(16 + len(body)) % 64)
    path.write_bytes(struct.pack("<4sIQ", b"QD04", version or old_version, len(body)) + body + data[16 + hlen:])
    return path


def test_version_1_files_still_read(tmp_path):
    """A v1 file (one G in the header for every q4g tensor, none per entry) reads as before."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(8, 64), "n": torch.ones(64)}
    qd4.write_qd4(tmp_path / "v2.qd4", tensors, {"w": "q4g", "n": "f16"}, 32)
    v2 = qd4.load_qd4(tmp_path / "v2.qd4")

    def to_v1(h):
        h["format_version"] = 1
        for t in h["tensors"]:
            t.pop("group_size", None)

    old = _with_header(tmp_path / "v2.qd4", to_v1, version=1)
    header = qd4.read_qd4_header(old)
    assert header.format_version == 1 and header.entry("w").group_size == 32
    v1 = qd4.load_qd4(old)
    assert all(torch.equal(v1[n], v2[n]) for n in tensors)


def test_refuses_q4g_entry_without_group_size(good_file):
    def drop(h):
        del h["tensors"][0]["group_size"]

    with pytest.raises(QD4Error, match="corrupt header JSON.*group_size"):
        qd4.load_qd4(_with_header(good_file, drop))


@pytest.mark.parametrize("value", [64.5, "64", True])
def test_refuses_group_size_that_is_not_an_integer(good_file, value):
    def change(h):
        h["tensors"][0]["group_size"] = value

    with pytest.raises(QD4Error, match="corrupt header JSON.*not an integer"):
        qd4.load_qd4(_with_header(good_file, change))


def test_refuses_group_size_that_breaks_the_layout(good_file):
    def change(h):
        h["tensors"][0]["group_size"] = 32  # other scale/min arrays: the sizes no longer follow

    with pytest.raises(QD4Error, match="do not follow the QD04 layout"):
        qd4.load_qd4(_with_header(good_file, change))

    def on_a_raw_tensor(h):
        h["tensors"][0]["group_size"] = 64  # tensor 0 intact again
        h["tensors"][1]["group_size"] = 64

    with pytest.raises(QD4Error, match="do not follow the QD04 layout"):
        qd4.load_qd4(_with_header(good_file, on_a_raw_tensor))


def test_load_dtype_and_quantized_view(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    path = tmp_path / "x.qd4"
    qd4.write_qd4(path, {"w": w, "b": torch.randn(16)}, {"w": "q4g", "b": "f32"}, 64)
    bf = qd4.load_qd4(path, torch.bfloat16)
    assert bf["w"].dtype == bf["b"].dtype == torch.bfloat16
    q = qd4.load_qd4_quantized(path)
    assert q["w"].codes.shape == (16, 64) and q["w"].scales.shape == (16, 2) and q["w"].shape == (16, 128)
    assert torch.equal(q["b"], qd4.load_qd4(path)["b"])


def test_int4pack_cpu_kernel_matches_dequantised_weight(tmp_path):
    """The raw codes feed aten's CPU int4 kernel directly (what a server's fast path will do)."""
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if op is None:
        pytest.skip("no _weight_int4pack_mm_for_cpu in this torch")
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    path = tmp_path / "x.qd4"
    qd4.write_qd4(path, {"w": w}, {"w": "q4g"}, 64)
    q = qd4.load_qd4_quantized(path)["w"]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4g.unpack_codes(q.codes).to(torch.int32), 2)
    x = torch.randn(3, 256)
    y = op(x, packed, 64, q4g.int4pack_scales_and_zeros(q, torch.float32))
    assert torch.allclose(y, x @ q4g.dequantize(q).T, atol=1e-4)


# ------------------------------------------------------------------------------------------ corruption

@pytest.fixture
def good_file(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "good.qd4"
    qd4.write_qd4(path, {"w": torch.randn(8, 64), "n": torch.ones(64)}, {"w": "q4g", "n": "f16"}, 64)
    return path


def _rewrite(path, data):
    path.write_bytes(bytes(data))
    return path


def test_refuses_bad_magic(good_file):
    data = bytearray(good_file.read_bytes())
    data[:4] = b"GGUF"
    with pytest.raises(QD4Error, match="bad magic") as e:
        qd4.load_qd4(_rewrite(good_file, data))
    assert str(good_file) in str(e.value)


def test_refuses_unknown_version(good_file):
    data = bytearray(good_file.read_bytes())
    data[4:8] = struct.pack("<I", 3)
    with pytest.raises(QD4Error, match="unknown QD04 format version 3"):
        qd4.load_qd4(_rewrite(good_file, data))


def test_refuses_truncated(good_file):
    data = good_file.read_bytes()
    with pytest.raises(QD4Error, match="truncated"):
        qd4.load_qd4(_rewrite(good_file, data[:-10]))
    with pytest.raises(QD4Error, match="truncated"):
        qd4.load_qd4(_rewrite(good_file, data[:40]))
    with pytest.raises(QD4Error, match="truncated"):
        qd4.load_qd4(_rewrite(good_file, b""))


def test_refuses_trailing_bytes(good_file):
    with pytest.raises(QD4Error, match="trailing"):
        qd4.load_qd4(_rewrite(good_file, good_file.read_bytes() + b"\0" * 64))


def test_refuses_payload_checksum_mismatch(good_file):
    data = bytearray(good_file.read_bytes())
    data[-100] ^= 0x01
    _rewrite(good_file, data)
    qd4.read_qd4_header(good_file)  # the structure is intact ...
    with pytest.raises(QD4Error, match="checksum mismatch"):  # ... the payload is not
        qd4.load_qd4(good_file)


def test_refuses_corrupt_header_json(good_file):
    data = bytearray(good_file.read_bytes())
    start = data.index(b'"tensors"')
    data[start:start + 9] = b'"tensorz"'
    with pytest.raises(QD4Error, match="corrupt header JSON"):
        qd4.load_qd4(_rewrite(good_file, data))


def test_refuses_directory_that_breaks_the_layout(good_file):
    data = good_file.read_bytes()
    _, _, hlen = struct.unpack_from("<4sIQ", data)
    header = json.loads(data[16:16 + hlen])
    header["tensors"][1]["offset"] += 64
    body = json.dumps(header, separators=(",", ":")).encode().ljust(hlen)
    with pytest.raises(QD4Error, match="do not follow the QD04 layout"):
        qd4.load_qd4(_rewrite(good_file, data[:16] + body + data[16 + hlen:]))


def test_refuses_unknown_encoding(good_file):
    data = good_file.read_bytes()
    data = data.replace(b'"encoding":"f16"', b'"encoding":"q3k"', 1)
    with pytest.raises(QD4Error, match="unknown encoding"):
        qd4.load_qd4(_rewrite(good_file, data))
