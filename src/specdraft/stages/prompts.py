"""`specdraft prompts`: every corpus of a manifest -> one deduplicated, decontaminated prompts.jsonl.

Order of the filters (each drop is counted per corpus under its reason):
  malformed -> no_prompt -> empty -> too_long (target tokenizer) -> contaminated (13-gram vs eval sets)
  -> duplicate (exact, after whitespace collapse) -> near_duplicate (MinHash LSH) -> over_quota.
A clean prompt whose reference answer shares an n-gram with the eval sets keeps the prompt but loses the answer
(`specdraft label` trains on answers), counted per corpus as response_contaminated; likewise a chat's follow-up
(the user's second turn, which `specdraft conversations` asks after the target's first answer), counted as
followup_contaminated.
Earlier corpora in the manifest win duplicates. Quotas are sampled per corpus with a seeded RNG.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_bytes, atomic_write_json, jsonl_line, sha256_bytes, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.data.manifest import CorpusSpec, LoadedManifest, load_manifest
from specdraft.data.readers import (
    READERS,
    DataSourceError,
    MalformedRecord,
    Record,
    get_followup_reader,
    get_reader,
    get_response_reader,
    iter_file_records,
    load_hub_records,
    read_eval_prompts,
)
from specdraft.data.templates import expand_templates, load_templates
from specdraft.data.text import dedup_key, near_duplicates, ngram_overlap, normalise_prompt
from specdraft.model.specs import DEFAULT_TARGET, load_tokenizer, resolve_model, tokenizer_fingerprint

log = logging.getLogger(__name__)


DROP_REASONS = ("malformed", "no_prompt", "empty", "too_long", "contaminated", "duplicate", "near_duplicate",
                "over_quota")
MAX_REPORTED = 50  # malformed locations / contamination examples kept in the stats per corpus
TOKEN_BATCH = 1024
DEFAULT_TEMPLATE_COUNT = 3000


class PromptsConfig(StageConfig):
    """Build prompts.jsonl from a data manifest."""

    manifest: str | None = Field(
        default=None, description="data manifest JSON; default: the prompt corpus shipped in the package "
                                  "(the same as configs/manifest.default.json)")
    out: str = Field(description="output prompts.jsonl; prompts.stats.json, data_manifest.json and "
                                 "prompts.log are written beside it")
    tokenizer: str = Field(default=DEFAULT_TARGET,
                           description="model spec whose tokenizer counts prompt tokens (the target's)")
    max_prompt_tokens: int = Field(default=1024, ge=1,
                                   description="drop prompts longer than this many tokens")
    eval_set: list[str] = Field(default=[],
                                description="evaluation prompt file (repeatable): training prompts sharing a "
                                            "word n-gram with it are dropped")
    contamination_ngram: int = Field(default=13, ge=1, description="n of the word n-gram contamination check")
    near_dup: bool = Field(default=True, description="drop near-duplicates (MinHash LSH over word 3-grams)")
    near_dup_threshold: float = Field(default=0.8, gt=0.0, le=1.0,
                                      description="estimated Jaccard similarity at which a prompt is a "
                                                  "near-duplicate")
    minhash_perm: int = Field(default=64, ge=8, le=512, description="MinHash permutations")
    seed: int = Field(default=0, description="seed for quota sampling and the output order")
    shuffle: bool = Field(default=True, description="shuffle the output (seeded); else manifest order")


@dataclass
class Candidate:
    corpus: str
    index: int  # ordinal of the record in its source
    text: str
    tokens: int = 0
    response: str | None = None  # the record's reference answer, for `specdraft label`
    followup: str | None = None  # a chat's second user turn, for `specdraft conversations`


@dataclass
class CorpusStats:
    name: str
    kind: str
    requested: int | None
    read: int = 0
    kept: int = 0
    tokens: int = 0  # prompt tokens of the kept prompts
    with_response: int = 0  # kept prompts that carry the record's reference answer
    response_contaminated: int = 0  # answers removed for an eval n-gram (counted before dedup and quotas)
    with_followup: int = 0  # kept prompts that carry the chat's second user turn
    followup_contaminated: int = 0  # follow-ups removed for an eval n-gram (counted before dedup and quotas)
    dropped: Counter = field(default_factory=Counter)
    malformed_examples: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        shortfall = max(0, self.requested - self.kept) if self.requested is not None else 0
        return {"kind": self.kind, "read": self.read, "kept": self.kept, "requested": self.requested,
                "shortfall": shortfall, "prompt_tokens": self.tokens, "with_response": self.with_response,
                "response_contaminated": self.response_contaminated,
                "with_followup": self.with_followup, "followup_contaminated": self.followup_contaminated,
                "dropped": {r: self.dropped.get(r, 0) for r in DROP_REASONS},
                "malformed_examples": self.malformed_examples, **self.source}


@dataclass
class PromptsResult:
    out: Path
    stats_path: Path
    total: int
    per_corpus: dict[str, int]
    contaminated: int


def build_prompts(cfg: PromptsConfig) -> PromptsResult:
    """The stage: read, filter, sample and write prompts.jsonl with its stats and provenance."""
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with stage_log(out.parent / "prompts.log"):
        return _build(cfg, out)


def _build(cfg: PromptsConfig, out: Path) -> PromptsResult:
    started = time.time()
    loaded = load_manifest(cfg.manifest)
    log.info("manifest %s (sha256 %s): %d corpora", cfg.manifest or "built-in default", loaded.sha256,
             len(loaded.corpora))
    eval_sets, eval_texts = _read_eval_sets(cfg.eval_set)
    stats, candidates = _read_corpora(loaded)
    tokenizer_info, candidates = _drop_too_long(cfg, candidates, stats)
    candidates, examples, response_examples = _decontaminate(cfg, candidates, eval_texts, stats)
    candidates = _drop_duplicates(candidates, stats)
    if cfg.near_dup:
        candidates = _drop_near_duplicates(cfg, candidates, stats)
    final = _select(cfg, candidates, loaded.corpora, stats)
    payload, manifest_copy = _write_prompts(out, final, loaded)

    for name, st in stats.items():
        if st.requested is not None and st.kept < st.requested:
            log.warning("%s: %d prompts kept, %d requested", name, st.kept, st.requested)
    dropped_total: Counter = Counter()
    for st in stats.values():
        dropped_total.update(st.dropped)
    summary = {
        "prompts": out.name,
        "prompts_sha256": sha256_bytes(payload),
        "total": len(final),
        "prompt_tokens": sum(c.tokens for c in final),
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "corpora": {name: st.to_json() for name, st in stats.items()},
        "dropped_total": {r: dropped_total.get(r, 0) for r in DROP_REASONS},
        "contamination": {
            "ngram": cfg.contamination_ngram,
            "eval_sets": eval_sets,
            "eval_prompts": len(eval_texts),
            "dropped": dropped_total.get("contaminated", 0),
            "examples": examples,
            "responses_removed": sum(st.response_contaminated for st in stats.values()),
            "followups_removed": sum(st.followup_contaminated for st in stats.values()),
            "response_examples": response_examples,
        },
        "provenance": _provenance(cfg, loaded, manifest_copy, stats, tokenizer_info, started),
    }
    stats_path = out.with_name(out.stem + ".stats.json")
    atomic_write_json(stats_path, summary)
    log.info("wrote %d prompts to %s (%.1fs); dropped %s", len(final), out, time.time() - started,
             dict((r, n) for r, n in summary["dropped_total"].items() if n))
    return PromptsResult(out=out, stats_path=stats_path, total=len(final),
                         per_corpus={n: st.kept for n, st in stats.items()},
                         contaminated=dropped_total.get("contaminated", 0))


def _read_corpora(loaded: LoadedManifest) -> tuple[dict[str, CorpusStats], list[Candidate]]:
    """Every corpus's prompts, in manifest order, and its stats so far."""
    stats: dict[str, CorpusStats] = {}
    candidates: list[Candidate] = []
    for corpus in loaded.corpora:
        st = CorpusStats(corpus.name, corpus.kind, corpus.count)
        stats[corpus.name] = st
        found = _read_corpus(corpus, loaded, st)
        log.info("%s: read %d records, %d prompts", corpus.name, st.read, len(found))
        candidates.extend(found)
    return stats, candidates


