"""QD04: a versioned 4-bit weight file for draft models (the format is specified in docs/qd4.md).

The 4-bit encoding itself is ``q4g`` (quantise / dequantise / pack primitives); this module is the file:

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from specdraft import __version__
from specdraft.core.io import atomic_file
from specdraft.quant.q4g import (
    BITS,
    DEFAULT_GROUP_SIZE,
    FITS,
    QuantizedTensor,
    check_group_size,
    dequantize,
    num_groups,
    quantize,
)

MAGIC = b"QD04"
FORMAT_VERSION = 2  # v2: every q4g entry names its own group size (v1: the header's, for all)
SUPPORTED_VERSIONS = (1, 2)
ALIGN = 64
PREFIX = struct.Struct("<4sIQ")  # magic, format version (u32), header length in bytes (u64)
RAW_ENCODINGS: dict[str, torch.dtype] = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
ENCODINGS = ("q4g", *RAW_ENCODINGS)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64"}
_HASH_CHUNK = 64 << 20
PRODUCER_FITS = (*FITS, "gptq")


class QD4Error(ValueError):
    """A QD04 file (or the packed directory around it) that cannot be used; names the path and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


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
    check_group_size(group_size)
    group_sizes = dict(group_sizes or {})
    entries, offset, seen = [], 0, set()
    for name, shape, source_dtype, encoding in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} listed twice")
        seen.add(name)
        g = None
        if encoding == "q4g":
            g = group_sizes.pop(name, group_size)
            check_group_size(g)
        offset = _align(offset)
        nbytes = encoded_nbytes(tuple(shape), encoding, g)
        entries.append(QD4Entry(name, tuple(int(d) for d in shape), source_dtype, encoding, offset, nbytes, g))
        offset += nbytes
    if group_sizes:
        raise ValueError(f"group sizes given for tensors that are not stored as q4g: {sorted(group_sizes)}")
    return tuple(entries), _align(offset)


def _producer(fit: str = "minmax") -> dict[str, Any]:
    """Who wrote the file and how its q4g parameters were fitted (the reader does not need ``fit``)."""
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
    digest = hashlib.sha256()
    path = Path(path)
    with atomic_file(path) as tmp:  # fsynced, given the umask's mode (the server may run as another user)
        with open(tmp, "wb") as f:
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
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def source_dtype_name(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        return dtype_name(getattr(torch, dtype)) if hasattr(torch, dtype) else "float32"
    return dtype_name(dtype)


def estimate_packed_bytes(config, group_size: int = DEFAULT_GROUP_SIZE, *, embedding_encoding: str = "q4g",
                          raw_encoding: str = "f16", fit: str = "minmax") -> int:
    """Exact byte size of the draft.qd4 that ``specdraft pack`` writes for a model with this config.

    Built from a meta-device model (no memory, no weights), with the same tensor list, encodings and
    layout as the writer; exact when the checkpoint's tensors have the config's dtype. ``config``: a
    transformers config (``model.specs.load_config`` reads one from a file or a model dir).
    """
    model = meta_model(config)
    shapes = {n: tuple(t.shape) for n, t in stored_tensors(model).items()}
    encodings = choose_encodings(shapes, embedding_name(model), embedding_encoding=embedding_encoding,
                                 raw_encoding=raw_encoding)
    src = source_dtype_name(config)
    entries, data_nbytes = plan_layout([(n, s, src, encodings[n]) for n, s in shapes.items()], group_size)
    return file_nbytes(entries, data_nbytes, group_size, fit)
