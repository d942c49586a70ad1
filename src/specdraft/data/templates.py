"""Handwritten prompt templates, expanded deterministically into distinct prompts.

The templates file (``specdraft/assets/templates.json``)::

    {"schema_version": 1, "slots": {NAME: [values] | {"int": [lo, hi]}},
     "categories": {CATEGORY: {"slots": {...}, "templates": ["... {NAME} ..."]}}}

``{name}`` placeholders are filled from the category's slots, else the file's shared slots; a name used twice
in one template gets the same value. ``expand_templates`` visits the categories in turn (so they stay
balanced until one runs out of new prompts), picks a template and slot values with one seeded RNG, and keeps
the prompt if it is new.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLACEHOLDER_RE = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
MAX_CONSECUTIVE_REPEATS = 2000  # a category that yields no new prompt in this many tries is used up


class TemplateError(ValueError):
    """A templates file that cannot be used; the message names the file, category and template."""


@dataclass(frozen=True)
class TemplateSet:
    path: Path
    categories: dict[str, list[str]]
    slots: dict[str, dict[str, Any]]  # category -> slot name -> values (shared slots merged in)


def load_templates(path: str | os.PathLike) -> TemplateSet:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TemplateError(f"templates {path}: cannot read ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("categories"), dict) or not data["categories"]:
        raise TemplateError(f"templates {path}: expected an object with a non-empty 'categories' object")
    shared = data.get("slots", {})
    categories: dict[str, list[str]] = {}
    slots: dict[str, dict[str, Any]] = {}
    for cat, body in data["categories"].items():
        templates = body.get("templates") if isinstance(body, dict) else None
        if not isinstance(templates, list) or not templates or not all(isinstance(t, str) for t in templates):
            raise TemplateError(f"templates {path}, category {cat!r}: 'templates' must be a non-empty "
                                "list of strings")
        merged = {**shared, **body.get("slots", {})}
        for name, values in merged.items():
            _check_slot(path, cat, name, values)
        for t in templates:
            for name in PLACEHOLDER_RE.findall(t):
                if name not in merged:
                    raise TemplateError(f"templates {path}, category {cat!r}: template {t[:60]!r} uses "
                                        f"{{{name}}}, which no slot defines")
        categories[cat], slots[cat] = templates, merged
    return TemplateSet(path=path, categories=categories, slots=slots)


def _check_slot(path: Path, cat: str, name: str, values: Any) -> None:
    ok = (isinstance(values, list) and values and all(isinstance(v, str) for v in values)) or (
        isinstance(values, dict) and set(values) == {"int"} and isinstance(values["int"], list)
        and len(values["int"]) == 2 and all(isinstance(v, int) for v in values["int"])
        and values["int"][0] <= values["int"][1])
    if not ok:
        raise TemplateError(f"templates {path}, category {cat!r}: slot {name!r} must be a non-empty list "
                            'of strings or {"int": [lo, hi]}')


def _draw(rng: random.Random, values: Any) -> str:
    if isinstance(values, dict):
        lo, hi = values["int"]
        return str(rng.randint(lo, hi))
    return rng.choice(values)


def fill(template: str, values: dict[str, str]) -> str:
    return PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def expand_templates(tset: TemplateSet, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct ``(category, prompt)`` pairs; the same file, n and seed always give the same list."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    active = list(tset.categories)
    while len(out) < n and active:
        for cat in list(active):
            if len(out) >= n:
                break
            for _ in range(MAX_CONSECUTIVE_REPEATS):
                template = rng.choice(tset.categories[cat])
                values = {name: _draw(rng, tset.slots[cat][name]) for name in PLACEHOLDER_RE.findall(template)}
                text = fill(template, values)
                if text not in seen:
                    seen.add(text)
                    out.append((cat, text))
                    break
            else:  # no new prompt in MAX_CONSECUTIVE_REPEATS tries: this category is used up
                active.remove(cat)
    if len(out) < n:
        raise TemplateError(f"templates {tset.path}: only {len(out)} distinct prompts can be made, "
                            f"{n} were requested")
    return out
