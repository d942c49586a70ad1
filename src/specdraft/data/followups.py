"""The follow-ups and passage requests written for specdraft (``assets/followups.json``, Apache-2.0): what
`specdraft conversations` asks the target after its own first answer where the data brings no second user turn of
its own, and the requests that carry one of the target's answers as a passage to reuse (summarise, translate, answer
from the text). Each is picked for a row by a seeded hash of the row's id, so a plan does not move when rows are
added or reordered."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

FOLLOWUPS_FILE = Path(__file__).resolve().parent.parent / "assets" / "followups.json"
PASSAGE_SLOT = "{passage}"


@dataclass(frozen=True)
class Request:
    """One packaged request: its name (recorded in each row made from it) and its text (a passage request holds
    ``{passage}`` once)."""

    name: str
    text: str

    def with_passage(self, passage: str) -> str:
        return self.text.replace(PASSAGE_SLOT, passage)


def load_requests(path: Path = FOLLOWUPS_FILE) -> tuple[list[Request], list[Request]]:
    """(follow-ups, passage requests) of the packaged file; names unique, each passage request with one slot."""
    data = json.loads(path.read_text(encoding="utf-8"))
    followups = [Request(r["name"], r["text"]) for r in data["followups"]]
    passages = [Request(r["name"], r["template"]) for r in data["passages"]]
    for kind, requests in (("followups", followups), ("passages", passages)):
        names = [r.name for r in requests]
        if not requests or len(set(names)) != len(names):
            raise ValueError(f"{path}: {kind} must be a non-empty list with unique names")
    bad = [r.name for r in passages if r.text.count(PASSAGE_SLOT) != 1]
    if bad:
        raise ValueError(f"{path}: passage request(s) {bad} must hold {PASSAGE_SLOT} exactly once")
    return followups, passages


def pick(requests: Sequence[Request], seed: int, key: str) -> Request:
    """The request for the row ``key`` under ``seed``: the same for the same pair, whatever else is picked."""
    return random.Random(f"{seed}/{key}").choice(list(requests))
