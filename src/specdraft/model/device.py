"""Which torch device a stage runs on: ``--device auto|cpu|cuda|cuda:N`` on every stage that runs a model."""

from __future__ import annotations

import torch

DEVICE_HELP = "torch device: auto (cuda when available, else cpu), cpu, cuda or cuda:N"


def resolve_device(device: str) -> str:
    """``auto``: cuda when available, else cpu; a CUDA device this machine lacks is refused, naming it."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here (torch {torch.__version__}, built for "
                         f"CUDA {torch.version.cuda or 'none'})")
    return device
