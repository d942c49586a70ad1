"""The pack stage: a training checkpoint -> a QD04 packed model dir, and the strict loader for it.

  specdraft pack --checkpoint DIR --out MODEL_DIR     write the packed model dir (see docs/qd4.md)
  specdraft pack --estimate CONFIG.json               print the packed byte count from a config alone

``load_packed_model(model_dir, dtype)`` refuses a corrupt or mismatched dir before it builds any model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from . import qd4
from .config import StageConfig
from .provenance import atomic_write_json, make_shareable_dir, read_json, run_metadata, sha256_file, stage_log
from .qd4 import QD4Error

log = logging.getLogger("specdraft.pack")

WEIGHT_FILE = "draft.qd4"
ARCHITECTURE_FILE = "architecture.json"
RECIPE_FILE = "pack_recipe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


class PackConfig(StageConfig):
    checkpoint: str | None = Field(
        None, description="checkpoint to pack: a training output dir (HF save_pretrained) or a model spec")
    out: str | None = Field(None, description="packed model dir to write (must not exist, or be empty)")
    estimate: str | None = Field(
        None, description="a model config.json (or a dir holding one): print the packed byte count and exit")
    group_size: int = Field(qd4.DEFAULT_GROUP_SIZE, ge=2, le=4096,
                            description="q4g group size G along the input dimension (even)")
    lossless_grids: bool = Field(
        True, description="store a q4g tensor that already sits exactly on a finer 4-bit grid (G=32: e.g. layers "
                          "kept unchanged from a Q4_0/Q4_1 GGUF) on that grid, losslessly, at +0.5 bit per weight "
                          "for it; --no-lossless-grids: every q4g tensor at --group-size")
    embedding_encoding: Literal["q4g", "f16", "bf16", "f32"] = Field(
        "q4g", description="encoding of the input embedding (the tied lm_head with it)",
        json_schema_extra={"aliases": ["--keep-embedding"]})
    fit: Literal["minmax", "lsq", "gptq"] = Field(
        "minmax", description="how q4g picks codes: minmax (range / 15, error <= half a step), lsq (least-squares "
                              "scale and min per group, may clip) or gptq (rounding calibrated on --calibration "
                              "traces, layer by layer, to keep each layer's outputs; same grid as minmax)")
    calibration: str | None = Field(
        None, description="traces JSONL (specdraft traces) whose prompts + completions calibrate --fit gptq")
    calibration_sequences: int = Field(128, ge=1, description="traces used to calibrate, spread over the file")
    calibration_tokens: int = Field(512, ge=16, description="tokens kept per calibration trace (its last ones)")
    gptq_damp: float = Field(qd4.DEFAULT_GPTQ_DAMP, gt=0, le=1,
                             description="GPTQ damping: fraction of the mean Hessian diagonal added to it")
    gptq_act_order: bool = Field(qd4.DEFAULT_GPTQ_ACT_ORDER,
                                 description="GPTQ rounds columns by decreasing input energy, every group's grid "
                                             "fitted first (static groups); --no-gptq-act-order: left to right")
    raw_encoding: Literal["f16", "bf16", "f32"] = Field(
        "f16", description="encoding of the tensors that are not 2-D matrices (norms, biases)")
    overwrite: bool = Field(False, description="replace an existing non-empty --out dir")

    @model_validator(mode="after")
    def _one_mode(self) -> "PackConfig":
        if self.group_size % 2:
            raise ValueError(f"group_size must be even, got {self.group_size}")
        if self.fit == "gptq" and self.calibration is None and self.estimate is None:
            raise ValueError("--fit gptq needs --calibration TRACES.jsonl (traces of the target)")
        if self.calibration is not None and self.fit != "gptq":
            raise ValueError("--calibration is only used by --fit gptq")
        if self.estimate is not None:
            if self.checkpoint is not None or self.out is not None:
                raise ValueError("--estimate takes a config alone: drop --checkpoint/--out")
        elif self.checkpoint is None or self.out is None:
            raise ValueError("give --checkpoint DIR and --out MODEL_DIR (or --estimate CONFIG.json alone)")
        return self


@dataclass(frozen=True)
class PackResult:
    """What run_pack did: ``bytes`` is the draft.qd4 size (estimated, when ``out`` is None)."""

    bytes: int
    out: Path | None = None
    sha256: str | None = None
    seconds: float = 0.0


@dataclass
class LoadInfo:
    """What load_packed_model found; ``missing`` is always 0 (a missing weight is an error)."""

    path: str
    missing: int
    unexpected: int
    unexpected_keys: list[str] = field(default_factory=list)
    dtype: str = "float32"
    bytes: int = 0
    payload_sha256: str = ""
    group_size: int = qd4.DEFAULT_GROUP_SIZE
    encodings: dict[str, int] = field(default_factory=dict)
    read_seconds: float = 0.0  # reading draft.qd4 and checking its sha256
    load_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ pack

def run_pack(cfg: PackConfig) -> PackResult:
    if cfg.estimate is not None:
        return _run_estimate(cfg)
    from .models import resolve_model, weights_sha256

    started = time.time()
    src = resolve_model(cfg.checkpoint)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory (--out names the model dir to write)")
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    make_shareable_dir(tmp)  # it is renamed into place as the artifact
    try:
        with stage_log(tmp / "pack.log", "specdraft.pack"):
            log.info("packing %s (%s) into %s: G=%d, fit %s, embedding %s", cfg.checkpoint, src, out,
                     cfg.group_size, cfg.fit, cfg.embedding_encoding)
            if cfg.calibration is not None and not Path(cfg.calibration).is_file():
                raise FileNotFoundError(f"{cfg.calibration}: no such calibration traces file")
            source_sha = weights_sha256(src)
            model = _load_source(src)
            tensors = qd4.stored_tensors(model)
            emb_name = qd4.embedding_name(model)
            encodings = qd4.choose_encodings({n: tuple(t.shape) for n, t in tensors.items()}, emb_name,
                                             embedding_encoding=cfg.embedding_encoding,
                                             raw_encoding=cfg.raw_encoding)
            group_sizes = _group_sizes(cfg, tensors, encodings)
            quantized, calibration = _calibrate(cfg, model, encodings, group_sizes)
            header = qd4.write_qd4(tmp / WEIGHT_FILE, tensors, encodings, cfg.group_size, cfg.fit, progress=True,
                                   quantized=quantized, group_sizes=group_sizes)
            nbytes = (tmp / WEIGHT_FILE).stat().st_size
            file_sha = sha256_file(tmp / WEIGHT_FILE)
            _copy_side_files(src, tmp, model)
            atomic_write_json(tmp / ARCHITECTURE_FILE, _architecture(model, tensors, nbytes, file_sha, header))
            seconds = round(time.time() - started, 3)
            atomic_write_json(tmp / RECIPE_FILE, {
                "config": cfg.to_json_dict(),
                "source": {"checkpoint": cfg.checkpoint, "path": str(src), "weights_sha256": source_sha},
                "format": {"magic": qd4.MAGIC.decode(), "version": qd4.FORMAT_VERSION, "bits": qd4.BITS,
                           "group_size": cfg.group_size, "alignment": qd4.ALIGN, "fit": cfg.fit},
                "encodings": encodings,
                # q4g tensors stored at another G than group_size (their lossless grid), by name
                "group_sizes": group_sizes,
                **({"calibration": calibration} if calibration else {}),
                "output": {"weight_file": WEIGHT_FILE, "bytes": nbytes, "sha256": file_sha,
                           "payload_sha256": header.payload_sha256},
                "seconds": seconds,
                **run_metadata(),
            })
            source_fp16 = 2 * sum(t.numel() for t in tensors.values())
            log.info("wrote %s: %d tensors, %s bytes (%.3fx fp16 %s), sha256 %s, %.1fs", WEIGHT_FILE, len(tensors),
                     f"{nbytes:,}", nbytes / source_fp16, f"{source_fp16:,}", file_sha, seconds)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PackResult(bytes=nbytes, out=out, sha256=file_sha, seconds=seconds)


def _run_estimate(cfg: PackConfig) -> PackResult:
    path = Path(cfg.estimate)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such config file or directory")
    n = qd4.estimate_packed_bytes(path, cfg.group_size, embedding_encoding=cfg.embedding_encoding,
                                  raw_encoding=cfg.raw_encoding, fit=cfg.fit)
    log.info("estimate for %s at G=%d, embedding %s: %s bytes (%.3f GB)", path, cfg.group_size,
             cfg.embedding_encoding, f"{n:,}", n / 1e9)
    print(n)
    return PackResult(bytes=n)


def _group_sizes(cfg: PackConfig, tensors: dict[str, torch.Tensor], encodings: dict[str, str]) -> dict[str, int]:
    """{name: G} for the q4g tensors stored at another G than ``cfg.group_size`` (``qd4.lossless_group_size``)."""
    if not cfg.lossless_grids:
        return {}
    out = qd4.lossless_group_sizes(tensors, cfg.group_size, [n for n in tensors if encodings[n] == "q4g"])
    if out:
        log.info("%d of %d q4g tensors sit exactly on a finer grid and are stored on it (G=%s): %s", len(out),
                 sum(e == "q4g" for e in encodings.values()), sorted(set(out.values())),
                 ", ".join(list(out)[:4]) + (", ..." if len(out) > 4 else ""))
    return out


def _calibrate(cfg: PackConfig, model, encodings: dict[str, str], group_sizes: dict[str, int]
               ) -> tuple[dict[str, qd4.QuantizedTensor], dict[str, Any] | None]:
    """GPTQ codes for the q4g tensors and the recipe's record of the calibration (nothing unless --fit gptq)."""
    if cfg.fit != "gptq":
        return {}, None
    path = Path(cfg.calibration)
    sequences = calibration_sequences(path, cfg.calibration_sequences, cfg.calibration_tokens)
    vocab = model.get_input_embeddings().num_embeddings
    if any(t < 0 or t >= vocab for ids in sequences for t in ids):
        raise ValueError(f"{path}: token ids outside the draft's vocabulary [0, {vocab}): traces of another "
                         "tokenizer?")
    tokens = sum(map(len, sequences))
    log.info("gptq: calibrating on %d traces (%s tokens) from %s", len(sequences), f"{tokens:,}", path)
    started = time.time()
    embedding = qd4.embedding_name(model)
    quantized = gptq_calibrate(model, sequences, cfg.group_size, cfg.gptq_damp, cfg.gptq_act_order,
                               embedding_gptq=encodings.get(embedding) == "q4g", group_sizes=group_sizes)
    log.info("gptq: calibration took %.1fs", time.time() - started)
    return quantized, {"traces": str(path.resolve()), "sha256": sha256_file(path), "sequences": len(sequences),
                       "tokens": tokens, "max_tokens_per_sequence": cfg.calibration_tokens, "damp": cfg.gptq_damp,
                       "act_order": cfg.gptq_act_order, "calibrated_tensors": len(quantized),
                       # float summation order, hence some codes, depends on it (BENCHMARKS.md)
                       "torch_threads": torch.get_num_threads()}


