"""A draft made from the target's own layers: ``truncate:TARGET_SPEC:N`` (the first N decoder layers) or
``truncate:TARGET_SPEC:i,j,k`` (those layers), with the target's embeddings, final norm and head.

The one place layers are cut: training's ``--init``, the demo's untrained init and the benchmarks' stand-in
drafts all go through ``truncate_layers``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from specdraft.model.specs import describe_source, resolve_model, tokenizer_from_dir


def parse_truncate_spec(init: str) -> tuple[str, list[int] | int] | None:
    """(target spec, layers) of a ``truncate:`` init, None for any other spec."""
    if not init.startswith("truncate:"):
        return None
    body = init.removeprefix("truncate:")
    spec, _, layers = body.rpartition(":")
    if not spec or not re.fullmatch(r"\d+(,\d+)*", layers):
        raise ValueError(f"--init {init!r}: expected truncate:TARGET_SPEC:N or truncate:TARGET_SPEC:i,j,k "
                         "(N, i, j, k: layer counts / indices)")
    if "," in layers:
        return spec, [int(x) for x in layers.split(",")]
    return spec, int(layers)


def truncate_layers(model, keep: list[int] | int):
    """Keep the given decoder layers (the first N when an int), in place; returns the model."""
    n_layers = model.config.num_hidden_layers
    keep = list(range(keep)) if isinstance(keep, int) else list(keep)
    if not keep or any(i < 0 or i >= n_layers for i in keep):
        raise ValueError(f"layers {keep} out of range for a {n_layers}-layer model")
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by position in the stack
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def build_init(init: str) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, source description) for a draft's initialisation: a model spec, or a ``truncate:``
    spec of the target."""
    truncated = parse_truncate_spec(init)
    spec = truncated[0] if truncated else init
    path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = tokenizer_from_dir(path)
    source = describe_source(spec)
    if truncated:
        truncate_layers(model, truncated[1])
        source["truncate_layers"] = truncated[1]
    source["init"] = init
    return model, tokenizer, source


def save_init(init: str, out_dir: str | os.PathLike) -> dict[str, Any]:
    """``build_init`` written as a plain HF dir (weights, tokenizer, generation config); returns its source."""
    model, tokenizer, source = build_init(init)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    return source