def _drop_too_long(cfg: PromptsConfig, candidates: list[Candidate],
                   stats: dict[str, CorpusStats]) -> tuple[dict[str, Any], list[Candidate]]:
    """Count every prompt's tokens (one batched pass of the target's fast tokenizer) and drop the too long;
    returns what the tokenizer was, and the rest."""
    tokenizer_info, lengths = _token_lengths(cfg.tokenizer, [c.text for c in candidates])
    for c, n in zip(candidates, lengths, strict=True):
        c.tokens = n
    return tokenizer_info, _drop(candidates, [n > cfg.max_prompt_tokens for n in lengths], "too_long", stats)


def _decontaminate(cfg: PromptsConfig, candidates: list[Candidate], eval_texts: list[str],
                   stats: dict[str, CorpusStats]) -> tuple[list[Candidate], list[dict[str, Any]], list[dict[str, Any]]]:
    """Drop the prompts sharing an n-gram with the evaluation sets and strip such reference answers; returns the
    rest, and examples of the dropped prompts and of the stripped answers (up to MAX_REPORTED each)."""
    if not eval_texts:
        return candidates, [], []
    offending = ngram_overlap([c.text for c in candidates], eval_texts, cfg.contamination_ngram)
    bad = [False] * len(candidates)
    examples: list[dict[str, Any]] = []
    for i, gram in offending:
        bad[i] = True
        if len(examples) < MAX_REPORTED:
            c = candidates[i]
            examples.append({"source": c.corpus, "index": c.index, "ngram": gram})
    candidates = _drop(candidates, bad, "contaminated", stats)
    log.info("contamination: %d prompts share a %d-gram with the eval sets", len(offending), cfg.contamination_ngram)
    response_examples = [example for field in ("response", "followup")
                         for example in _strip_contaminated(candidates, field, eval_texts, cfg.contamination_ngram,
                                                            stats)]
    return candidates, examples, response_examples