def _load_source(src: Path):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(src, dtype="auto", output_loading_info=True)
    if info.get("missing_keys"):
        # from_pretrained would fill these with random values: packing them would be silent garbage.
        raise ValueError(f"{src}: checkpoint lacks weights {sorted(info['missing_keys'])}")
    return model.eval()


class _StopForward(Exception):
    pass


class _Hessian:
    """Running sum of x xᵀ over a linear layer's inputs (float64); ``mean()`` is what GPTQ weighs errors by."""

    def __init__(self, width: int):
        self.sum = torch.zeros(width, width, dtype=torch.float64)
        self.count = 0

    @staticmethod
    def outer(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        x = x.reshape(-1, x.shape[-1]).double()
        return x.T @ x, x.shape[0]

    def add(self, product: torch.Tensor, count: int) -> None:
        self.sum += product
        self.count += count

    def mean(self) -> torch.Tensor:
        return self.sum / max(1, self.count)


def calibration_sequences(path: str | os.PathLike, count: int, max_tokens: int) -> list[list[int]]:
    """``count`` traces (prompt + the target's completion) spread evenly over the file, each cut to its last
    ``max_tokens`` tokens: calibration text from the distribution the draft is trained and used on."""
    from .train import read_traces

    examples = read_traces(path, max_tokens)
    step = len(examples) / min(count, len(examples))
    return [examples[int(i * step)].input_ids for i in range(min(count, len(examples)))]


@torch.no_grad()
def gptq_calibrate(model, sequences: list[list[int]], group_size: int, damp: float = qd4.DEFAULT_GPTQ_DAMP,
                   act_order: bool = qd4.DEFAULT_GPTQ_ACT_ORDER, embedding_gptq: bool = True, progress: bool = True,
                   group_sizes: dict[str, int] | None = None) -> dict[str, qd4.QuantizedTensor]:
    """GPTQ every 2-D weight of a decoder-only model, one decoder layer at a time (``model.model.layers``).

    Each layer's Hessians come from the outputs of the layers before it *as already quantised*, so a layer
    corrects for the error of those below. The head (tied to the embedding, when it is) uses the final
    hidden states; an untied input embedding has no inputs to weigh and is rounded plainly. A weight that
    plain rounding reproduces exactly (at ``group_sizes[name]``, else ``group_size``) keeps those codes:
    there is no error to spread. The model's weights are replaced by their dequantised values along the
    way. Returns {stored name: codes}.
    """
    from tqdm import tqdm

    group_sizes = group_sizes or {}

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"gptq: {type(model).__name__} has no model.layers (decoder-only models only)")
    layer_types = getattr(model.config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:  # layer 0's attention inputs are reused for every layer
        raise ValueError(f"gptq: layers of different attention types ({sorted(set(layer_types))}) are not supported")
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters under their first name
    cached: list[tuple[tuple, dict]] = []

    def grab(module, args, kwargs):
        cached.append((args, kwargs))
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids in sequences:
            try:
                model(input_ids=torch.tensor([ids]), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()

    out: dict[str, qd4.QuantizedTensor] = {}
    exact: list[str] = []

    def kept_exact(m: torch.nn.Linear) -> bool:
        """Plain rounding reproduces the weight (it sits on its grid): no error to spread, keep those codes."""
        name = names[id(m.weight)]
        g = group_sizes.get(name, group_size)
        if not qd4.is_lossless(m.weight, g):
            return False
        out[name] = qd4.quantize(m.weight, g)
        exact.append(name)
        return True

    def quantize(linears: dict[str, torch.nn.Linear], hessians: dict[str, "_Hessian"]) -> None:
        for n, m in linears.items():
            name = names[id(m.weight)]
            q = qd4.gptq_quantize(m.weight, hessians[n].mean(), group_sizes.get(name, group_size), damp, act_order)
            m.weight.copy_(qd4.dequantize(q, m.weight.dtype))
            out[name] = q

    def hidden(args: tuple, kwargs: dict) -> torch.Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def with_hidden(args: tuple, kwargs: dict, result) -> tuple[tuple, dict]:
        h = result[0] if isinstance(result, tuple) else result
        return ((h, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": h})

    for layer in tqdm(layers, desc="gptq", unit="layer", disable=not progress):
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and not kept_exact(m)}
        hessians = {n: _Hessian(m.in_features) for n, m in linears.items()}
        last: list = [None, None]  # q/k/v (and gate/up) read one input tensor: its x xᵀ is computed once

        def accumulate(name):
            def hook(module, inputs, output):
                if inputs[0] is not last[0]:
                    last[:] = inputs[0], _Hessian.outer(inputs[0])
                hessians[name].add(*last[1])
            return hook

        if linears:  # a layer kept exact (all on its grid) needs no Hessians: one forward for the next layer
            handles = [m.register_forward_hook(accumulate(n)) for n, m in linears.items()]
            try:
                for a, kw in cached:
                    layer(*a, **kw)
            finally:
                for h in handles:
                    h.remove()
            last[:] = None, None
            quantize(linears, hessians)
        cached = [with_hidden(a, kw, layer(*a, **kw)) for a, kw in cached]

    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if isinstance(head, torch.nn.Linear) and (embedding_gptq or not tied) and not kept_exact(head):
        norm = getattr(model.model, "norm", None) or torch.nn.Identity()
        hessian = _Hessian(head.in_features)
        for a, kw in cached:  # the head's inputs directly: no need to compute the logits
            hessian.add(*_Hessian.outer(norm(hidden(a, kw))))
        quantize({"head": head}, {"head": hessian})
    log.info("gptq: %d tensors rounded by GPTQ, %d kept exact on their grid", len(out) - len(exact), len(exact))
    return out


def _copy_side_files(src: Path, out: Path, model) -> None:
    shutil.copy2(src / "config.json", out / "config.json")
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")
    elif model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not copied:
        raise ValueError(f"{src}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
    for name in copied:
        shutil.copy2(src / name, out / name)


def _architecture(model, tensors: dict[str, torch.Tensor], nbytes: int, sha: str, header: qd4.QD4Header):
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    return {
        "model_type": config.model_type,
        "architecture": (config.architectures or [type(model).__name__])[0],
        "layers": text.num_hidden_layers,
        "hidden": text.hidden_size,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate": getattr(text, "intermediate_size", None),
        "vocab": text.vocab_size,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "parameters": sum(t.numel() for t in tensors.values()),
        "tensors": len(tensors),
        "weight_file": WEIGHT_FILE,
        "format": f"{qd4.MAGIC.decode()} v{header.format_version}",
        "bits": header.bits,
        "group_size": header.group_size,
        "q4g_tensors_by_group_size": header.q4g_group_sizes(),
        "bytes": nbytes,
        "sha256": sha,
    }


# ------------------------------------------------------------------------------------------------ load

def load_packed_model(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(model in eval mode, LoadInfo). Every check runs before the model is built:

    architecture.json and the file's byte count, the QD04 header, the tensor names and shapes against
    config.json, then the payload sha256. Then the model is built from config.json without initialising
    weights, filled with ``load_state_dict(assign=True)`` and re-tied.
    """
    started = time.time()
    model_dir = Path(model_dir)
    arch_path = model_dir / ARCHITECTURE_FILE
    if not arch_path.is_file():
        raise QD4Error(arch_path, "missing: not a packed model dir")
    arch = read_json(arch_path)
    weight = model_dir / str(arch.get("weight_file", WEIGHT_FILE))
    if not weight.is_file():
        raise QD4Error(weight, "missing weight file")
    header = qd4.read_qd4_header(weight)  # magic, version, header, truncation
    size = weight.stat().st_size
    if size != arch.get("bytes"):
        raise QD4Error(weight, f"byte count {size} does not match {ARCHITECTURE_FILE} ({arch.get('bytes')})")
    try:
        config = qd4.load_config(model_dir)
    except ValueError as e:
        raise QD4Error(model_dir / "config.json", f"unreadable config ({e})") from e
    expected = {n: tuple(t.shape) for n, t in qd4.stored_tensors(qd4.meta_model(config)).items()}
    _check_directory(weight, header, expected)
    t0 = time.time()
    _, stored = qd4.read_qd4(weight, verify=True)  # one read; the payload sha256 checked in memory
    read_seconds = time.time() - t0

    tensors = qd4.dequantize_state(stored, dtype)
    del stored
    model = _build_model(config, dtype)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    tied = _tied_names(model)
    missing = [k for k in missing if k not in tied]
    if missing:  # the directory check makes this unreachable; keep the loader strict regardless
        raise QD4Error(weight, f"missing weights after load: {missing}")
    model.eval()
    info = LoadInfo(path=str(model_dir), missing=0, unexpected=len(unexpected), unexpected_keys=list(unexpected),
                    dtype=qd4.dtype_name(dtype), bytes=size, payload_sha256=header.payload_sha256,
                    group_size=header.group_size,
                    encodings={enc: sum(e.encoding == enc for e in header.entries)
                               for enc in sorted({e.encoding for e in header.entries})},
                    read_seconds=round(read_seconds, 4), load_seconds=round(time.time() - started, 4))
    if unexpected:
        log.warning("%s: %d unexpected tensors ignored: %s", weight, len(unexpected), list(unexpected))
    log.info("loaded qd4 missing=0 unexpected=%d from %s (%s bytes, %s, %.2fs, read+sha256 %.2fs)", info.unexpected,
             weight, f"{size:,}", info.dtype, info.load_seconds, info.read_seconds)
    return model, info


def _check_directory(weight: Path, header: qd4.QD4Header, expected: dict[str, tuple[int, ...]]) -> None:
    """Names and shapes in the file against what config.json builds; missing names are an error."""
    stored = {e.name: e.shape for e in header.entries}
    bad = [f"{n}: file {list(s)} vs config {list(expected[n])}" for n, s in stored.items()
           if n in expected and s != expected[n]]
    if bad:
        raise QD4Error(weight, "header shape does not match config.json: " + "; ".join(bad[:8])
                       + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""))
    missing = [n for n in expected if n not in stored]
    if missing:
        raise QD4Error(weight, f"missing weights {missing}")


def _build_model(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _tied_names(model) -> set[str]:
    """Parameter names that share storage with an earlier name (e.g. lm_head.weight when tied)."""
    unique = dict(model.named_parameters())
    return {n for n in dict(model.named_parameters(remove_duplicate=False)) if n not in unique}
