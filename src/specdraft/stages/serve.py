"""`specdraft serve`: the draft server (``specdraft.server``) on a packed model dir, until SIGINT/SIGTERM."""

from __future__ import annotations

from specdraft.server.app import run_server
from specdraft.server.config import ServeConfig

__all__ = ["ServeConfig", "run_serve"]


def run_serve(config: ServeConfig) -> int:
    return run_server(config)
