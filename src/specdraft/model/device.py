"""Which torch device a stage runs on."""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    """``auto``: cuda when available, else cpu; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
