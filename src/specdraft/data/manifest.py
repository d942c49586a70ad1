"""The data manifest: which corpora a run trains on, pinned (hub revision or file sha256) and licensed.

A manifest is a versioned JSON document (``schema_version`` 1)::

    {"schema_version": 1, "name": "...", "uses_eval_splits": false, "eval_examples_used_as_targets": false,
     "notes": "...", "corpora": [CorpusSpec, ...]}

``load_manifest(path)`` parses it and checks what a schema alone cannot: every hub corpus is pinned to a
commit, no train corpus reads an evaluation split, every local file exists with the declared sha256, and
every reader is known. Relative paths resolve against the manifest's own folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specdraft.core.io import COMMIT_RE, SHA256_RE, sha256_file
from specdraft.data.corpus import corpus_dir, corpus_manifest
from specdraft.data.readers import READERS

SCHEMA_VERSION = 1


# A split whose name contains one of these words is an evaluation split ("test_sft", "validation[:5%]").
EVAL_SPLIT_WORDS = {"validation", "valid", "val", "test", "dev", "eval", "evaluation", "heldout"}
# Readers that take one record to one prompt; "templates" belongs to kind "templates" only.
RECORD_READERS = tuple(READERS)
TEMPLATES_READER = "templates"


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the manifest, the corpus and the reason."""


class SourceRef(BaseModel):
    """Where a local file came from (recorded, not fetched): repository, commit, path(s), blob."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Field(description="source repository, e.g. 'openai/grade-school-math' (GitHub)")
    commit: str = Field(description="40-hex commit of the snapshot the file was taken from")
    paths: list[str] = Field(default_factory=list, description="path(s) inside the repository")
    blob: str | None = Field(default=None, description="git blob id of the source file, when copied as is")
    tree: str | None = Field(default=None, description="git tree id, when built from a folder")
    changes: str = Field(default="", description="what was changed from the source (empty: byte for byte)")


class CorpusSpec(BaseModel):
    """One training corpus. Which fields are required depends on ``kind`` (checked in a validator)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="unique corpus name; becomes the `source` of each prompt",
                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    kind: Literal["hf_dataset", "local_file", "packaged", "templates"] = Field(
        description="where the records come from: a hub dataset, a local file, a file of the corpus shipped in the "
                    "package (path relative to specdraft/assets/corpus), or the package's templates")
    role: Literal["train"] = Field(default="train", description="only training corpora are declared here")
    reader: str = Field(description=f"record reader: {', '.join(RECORD_READERS)} or {TEMPLATES_READER}")
    fields: dict[str, str] = Field(default_factory=dict,
                                   description="field mapping for the reader (reader key -> record key)")
    format: Literal["parquet", "jsonl", "json"] | None = Field(
        default=None, description="file format (local files; hub corpora are read through `datasets`)")
    license: str = Field(description="license of this corpus (SPDX id or a short phrase)")
    license_notes: str = Field(default="", description="upstream licenses, restrictions, caveats")
    count: int | None = Field(default=None, ge=0,
                              description="requested number of prompts after filtering (null: all)")
    # hub
    repo_id: str | None = Field(default=None, description="hub dataset id ORG/NAME (kind hf_dataset)")
    revision: str | None = Field(default=None, description="40-hex hub commit (kind hf_dataset)")
    split: str | None = Field(default=None, description="split to read; never an evaluation split")
    subset: str | None = Field(default=None, description="hub dataset config name, if any")
    # local files and templates
    path: str | None = Field(default=None, description="file path; relative to the manifest's folder")
    sha256: str | None = Field(default=None, description="sha256 of the file at `path`")
    source: SourceRef | None = Field(default=None, description="upstream origin of a local file")
    # templates
    seed: int = Field(default=0, description="templates: expansion seed")
    generate: int | None = Field(default=None, ge=1,
                                 description="templates: how many distinct prompts to expand "
                                             "(default: `count`, else 3000)")
    description: str = Field(default="", description="what this corpus is")

    @model_validator(mode="after")
    def _check_kind(self) -> CorpusSpec:
        missing = []
        if self.kind == "hf_dataset":
            missing = [f for f in ("repo_id", "revision", "split") if getattr(self, f) is None]
        elif self.kind in ("local_file", "packaged"):
            missing = [f for f in ("path", "sha256", "format") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"kind {self.kind!r} needs {', '.join(missing)}")
        if self.kind == "templates" and self.reader != TEMPLATES_READER:
            raise ValueError(f"kind 'templates' needs reader {TEMPLATES_READER!r}, not {self.reader!r}")
        return self


