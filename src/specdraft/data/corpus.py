"""The prompt corpus shipped in the package, written for specdraft (Apache-2.0, like the project).

Ten kinds of request a user sends a chat assistant -- open writing, roleplay, coding, math word problems,
factual questions, summarisation and extraction over passages written for them, translation, reasoning,
practical advice -- one training file per kind (``assets/corpus/train/<kind>.jsonl``), each row
``{"id", "category", "family", "prompt"}``. Prompts come in *families* (a theme or request pattern); the held-out
evaluation set (``assets/corpus/heldout.jsonl``) is split off by family: no held-out prompt's family is in
training, and no held-out prompt shares a 13-word sequence with any training prompt, so the prompts stage's
contamination check keeps the training split whole. ``assets/corpus/manifest.json`` pins every file by sha256:
it is the built-in default data manifest (``data.manifest.default_manifest_dict``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent.parent / "assets" / "corpus"
MANIFEST_FILE = CORPUS_DIR / "manifest.json"
HELDOUT_FILE = CORPUS_DIR / "heldout.jsonl"


def corpus_dir() -> Path:
    """Where packaged corpus paths resolve (kind ``packaged`` in a manifest)."""
    return CORPUS_DIR


def heldout_path() -> Path:
    """The held-out evaluation prompts (``id``, ``category``, ``family``, ``prompt``), kinds interleaved."""
    return HELDOUT_FILE


def corpus_manifest() -> dict[str, Any]:
    """The packaged corpus as a data manifest (one corpus per kind, each file pinned by sha256)."""
    return json.loads(MANIFEST_FILE.read_text(encoding="utf-8"))
