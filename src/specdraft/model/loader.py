"""Loading a draft: ``load_draft(model_dir, compute=...)`` is the one way, used by the server, eval, speculate,
selfcheck and the audit.

A model dir is either a packed dir (``specdraft pack``: config.json, tokenizer, ``draft.qd4``,
``architecture.json``, ``pack_recipe.json``), read by the strict QD04 loader ``load_packed_model`` -- every
check (byte count, header, names and shapes against config.json, payload sha256) before any model is built --
or a plain Hugging Face checkpoint dir (``from_pretrained``, its safetensors headers checked first). The linear
layers then compute in the chosen format (``quant.linear.apply_compute``: float32, bfloat16, or int4 on the
QD04 codes themselves), given or measured for this machine (``auto``: ``quant.compute_choice``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.initialization import no_init_weights

from specdraft.core.io import read_json, sha256_file
from specdraft.model.device import resolve_device
from specdraft.model.specs import describe_source, load_config, weight_file_problems
from specdraft.quant import q4g, qd4
from specdraft.quant.compute_choice import SERVE_WORKLOAD, ComputeSetting, Workload, choose_compute, linear_shapes
from specdraft.quant.linear import Int4Prefill, apply_compute, model_f32_row_block
from specdraft.quant.qd4 import QD4Error

log = logging.getLogger(__name__)

# the files of a packed model dir
WEIGHT_FILE = "draft.qd4"
ARCHITECTURE_FILE = "architecture.json"
RECIPE_FILE = "pack_recipe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


class ModelLoadError(ValueError):
    """A model dir or weight file that cannot be loaded; the message names the path and the reason."""


def load_draft(model_dir: str | os.PathLike, compute: ComputeSetting = "float32", *,
               weights: str | os.PathLike | None = None, prefill: Int4Prefill = "bfloat16", device: str = "cpu",
               workload: Workload = SERVE_WORKLOAD, row_invariant: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, source record) for a draft model dir.

    A packed dir goes through ``load_packed_model`` (``weights``, when given, must be the dir's own QD04 file);
    a dir without a QD04 file through ``from_pretrained``. ``compute`` swaps the linear layers
    (``apply_compute``; int4 runs the QD04 codes, or codes made at load for float weights; ``prefill``: what its
    prefill pass runs on); ``auto`` measures which format runs ``workload`` fastest here (``resolve_compute``).
    The model moves to ``device`` (``auto``: cuda when available; int4 off the CPU runs in bfloat16). The source
    record says what was loaded: path, format (qd4 | hf), weights sha256, load info, the compute chosen and why,
    the compute summary and the device. ``row_invariant``: each row computed the same whatever shares its batch
    (the server's promise; ``quant.linear.apply_compute``).
    """
    started = time.time()
    device = resolve_device(device)
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: not a model dir (config.json is missing)")
    weight_path = Path(weights) if weights else packed_weight_file(model_dir)
    quantized, group_size = None, q4g.DEFAULT_GROUP_SIZE
    if weight_path is not None:
        _check_weight_file(model_dir, weight_path)
        model, info = load_packed_model(model_dir, dtype=torch.float32)
        source: dict[str, Any] = {"path": str(model_dir), "format": "qd4", "weights": str(weight_path),
                                  "weights_sha256": sha256_file(weight_path), "load_info": info.to_json()}
        group_size = info.group_size
    else:
        corrupt = weight_file_problems(model_dir)
        if corrupt:
            raise ModelLoadError("corrupt weight file: " + "; ".join(corrupt))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        log.info("loaded %s with from_pretrained (no QD04 weight file)", model_dir)
        source = {**describe_source(model_dir), "format": "hf"}
    choice = resolve_compute(model, compute, prefill, device, workload, group_size, row_invariant)
    compute, prefill = choice["compute"], choice["prefill"]
    if compute == "int4" and weight_path is not None:
        quantized = qd4.load_qd4_quantized(weight_path, verify=False)  # verified by load_packed_model
    source["compute"] = compute
    source["compute_choice"] = choice
    source["compute_summary"] = apply_compute(model, compute, quantized, group_size, prefill, device, row_invariant)
    source["device"] = device
    source["seconds"] = round(time.time() - started, 3)
    return model.to(device).eval(), source


def resolve_compute(model: nn.Module, compute: ComputeSetting, prefill: Int4Prefill, device: str,
                    workload: Workload, group_size: int, row_invariant: bool = False) -> dict[str, Any]:
    """The format the linear layers run in, and why: an explicit ``compute`` as given; ``auto`` measured on the
    CPU (``quant.compute_choice.choose_compute`` on the model's own shapes and the stage's ``workload``); ``auto``
    off the CPU is bfloat16, the accelerators' matmul format (the int4 kernel is torch's CPU one)."""
    if compute != "auto":
        return {"compute": compute, "prefill": prefill if compute == "int4" else compute, "requested": compute,
                "reason": f"--compute {compute}"}
    if torch.device(device).type != "cpu":
        return {"compute": "bfloat16", "prefill": "bfloat16", "requested": "auto",
                "reason": f"bfloat16 on {device} (not measured: the int4 kernel is CPU-only, bf16 is the accelerator's "
                          "matmul format)"}
    row_block = model_f32_row_block(model) if row_invariant else 1
    choice = choose_compute(linear_shapes(model), workload, group_size=group_size, f32_row_block=row_block)
    return {"requested": "auto", **choice.to_json()}


def packed_weight_file(model_dir: str | os.PathLike) -> Path | None:
    """The QD04 file a packed dir names (``architecture.json``'s ``weight_file``), None when there is none."""
    model_dir = Path(model_dir)
    arch = model_dir / ARCHITECTURE_FILE
    named = read_json(arch).get("weight_file", WEIGHT_FILE) if arch.is_file() else WEIGHT_FILE
    path = model_dir / str(named)
    return path if path.is_file() else None


def _check_weight_file(model_dir: Path, weight_path: Path) -> None:
    """The strict loader reads the weight file named by the packed dir; refuse a different one."""
    if not weight_path.is_file():
        raise ModelLoadError(f"{weight_path}: weight file not found")
    named = packed_weight_file(model_dir)
    if named is None or not os.path.samefile(named, weight_path):
        raise ModelLoadError(f"{weight_path}: not the weight file of the packed dir {model_dir} "
                             f"({named or model_dir / WEIGHT_FILE}); pack the weights into their own dir with "
                             "`specdraft pack`")


# ------------------------------------------------------------------------------------- the strict QD04 loader

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
    group_size: int = q4g.DEFAULT_GROUP_SIZE
    encodings: dict[str, int] = field(default_factory=dict)
    read_seconds: float = 0.0  # reading draft.qd4 and checking its sha256
    load_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
        config = load_config(model_dir)
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
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _tied_names(model) -> set[str]:
    """Parameter names that share storage with an earlier name (e.g. lm_head.weight when tied)."""
    unique = dict(model.named_parameters())
    return {n for n in dict(model.named_parameters(remove_duplicate=False)) if n not in unique}