class DataManifest(BaseModel):
    """The whole manifest. The two flags are declarations the audit checks: they must be false."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(description="manifest schema version")
    name: str = Field(description="manifest name")
    uses_eval_splits: Literal[False] = Field(description="must be false: no corpus is an evaluation split")
    eval_examples_used_as_targets: Literal[False] = Field(
        description="must be false: no evaluation example is ever a training target")
    notes: str = Field(default="", description="free text: what this manifest is for, caveats")
    corpora: list[CorpusSpec] = Field(min_length=1, description="the training corpora, in priority order")

    @model_validator(mode="after")
    def _unique_names(self) -> DataManifest:
        names = [c.name for c in self.corpora]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"corpus names must be unique; repeated: {', '.join(dupes)}")
        return self


@dataclass
class LoadedManifest:
    """A validated manifest plus where it came from and its files resolved to absolute paths."""

    manifest: DataManifest
    path: Path | None  # None for the built-in default
    sha256: str
    raw: bytes
    resolved: dict[str, Path] = field(default_factory=dict)  # corpus name -> absolute file path

    @property
    def corpora(self) -> list[CorpusSpec]:
        return self.manifest.corpora


def is_eval_split(split: str) -> bool:
    words = re.split(r"[^a-z]+", split.lower())
    return any(w in EVAL_SPLIT_WORDS for w in words)


def templates_asset() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "templates.json"


def load_manifest(path: str | os.PathLike | None = None, *, check_files: bool = True) -> LoadedManifest:
    """Parse and validate a manifest file (None: the built-in default, the packaged corpus).

    Raises ManifestError naming the manifest and corpus for: a schema error, an unpinned hub revision,
    an evaluation split in a train corpus, an unknown reader, a missing local file, a sha256 mismatch
    (both hashes given).
    """
    if path is None:
        raw = (json.dumps(default_manifest_dict(), indent=2) + "\n").encode()
        where, base, mpath = "built-in default manifest", Path.cwd(), None
    else:
        mpath = Path(path)
        where = str(mpath)
        try:
            raw = mpath.read_bytes()
        except OSError as e:
            raise ManifestError(f"manifest {where}: cannot read ({e.strerror or e})") from e
        base = mpath.resolve().parent
    return _validate(raw, where, base, mpath, check_files)


def parse_manifest_dict(data: dict[str, Any], *, base: str | os.PathLike = ".",
                        check_files: bool = True) -> LoadedManifest:
    """Validate a manifest given as a dict (tests, programmatic use); relative paths resolve from `base`."""
    raw = (json.dumps(data, indent=2) + "\n").encode()
    return _validate(raw, "manifest (dict)", Path(base).resolve(), None, check_files)


def _validate(raw: bytes, where: str, base: Path, mpath: Path | None, check_files: bool) -> LoadedManifest:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ManifestError(f"manifest {where}: not valid JSON (line {e.lineno}: {e.msg})") from e
    try:
        manifest = DataManifest.model_validate(data)
    except ValidationError as e:
        raise ManifestError(f"manifest {where}: {_describe_validation(e, data)}") from e
    loaded = LoadedManifest(manifest=manifest, path=mpath, sha256=_sha256_bytes(raw), raw=raw)
    for corpus in manifest.corpora:
        label = f"manifest {where}, corpus {corpus.name!r}"
        if corpus.reader not in RECORD_READERS + (TEMPLATES_READER,):
            raise ManifestError(f"{label}: unknown reader {corpus.reader!r} "
                                f"(known: {', '.join(RECORD_READERS + (TEMPLATES_READER,))})")
        if corpus.kind != "templates" and corpus.reader == TEMPLATES_READER:
            raise ManifestError(f"{label}: reader 'templates' is only for kind 'templates'")
        if corpus.reader in READERS:
            reader = READERS[corpus.reader]
            unknown = sorted(set(corpus.fields) - set(reader.fields))
            if unknown:
                raise ManifestError(f"{label}: reader {corpus.reader!r} has no field(s) {', '.join(unknown)} "
                                    f"to map (it maps: {', '.join(reader.fields)})")
            absent = [k for k in reader.required_fields if not corpus.fields.get(k)]
            if absent:
                raise ManifestError(f"{label}: reader {corpus.reader!r} needs fields.{absent[0]} "
                                    "(the record field to read)")
        if corpus.split is not None and is_eval_split(corpus.split):
            raise ManifestError(f"{label}: split {corpus.split!r} is an evaluation split; a train corpus "
                                "must not read validation/test/dev/eval data")
        if corpus.kind == "hf_dataset":
            if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", corpus.repo_id or ""):
                raise ManifestError(f"{label}: repo_id {corpus.repo_id!r} is not ORG/NAME")
            if not COMMIT_RE.fullmatch(corpus.revision or ""):
                raise ManifestError(f"{label}: revision {corpus.revision!r} is not pinned; give the full "
                                    "40-hex commit (a branch or tag can move under the same name)")
        if corpus.source is not None and not COMMIT_RE.fullmatch(corpus.source.commit):
            raise ManifestError(f"{label}: source.commit {corpus.source.commit!r} is not a 40-hex commit")
        if corpus.sha256 is not None and not SHA256_RE.fullmatch(corpus.sha256):
            raise ManifestError(f"{label}: sha256 {corpus.sha256!r} is not 64 lowercase hex digits")
        if corpus.kind == "templates" and corpus.path is None:
            loaded.resolved[corpus.name] = templates_asset()
        elif corpus.kind == "packaged":
            loaded.resolved[corpus.name] = _packaged_path(label, corpus.path)
        elif corpus.path is not None:
            p = Path(corpus.path).expanduser()
            loaded.resolved[corpus.name] = (p if p.is_absolute() else base / p).resolve()
        if check_files and corpus.name in loaded.resolved:
            _check_file(label, loaded.resolved[corpus.name], corpus.sha256)
    return loaded


def _packaged_path(label: str, path: str) -> Path:
    """A packaged corpus file: a relative path inside the package's corpus dir, never outside it."""
    root = corpus_dir().resolve()
    resolved = (root / path).resolve()
    if Path(path).is_absolute() or root not in resolved.parents:
        raise ManifestError(f"{label}: packaged path {path!r} must be relative to the package's corpus dir {root}")
    return resolved


