"""`specdraft pack`: a training checkpoint -> a QD04 packed model dir (the format: docs/qd4.md).

  specdraft pack --checkpoint DIR --out MODEL_DIR     write the packed model dir
  specdraft pack --estimate CONFIG.json               print the packed byte count from a config alone

The dir is written to a temporary sibling and renamed into place. ``model.loader.load_packed_model`` reads it
back, refusing a corrupt or mismatched dir before it builds any model.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from transformers import AutoModelForCausalLM

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_dir, atomic_write_json, read_json, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.model.export import ASSISTED_GENERATION, GENERATION_CONFIG, draft_generation_config
from specdraft.model.loader import ARCHITECTURE_FILE, RECIPE_FILE, TOKENIZER_FILES, WEIGHT_FILE
from specdraft.model.specs import architecture_facts, load_config, resolve_model, weights_sha256
from specdraft.quant import q4g, qd4
from specdraft.quant.gptq import DEFAULT_GPTQ_ACT_ORDER, DEFAULT_GPTQ_DAMP, calibration_sequences, gptq_calibrate

log = logging.getLogger(__name__)


class PackConfig(StageConfig):
    checkpoint: str | None = Field(
        None, description="checkpoint to pack: a training output dir (HF save_pretrained) or a model spec")
    out: str | None = Field(None, description="packed model dir to write (must not exist, or be empty)")
    estimate: str | None = Field(
        None, description="a model config.json (or a dir holding one): print the packed byte count and exit")
    group_size: int = Field(q4g.DEFAULT_GROUP_SIZE, ge=2, le=4096,
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
    gptq_damp: float = Field(DEFAULT_GPTQ_DAMP, gt=0, le=1,
                             description="GPTQ damping: fraction of the mean Hessian diagonal added to it")
    gptq_act_order: bool = Field(DEFAULT_GPTQ_ACT_ORDER,
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


# ------------------------------------------------------------------------------------------------ pack

def run_pack(cfg: PackConfig) -> PackResult:
    if cfg.estimate is not None:
        return _run_estimate(cfg)

    started = time.time()
    src = resolve_model(cfg.checkpoint)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a directory (--out names the model dir to write)")
    if out.exists() and any(out.iterdir()) and not cfg.overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    with atomic_dir(out) as tmp, stage_log(tmp / "pack.log"):
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
        assisted = _copy_side_files(src, tmp, model)
        atomic_write_json(tmp / ARCHITECTURE_FILE, _architecture(model, tensors, nbytes, file_sha, header))
        seconds = round(time.time() - started, 3)
        atomic_write_json(tmp / RECIPE_FILE, {
            "config": cfg.to_json_dict(),
            "source": {"checkpoint": cfg.checkpoint, "path": str(src), "weights_sha256": source_sha},
            "format": {"magic": qd4.MAGIC.decode(), "version": qd4.FORMAT_VERSION, "bits": q4g.BITS,
                       "group_size": cfg.group_size, "alignment": qd4.ALIGN, "fit": cfg.fit},
            "encodings": encodings,
            # what generation_config.json adds to the checkpoint's: the draft's assisted-generation settings
            "assisted_generation": assisted,
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
    return PackResult(bytes=nbytes, out=out, sha256=file_sha, seconds=seconds)


def _run_estimate(cfg: PackConfig) -> PackResult:
    path = Path(cfg.estimate)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such config file or directory")
    n = qd4.estimate_packed_bytes(load_config(path), cfg.group_size, embedding_encoding=cfg.embedding_encoding,
                                  raw_encoding=cfg.raw_encoding, fit=cfg.fit)
    log.info("estimate for %s at G=%d, embedding %s: %s bytes (%.3f GB)", path, cfg.group_size,
             cfg.embedding_encoding, f"{n:,}", n / 1e9)
    print(n)
    return PackResult(bytes=n)


def _group_sizes(cfg: PackConfig, tensors: dict[str, torch.Tensor], encodings: dict[str, str]) -> dict[str, int]:
    """{name: G} for the q4g tensors stored at another G than ``cfg.group_size`` (``q4g.lossless_group_size``)."""
    if not cfg.lossless_grids:
        return {}
    out = q4g.lossless_group_sizes(tensors, cfg.group_size, [n for n in tensors if encodings[n] == "q4g"])
    if out:
        log.info("%d of %d q4g tensors sit exactly on a finer grid and are stored on it (G=%s): %s", len(out),
                 sum(e == "q4g" for e in encodings.values()), sorted(set(out.values())),
                 ", ".join(list(out)[:4]) + (", ..." if len(out) > 4 else ""))
    return out


def _calibrate(cfg: PackConfig, model, encodings: dict[str, str], group_sizes: dict[str, int]
               ) -> tuple[dict[str, q4g.QuantizedTensor], dict[str, Any] | None]:
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
                       # float summation order, hence some codes, depends on it
                       "torch_threads": torch.get_num_threads()}


def _load_source(src: Path):
    model, info = AutoModelForCausalLM.from_pretrained(src, dtype="auto", output_loading_info=True)
    if info.get("missing_keys"):
        # from_pretrained would fill these with random values: packing them would be silent garbage.
        raise ValueError(f"{src}: checkpoint lacks weights {sorted(info['missing_keys'])}")
    return model.eval()


def _copy_side_files(src: Path, out: Path, model) -> dict[str, Any]:
    """config.json and the tokenizer files as they are; generation_config.json with the draft's assisted-generation
    settings added (returned), so that transformers' ``generate(assistant_model=draft)`` reads the draft's own."""
    shutil.copy2(src / "config.json", out / "config.json")
    if (src / GENERATION_CONFIG).is_file():
        base = read_json(src / GENERATION_CONFIG)
    elif model.generation_config is not None:
        model.generation_config.save_pretrained(out)
        base = read_json(out / GENERATION_CONFIG)
    else:
        base = {}
    generation = draft_generation_config(base)
    atomic_write_json(out / GENERATION_CONFIG, generation)
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not copied:
        raise ValueError(f"{src}: no tokenizer files (expected some of {', '.join(TOKENIZER_FILES)})")
    for name in copied:
        shutil.copy2(src / name, out / name)
    return {k: generation[k] for k in ASSISTED_GENERATION}


def _architecture(model, tensors: dict[str, torch.Tensor], nbytes: int, sha: str, header: qd4.QD4Header):
    facts = {**architecture_facts(model.config),
             "architecture": (model.config.architectures or [type(model).__name__])[0]}  # the built class's name
    return {
        **{key: facts[key] for key in ("model_type", "architecture", "layers", "hidden", "heads", "kv_heads",
                                       "head_dim", "intermediate", "vocab", "tied_embeddings")},
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
