"""`specdraft export MODEL_DIR --format gguf|hf --out PATH`: the draft in a format other engines load.

  --format gguf --out draft.gguf   one GGUF file llama.cpp loads as a draft (`llama-server -md draft.gguf`);
                                   from a packed dir the 4-bit weights go across as Q4_1, bit-exact where the
                                   grid allows (``quant.gguf``); tokenizer and chat template in its metadata
  --format hf --out DIR            a plain safetensors dir (bf16 by default) with the tokenizer and a
                                   generation_config.json carrying the draft's assisted-generation settings

MODEL_DIR is a packed dir (`specdraft pack`) or a training output (any HF dir). Beside what it writes goes a
record -- ``<out>.export.json`` for a file, ``<out>/export_record.json`` for a dir -- with the source's weight
sha256, the output's, every tensor's type and whether it holds exactly the values ``load_draft(MODEL_DIR,
"float32")`` computes with. `specdraft audit` follows the records of RUN_DIR/export/. docs/exports.md says what
maps exactly and how each engine uses the result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_dir, atomic_file, atomic_write_json, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.model.export import (
    GGUF_DTYPES,
    GGUF_RECORD_SUFFIX,
    HF_DTYPES,
    HF_RECORD,
    read_source,
    write_gguf,
    write_hf,
)
from specdraft.model.specs import weights_sha256

log = logging.getLogger(__name__)

DEFAULT_DTYPE = {"gguf": "auto", "hf": "bfloat16"}
_HF_SHORT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


class ExportConfig(StageConfig):
    model_dir: str = Field(..., description="packed model dir (specdraft pack) or a training output / HF dir",
                           json_schema_extra={"positional": True})
    format: Literal["gguf", "hf"] = Field(..., description="gguf: one file for llama.cpp; hf: a safetensors dir "
                                                           "for transformers, vLLM and SGLang")
    out: str = Field(..., description="gguf: the file to write; hf: the dir to write (must not exist, or be "
                                      "empty). The record goes beside it (<out>.export.json) or in it "
                                      "(export_record.json)")
    dtype: str | None = Field(
        None, description="gguf: auto (QD04 4-bit -> Q4_1 where exact, else F32; float matrices F16), q4_1, f16 "
                          "or f32; hf: bfloat16, float16 or float32 (bf16/f16/f32). Unset: auto (gguf), "
                          "bfloat16 (hf)")
    tokenizer_pre: str | None = Field(
        None, description="gguf: llama.cpp's tokenizer.ggml.pre name, for a tokenizer it cannot recognise (give "
                          "what convert_hf_to_gguf.py writes for the target)")
    name: str | None = Field(None, description="gguf: general.name (unset: the model dir's name)")
    num_assistant_tokens: int | None = Field(
        None, ge=1, le=256, description="hf: draft tokens per step for transformers' assisted generation "
                                        "(unset: the source's generation config, else 4)")
    num_assistant_tokens_schedule: Literal["constant", "heuristic", "heuristic_transient"] | None = Field(
        None, description="hf: constant, heuristic or heuristic_transient (unset: the source's, else constant)")
    assistant_confidence_threshold: float | None = Field(
        None, ge=0, lt=1, description="hf: stop a draft early below this probability; 0 never stops (unset: the "
                                      "source's, else 0)")
    overwrite: bool = Field(False, description="replace an existing output (file, or non-empty dir)")

    @model_validator(mode="after")
    def _dtype_for_format(self) -> "ExportConfig":
        dtype = self.dtype or DEFAULT_DTYPE[self.format]
        if self.format == "hf":
            dtype = _HF_SHORT.get(dtype, dtype)
            if dtype not in HF_DTYPES:
                raise ValueError(f"--dtype for hf is one of {', '.join(HF_DTYPES)} (or bf16, f16, f32), got {dtype!r}")
            if self.tokenizer_pre is not None or self.name is not None:
                raise ValueError("--tokenizer-pre and --name are gguf options")
        else:
            if dtype not in GGUF_DTYPES:
                raise ValueError(f"--dtype for gguf is one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
            if any(v is not None for v in self.generation_settings().values()):
                raise ValueError("the assisted-generation settings are hf options (llama.cpp takes a GGUF draft's "
                                 "from its own flags: --spec-draft-n-max, --spec-draft-p-min; see docs/exports.md)")
        self.dtype = dtype
        return self

    def generation_settings(self) -> dict[str, Any]:
        return {"num_assistant_tokens": self.num_assistant_tokens,
                "num_assistant_tokens_schedule": self.num_assistant_tokens_schedule,
                "assistant_confidence_threshold": self.assistant_confidence_threshold}


@dataclass(frozen=True)
class ExportResult:
    out: Path
    record: Path
    exact: bool
    seconds: float


def run_export(cfg: ExportConfig) -> ExportResult:
    started = time.time()
    out = Path(cfg.out)
    _check_out(out, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    record_path = out.with_name(out.name + GGUF_RECORD_SUFFIX) if cfg.format == "gguf" else out / HF_RECORD
    with stage_log(out.with_name(out.name + ".export.log")):
        log.info("exporting %s as %s (%s) to %s", cfg.model_dir, cfg.format, cfg.dtype, out)
        src = read_source(cfg.model_dir)
        if src.dropped:
            log.warning("%s: %d tensors the model does not use are not exported: %s", src.weight_files[0],
                        len(src.dropped), ", ".join(src.dropped))
        source = _source_record(src)
        if cfg.format == "gguf":
            written, output = _export_gguf(cfg, src, out)
        else:
            written, output = _export_hf(cfg, src, out)
        tensors = written.pop("tensors")
        not_exact = [t["name"] for t in tensors if not t["exact"]]
        types: dict[str, int] = {}
        for t in tensors:
            types[t["type"]] = types.get(t["type"], 0) + 1
        seconds = round(time.time() - started, 3)
        atomic_write_json(record_path, {
            "stage": "export", "format": cfg.format, "dtype": cfg.dtype, "config": cfg.to_json_dict(),
            "source": source, "output": output, **written,
            "tensor_types": types, "exact": not not_exact, "not_exact": not_exact, "tensors": tensors,
            "seconds": seconds, **run_metadata(),
        })
        log.info("wrote %s: %d tensors (%s), %s; record %s, %.1fs", out, len(tensors),
                 ", ".join(f"{n} {k}" for k, n in sorted(types.items())),
                 "every one holds the source's values exactly" if not not_exact else
                 f"{len(not_exact)} not exactly: {', '.join(not_exact[:6])}{' ...' if len(not_exact) > 6 else ''}",
                 record_path, seconds)
    return ExportResult(out=out, record=record_path, exact=not not_exact, seconds=seconds)


def _check_out(out: Path, cfg: ExportConfig) -> None:
    if cfg.format == "gguf":
        if out.is_dir():
            raise FileExistsError(f"{out}: is a directory (--out names the .gguf file to write)")
        if out.exists() and not cfg.overwrite:
            raise FileExistsError(f"{out}: exists (pass --overwrite to replace it)")
    else:
        if out.exists() and not out.is_dir():
            raise FileExistsError(f"{out}: exists and is not a directory (--out names the dir to write)")
        if out.is_dir() and any(out.iterdir()) and not cfg.overwrite:
            raise FileExistsError(f"{out}: exists and is not empty (pass --overwrite to replace it)")


def _source_record(src) -> dict[str, Any]:
    files = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in src.weight_files]
    sha = files[0]["sha256"] if src.kind == "qd4" else weights_sha256(src.model_dir)
    return {"model_dir": str(src.model_dir.resolve()), "kind": src.kind, "weight_files": files,
            "weights_sha256": sha, **({"dropped": src.dropped} if src.dropped else {})}


def _export_gguf(cfg: ExportConfig, src, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    with atomic_file(out) as tmp:
        written = write_gguf(src, tmp, cfg.dtype, pre=cfg.tokenizer_pre, name=cfg.name)
    return written, {"file": out.name, "bytes": out.stat().st_size, "sha256": sha256_file(out)}


def _export_hf(cfg: ExportConfig, src, out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    with atomic_dir(out) as tmp:
        written = write_hf(src, tmp, cfg.dtype, cfg.generation_settings())
        files = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256_file(f)}
                 for f in sorted(tmp.iterdir()) if f.is_file()]
    return written, {"dir": out.name, "files": files}