def _drop_duplicates(candidates: list[Candidate], stats: dict[str, CorpusStats]) -> list[Candidate]:
    """Exact duplicates after whitespace collapse (earlier corpora win)."""
    seen: set[str] = set()
    dup = []
    for c in candidates:
        key = dedup_key(c.text)
        dup.append(key in seen)
        seen.add(key)
    return _drop(candidates, dup, "duplicate", stats)


def _drop_near_duplicates(cfg: PromptsConfig, candidates: list[Candidate],
                          stats: dict[str, CorpusStats]) -> list[Candidate]:
    t = time.time()
    near = near_duplicates([c.text for c in candidates], cfg.near_dup_threshold, cfg.minhash_perm)
    flags = [False] * len(candidates)
    for i, _ in near:
        flags[i] = True
    log.info("near-duplicates: %d (%.1fs)", len(near), time.time() - t)
    return _drop(candidates, flags, "near_duplicate", stats)


def _select(cfg: PromptsConfig, candidates: list[Candidate], corpora: list[CorpusSpec],
            stats: dict[str, CorpusStats]) -> list[Candidate]:
    """The prompts written: each corpus's quota (seeded sample), in seeded order unless --no-shuffle, counted
    in the stats as kept."""
    final = _apply_quotas(candidates, corpora, stats, cfg.seed)
    if not final:
        raise DataSourceError(f"manifest {cfg.manifest or 'built-in default'}: no prompt survived the filters "
                              "(see prompts.stats.json)")
    if cfg.shuffle:
        random.Random(f"{cfg.seed}/order").shuffle(final)
    for c in final:
        stats[c.corpus].kept += 1
        stats[c.corpus].tokens += c.tokens
        stats[c.corpus].with_response += c.response is not None
        stats[c.corpus].with_followup += c.followup is not None
    return final


