"""What a drafter is, as data: its role, whether it drafts behind prompt lookup, which side-by-side variant of the
configured draft it is, and the engine it runs in. ``DrafterSpec.name`` is the key every report uses ("draft",
"draft-prob", "draft+lookup", "self-4bit", an ``--also-draft`` NAME, ...); ``label`` and ``description`` say what
it is in a table's row. A report records each drafter's spec beside its name (``speculate.json``'s
``drafter_specs``), so a reader reads the role instead of parsing the name."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

Engine = Literal["torch", "llama.cpp"]
Role = Literal[
    "draft",  # the --draft model: in process (torch) or a GGUF file (llama.cpp)
    "server",  # the --draft URL: the draft server over HTTP
    "lookup",  # specdraft's prompt lookup, no model
    "self",  # the target's own weights as its draft (torch: an --also-draft named self; llama.cpp: its own file)
    "ngram",  # llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding)
    "self-4bit",  # llama.cpp: the target's own 4-bit file drafting for the target at F32
    "named",  # any other --also-draft NAME (``alias``)
    "init",  # the draft before training: eval's, never run by speculate
]
# The side-by-side variants of an in-process draft, each differing from the draft as configured in one setting
Variant = Literal["prob", "eager", "hf", "reprefill"]

ENGINES: tuple[str, ...] = get_args(Engine)
ROLES: tuple[str, ...] = get_args(Role)
VARIANTS: tuple[str, ...] = get_args(Variant)
ROLES_BY_ENGINE = {"torch": ("draft", "server", "lookup", "self", "named", "init"),
                   "llama.cpp": ("draft", "lookup", "self", "ngram", "self-4bit", "named")}
IN_PROCESS_ROLES = ("draft", "self", "named")  # draft models in specdraft's own engine: the ones with variants

# (label, description) per engine, role and behind lookup: the demo summary's tables word for word (its "trained"
# rows are eval's, the server's), plus the in-process draft's line, which those tables did not have
ABOUT: dict[tuple[str, str, bool], tuple[str, str]] = {
    ("torch", "draft", False): ("trained draft", "the draft after training, packed to 4 bits, in process"),
    ("torch", "server", False): ("trained draft", "the draft after training, packed to 4 bits and served over HTTP "
                                                  "(`POST /draft`)"),
    ("torch", "draft", True): ("trained draft behind lookup", "prompt lookup where the context's last tokens "
                                                              "occurred before, the trained draft elsewhere"),
    ("torch", "lookup", False): ("prompt lookup", "no model: copies what followed the context's last tokens where "
                                                  "they occurred before"),
    ("torch", "self", False): ("self-draft", "the target's own weights packed to 4 bits, untrained: the CPU "
                                             "reference"),
    ("torch", "init", False): ("untrained init", "the draft before training (the target's layers it keeps, "
                                                 "unchanged)"),
    ("llama.cpp", "draft", False): ("trained draft", "the trained draft as exported for llama.cpp "
                                                     "(`RUN_DIR/export/draft.gguf`)"),
    ("llama.cpp", "draft", True): ("trained draft behind lookup", "prompt lookup where it finds the context's last "
                                                                  "tokens, the exported draft elsewhere"),
    ("llama.cpp", "self", False): ("self-draft", "the target's own GGUF file (its 4-bit weights) as its draft"),
    ("llama.cpp", "ngram", False): ("n-gram lookup", "llama-cpp-python's own prompt lookup "
                                                     "(LlamaPromptLookupDecoding)"),
    ("llama.cpp", "lookup", False): ("prompt lookup", "specdraft's prompt lookup, as in the table above"),
    ("llama.cpp", "self-4bit", False): ("4-bit self-draft", "the target's own 4-bit file drafting for the target at "
                                                            "F32"),
}
ABOUT[("torch", "server", True)] = ABOUT[("torch", "draft", True)]  # the server behind lookup reads the same
NAMED_ABOUT = {"torch": "an --also-draft model dir, in process", "llama.cpp": "an --also-draft GGUF file"}
VARIANT_ABOUT = {"prob": "probability stop rule", "eager": "eager steps", "hf": "transformers' forward",
                 "reprefill": "re-prefilled every step"}


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter of a run. ``variant``: which side-by-side variant of an in-process draft (None: as configured);
    ``alias``: the NAME of an ``--also-draft`` (role "named")."""

    role: Role
    engine: Engine = "torch"
    behind_lookup: bool = False
    variant: Variant | None = None
    alias: str | None = None

    def __post_init__(self):
        if self.engine not in ENGINES or self.role not in ROLES_BY_ENGINE[self.engine]:
            raise ValueError(f"drafter spec {self}: role {self.role!r} is none of engine {self.engine!r}'s "
                             f"{ROLES_BY_ENGINE.get(self.engine, ())}")
        if (self.role == "named") != bool(self.alias):
            raise ValueError(f"drafter spec {self}: an alias names role 'named', and only it")
        if self.behind_lookup and self.role not in ("draft", "server"):
            raise ValueError(f"drafter spec {self}: only the --draft (model or server) drafts behind lookup")
        if self.variant is not None and (self.variant not in VARIANTS or self.engine != "torch"
                                         or self.role not in IN_PROCESS_ROLES or self.behind_lookup
                                         or (self.variant != "prob" and self.role != "draft")):
            raise ValueError(f"drafter spec {self}: variant {self.variant!r} does not apply")

    @property
    def name(self) -> str:
        """The report's key: role (or alias), '-variant', and the --draft behind lookup as 'draft+lookup' (the
        server's too)."""
        if self.behind_lookup:
            return "draft+lookup"
        base = self.alias if self.role == "named" else self.role
        return f"{base}-{self.variant}" if self.variant else base

    @property
    def label(self) -> str:
        """A few words for a table's row."""
        label = ABOUT[self._about_key][0] if self.role != "named" else self.alias
        return f"{label} ({VARIANT_ABOUT[self.variant]})" if self.variant else label

    @property
    def description(self) -> str:
        """One line: what the drafter is."""
        text = ABOUT[self._about_key][1] if self.role != "named" else NAMED_ABOUT[self.engine]
        return f"{text}; {VARIANT_ABOUT[self.variant]}" if self.variant else text

    @property
    def _about_key(self) -> tuple[str, str, bool]:
        return self.engine, self.role, self.behind_lookup

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "DrafterSpec":
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"drafter spec {data}: unknown fields {sorted(unknown)}")
        return cls(**data)


# The names speculate gives its own drafters (and the baseline): an --also-draft NAME must not take one of them
RESERVED_NAMES = frozenset({"baseline", "lookup", "server", DrafterSpec("draft", behind_lookup=True).name}
                           | {DrafterSpec("draft", variant=v).name for v in (None, *VARIANTS)})
# and the names the llama.cpp engine gives its own extra drafters
LLAMA_CPP_RESERVED_NAMES = frozenset({DrafterSpec("ngram", "llama.cpp").name, DrafterSpec("self", "llama.cpp").name})