def _check_file(label: str, path: Path, expected: str | None) -> None:
    if not path.is_file():
        raise ManifestError(f"{label}: file {path} does not exist")
    if expected is not None:
        actual = sha256_file(path)
        if actual != expected:
            raise ManifestError(f"{label}: sha256 mismatch for {path}: manifest says {expected}, "
                                f"file has {actual}")


def _describe_validation(e: ValidationError, data: Any) -> str:
    parts = []
    for err in e.errors():
        loc = list(err["loc"])
        if len(loc) >= 2 and loc[0] == "corpora" and isinstance(loc[1], int):
            try:
                name = data["corpora"][loc[1]].get("name", f"#{loc[1]}")
            except (KeyError, IndexError, TypeError, AttributeError):
                name = f"#{loc[1]}"
            rest = ".".join(str(x) for x in loc[2:])
            parts.append(f"corpus {name!r}{' field ' + rest if rest else ''}: {err['msg']}")
        else:
            parts.append(f"{'.'.join(str(x) for x in loc) or 'top level'}: {err['msg']}")
    return "; ".join(parts)


def _sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def default_manifest_dict() -> dict[str, Any]:
    """The built-in default: the prompt corpus shipped in the package (``data.corpus``), what
    `configs/manifest.default.json` holds, verbatim."""
    return corpus_manifest()