def _write_prompts(out: Path, final: list[Candidate], loaded: LoadedManifest) -> tuple[bytes, Path]:
    """prompts.jsonl, and the manifest copied beside it; returns the file's bytes and the copy's path."""
    width = max(6, len(str(max(c.index for c in final))))
    lines = [jsonl_line({"id": f"{c.corpus}-{c.index:0{width}d}", "source": c.corpus, "prompt": c.text,
                         **({"response": c.response} if c.response is not None else {}),
                         **({"followup": c.followup} if c.followup is not None else {})})
             for c in final]
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    atomic_write_bytes(out, payload)
    manifest_copy = out.parent / "data_manifest.json"
    atomic_write_bytes(manifest_copy, loaded.raw)
    return payload, manifest_copy


def _provenance(cfg: PromptsConfig, loaded: LoadedManifest, manifest_copy: Path, stats: dict[str, CorpusStats],
                tokenizer_info: dict[str, Any], started: float) -> dict[str, Any]:
    """Where the prompts came from: the manifest (and its copy), the corpus files' hashes, the tokenizer, the
    config and the run."""
    return {
        "manifest": {
            "path": cfg.manifest,
            "resolved_path": str(loaded.path.resolve()) if loaded.path else None,
            "builtin_default": loaded.path is None,
            "sha256": loaded.sha256,
            "copy": manifest_copy.name,
            "content": json.loads(loaded.raw),
        },
        "files": [{"corpus": name, **{k: v for k, v in st.source.items()
                                      if k in ("path", "resolved_path", "sha256")}}
                  for name, st in stats.items() if "resolved_path" in st.source],
        "tokenizer": tokenizer_info,
        "config": cfg.to_json_dict(),
        "run": run_metadata(),
        "seconds": round(time.time() - started, 2),
    }


def _read_eval_sets(paths: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    records, texts = [], []
    for p in paths:
        prompts = read_eval_prompts(p)
        records.append({"path": p, "resolved_path": str(Path(p).resolve()), "sha256": sha256_file(p),
                        "prompts": len(prompts)})
        texts.extend(prompts)
        log.info("eval set %s: %d prompts", p, len(prompts))
    return records, texts


def _read_corpus(corpus: CorpusSpec, loaded: LoadedManifest, st: CorpusStats) -> list[Candidate]:
    if corpus.kind == "templates":
        path = loaded.resolved[corpus.name]
        n = corpus.generate or corpus.count or DEFAULT_TEMPLATE_COUNT
        pairs = expand_templates(load_templates(path), n, corpus.seed)
        st.source = {"path": corpus.path, "resolved_path": str(path), "sha256": sha256_file(path),
                     "generated": n, "seed": corpus.seed}
        st.read = len(pairs)
        return _keep_texts(st, [(i, text, None, None) for i, (_, text) in enumerate(pairs)])

    if corpus.kind in ("local_file", "packaged"):
        path = loaded.resolved[corpus.name]
        st.source = {"path": corpus.path, "resolved_path": str(path), "sha256": corpus.sha256,
                     "format": corpus.format, "license": corpus.license}
        records = iter_file_records(path, corpus.format)
    else:
        reader = READERS[corpus.reader]
        columns = sorted({reader.fields[k] for k in reader.fields} | set(corpus.fields.values()))
        records, meta = load_hub_records(corpus.repo_id, corpus.revision, corpus.split, corpus.subset, columns)
        st.source = {"repo_id": corpus.repo_id, "revision": corpus.revision, "split": corpus.split,
                     "subset": corpus.subset, "license": corpus.license, **meta}
    read = get_reader(corpus.reader, corpus.fields)
    read_response = get_response_reader(corpus.reader, corpus.fields)
    read_followup = get_followup_reader(corpus.reader, corpus.fields)
    texts: list[tuple[int, str, str | None, str | None]] = []
    for rec in records:
        st.read += 1
        text = _read_one(rec, read, st)
        if text is not None:
            texts.append((rec.index, text, read_response(rec.data), read_followup(rec.data)))
    if st.read and st.dropped["malformed"] == st.read:
        log.warning("%s: every record is malformed for reader %r (wrong reader or field mapping?)",
                    corpus.name, corpus.reader)
    return _keep_texts(st, texts)


def _read_one(rec: Record, read, st: CorpusStats) -> str | None:
    error = rec.error
    if error is None:
        try:
            text = read(rec.data)
        except MalformedRecord as e:
            error = str(e)
        else:
            if text is None:
                st.dropped["no_prompt"] += 1
            return text
    st.dropped["malformed"] += 1
    message = f"{rec.location}: {error}"
    if len(st.malformed_examples) < MAX_REPORTED:
        st.malformed_examples.append(message)
        log.warning("malformed record %s", message)
    return None


def _keep_texts(st: CorpusStats, texts: list[tuple[int, str, str | None, str | None]]) -> list[Candidate]:
    out = []
    for index, raw, response, followup in texts:
        text = normalise_prompt(raw)
        if not text:
            st.dropped["empty"] += 1
            continue
        response = response.strip() if response else None  # kept verbatim inside: code needs its layout
        followup = normalise_prompt(followup) if followup else None  # a user turn, normalised as prompts are
        out.append(Candidate(st.name, index, text, response=response or None, followup=followup or None))
    return out


def _strip_contaminated(candidates: list[Candidate], field: Literal["response", "followup"], eval_texts: list[str],
                        n: int, stats: dict[str, CorpusStats]) -> list[dict[str, Any]]:
    """Remove the ``field`` texts (a reference answer, or a chat's second user turn) that share an n-gram with the
    eval sets, the prompt kept (it is clean), counted per corpus as ``<field>_contaminated``; returns up to
    MAX_REPORTED examples, each naming its field."""
    holding = [c for c in candidates if getattr(c, field) is not None]
    counter = f"{field}_contaminated"
    examples = []
    for i, gram in ngram_overlap([getattr(c, field) for c in holding], eval_texts, n):
        c = holding[i]
        setattr(c, field, None)
        setattr(stats[c.corpus], counter, getattr(stats[c.corpus], counter) + 1)
        if len(examples) < MAX_REPORTED:
            examples.append({"source": c.corpus, "index": c.index, "ngram": gram, "field": field})
    if holding:
        log.info("contamination: %d %ss share a %d-gram with the eval sets (removed, prompts kept)",
                 sum(getattr(st, counter) for st in stats.values()), field, n)
    return examples


def _token_lengths(spec: str, texts: list[str]) -> tuple[dict[str, Any], list[int]]:
    path = resolve_model(spec)  # once: an embedded spec hashes its GGUF on every resolve
    tok = load_tokenizer(path)
    info = {"spec": spec, "path": str(path), "class": type(tok).__name__,
            "fast": bool(getattr(tok, "is_fast", False)), "fingerprint": tokenizer_fingerprint(tok)}
    lengths: list[int] = []
    t = time.time()
    for start in range(0, len(texts), TOKEN_BATCH):
        batch = texts[start:start + TOKEN_BATCH]
        enc = tok(batch, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        lengths.extend(len(ids) for ids in enc)
    log.info("token counts for %d prompts in %.1fs", len(texts), time.time() - t)
    return info, lengths


def _drop(candidates: list[Candidate], flags: list[bool], reason: str,
          stats: dict[str, CorpusStats]) -> list[Candidate]:
    kept = []
    for c, bad in zip(candidates, flags, strict=True):
        if bad:
            stats[c.corpus].dropped[reason] += 1
        else:
            kept.append(c)
    return kept


def _apply_quotas(candidates: list[Candidate], corpora: list[CorpusSpec], stats: dict[str, CorpusStats],
                  seed: int) -> list[Candidate]:
    by_corpus: dict[str, list[Candidate]] = {c.name: [] for c in corpora}
    for c in candidates:
        by_corpus[c.corpus].append(c)
    final: list[Candidate] = []
    for corpus in corpora:
        pool = by_corpus[corpus.name]
        if corpus.count is not None and len(pool) > corpus.count:
            chosen = sorted(random.Random(f"{seed}/{corpus.name}").sample(range(len(pool)), corpus.count))
            stats[corpus.name].dropped["over_quota"] += len(pool) - corpus.count
            pool = [pool[i] for i in chosen]
        final.extend(pool)
    return final
