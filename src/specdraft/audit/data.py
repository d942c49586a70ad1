"""The data link: the prompts trained on come from declared, pinned training corpora and never from the
evaluation set.

It proves that the manifest copy is the one prompts.jsonl was built from, declares no evaluation split and pins
every corpus (hub datasets to a 40-hex commit, files to a sha256 they still have); that every prompt names a
declared corpus, in the recorded counts; and that no prompt, no trace completion and no labelled reference
answer trained on shares a word n-gram (13 unless recorded otherwise) with an evaluation prompt.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from specdraft.audit.context import AuditContext, lookup, short
from specdraft.core.io import COMMIT_RE
from specdraft.data.manifest import ManifestError, default_manifest_dict, is_eval_split, load_manifest, templates_asset
from specdraft.data.readers import read_eval_prompts
from specdraft.data.text import ngram_overlap


def audit_data(ctx: AuditContext) -> None:
    ctx.section = "data"
    p = ctx.paths
    ctx.expect([(p.prompts, "training prompts, written by specdraft prompts"),
                (p.prompts_stats, "written by specdraft prompts"),
                (p.manifest, "copy of the data manifest, written by specdraft prompts")])
    manifest = ctx.guard("manifest", lambda: _manifest(ctx))
    ctx.guard("prompts", lambda: _prompts(ctx, manifest))
    eval_sets = ctx.guard("eval sets", lambda: _eval_sets(ctx)) or []
    if manifest is not None:
        ctx.guard("no eval split", lambda: _no_eval_split(ctx, manifest, eval_sets))
    ctx.guard("contamination", lambda: _contamination(ctx, eval_sets))


def _corpus_stats(stats: dict | None, name: str) -> dict:
    """prompts.stats.json's record of one corpus (corpus names may contain dots)."""
    rec = ((stats or {}).get("corpora") or {}).get(name)
    return rec if isinstance(rec, dict) else {}


def _manifest(ctx: AuditContext):
    p, stats = ctx.paths.manifest, ctx.stats
    if not p.is_file():
        return None
    try:
        loaded = load_manifest(p, check_files=False)
    except ManifestError as e:
        ctx.add("manifest valid", "fail", str(e), [ctx.cite(p)])
        return None
    m = loaded.manifest
    ctx.add("manifest valid", "pass",
            f"schema v{m.schema_version}, {len(m.corpora)} corpora ({', '.join(c.name for c in m.corpora)})",
            [ctx.cite(p, "corpora")])
    if stats is not None:
        ctx.check_equal("manifest sha256", loaded.sha256, lookup(stats, "provenance.manifest.sha256"),
                        "the manifest copy and the one prompts.jsonl was built from (sha256)",
                        [ctx.cite(p), ctx.cite(ctx.paths.prompts_stats, "provenance.manifest.sha256")], short)
        prov = lookup(stats, "provenance.manifest") or {}
        original = prov.get("resolved_path")
        if prov.get("builtin_default"):
            same = (json.dumps(default_manifest_dict(), indent=2) + "\n").encode() == loaded.raw
            ctx.add("manifest source", "pass" if same else "warn",
                    "built-in default manifest" + ("" if same else " (the copy differs from today's built-in "
                                                                    "default: the code changed since)"),
                    [ctx.cite(ctx.paths.prompts_stats, "provenance.manifest.builtin_default")])
        elif original and Path(original).is_file():
            same = Path(original).read_bytes() == loaded.raw
            ctx.add("manifest source", "pass" if same else "warn",
                    f"{original} " + ("is unchanged" if same else "has changed since the run (the copy is what "
                                                                   "was used)"),
                    [ctx.cite(ctx.paths.prompts_stats, "provenance.manifest.resolved_path")])
        else:
            ctx.add("manifest source", "warn", f"the original manifest {original!r} is not on this machine; "
                                               "the copy is audited",
                    [ctx.cite(ctx.paths.prompts_stats, "provenance.manifest.resolved_path")])
    for flag in ("uses_eval_splits", "eval_examples_used_as_targets"):
        value = getattr(m, flag)
        ctx.add("manifest declarations", "pass" if value is False else "fail", f"{flag} = {value}",
                [ctx.cite(p, flag)])
    for i, c in enumerate(m.corpora):
        _corpus_pin(ctx, p, i, c, loaded)
    return loaded


def _declared_names(ctx: AuditContext, loaded) -> set[str] | None:
    """The corpus names of the manifest; from its raw JSON when it does not load (the sources check can still
    use them); None when there is no readable manifest."""
    if loaded is not None:
        return {c.name for c in loaded.corpora}
    try:
        corpora = json.loads(ctx.paths.manifest.read_text(encoding="utf-8")).get("corpora") or []
        return {str(c.get("name")) for c in corpora if isinstance(c, dict)}
    except (OSError, ValueError, AttributeError):
        return None


def _corpus_file(ctx: AuditContext, name: str, declared: str | None, loaded) -> Path | None:
    """Where the corpus file was read from: prompts.stats.json's record first, then the manifest's path
    relative to the original manifest, then relative to the copy."""
    stats = ctx.stats or {}
    for rec in lookup(stats, "provenance.files") or []:
        if rec.get("corpus") == name and rec.get("resolved_path"):
            return Path(rec["resolved_path"])
    resolved = _corpus_stats(stats, name).get("resolved_path")
    if resolved:
        return Path(resolved)
    if declared and name in loaded.resolved and any(c.name == name and c.kind == "packaged" for c in loaded.corpora):
        return loaded.resolved[name]  # inside the installed package, wherever the manifest was
    if declared:
        original = lookup(stats, "provenance.manifest.resolved_path")
        base = Path(original).parent if original else ctx.paths.manifest.parent
        return (base / declared).resolve()
    return loaded.resolved.get(name)


def _corpus_pin(ctx: AuditContext, mpath: Path, i: int, c, loaded) -> None:
    where = f"corpora[{i}]"
    if c.kind == "hf_dataset":
        ok = bool(COMMIT_RE.fullmatch(c.revision or ""))
        ctx.add("corpus pinned", "pass" if ok else "fail",
                f"{c.name}: hub dataset {c.repo_id} pinned to revision {c.revision}" if ok else
                f"{c.name}: hub dataset {c.repo_id} revision {c.revision!r} is not a 40-hex commit",
                [ctx.cite(mpath, f"{where}.revision")])
        return
    path = _corpus_file(ctx, c.name, c.path, loaded)
    if c.kind == "templates" and path is None:
        path = templates_asset()
    recorded = c.sha256
    recorded_field = f"{where}.sha256"
    cite_file = mpath
    if recorded is None:  # templates: the manifest pins no hash; the stats recorded it
        recorded = _corpus_stats(ctx.stats, c.name).get("sha256")
        recorded_field, cite_file = f"corpora.{c.name}.sha256", ctx.paths.prompts_stats
    cites = [ctx.cite(cite_file, recorded_field)]
    if recorded is None:
        ctx.add("corpus pinned", "fail", f"{c.name}: no sha256 declared or recorded for {c.kind} corpus", cites)
        return
    if path is None or not path.is_file():
        ctx.add("corpus pinned", "fail", f"{c.name}: file {path} is not on this machine; cannot check its "
                                         f"sha256 {short(recorded)}", cites)
        return
    actual = ctx.sha(path)
    if actual == recorded:
        ctx.add("corpus pinned", "pass", f"{c.name}: {path.name} sha256 {short(actual)} still matches", cites)
    else:
        ctx.add("corpus pinned", "fail", f"{c.name}: {path} has sha256 {short(actual)}, declared "
                                         f"{short(recorded)} (the file changed)", cites)


def _no_eval_split(ctx: AuditContext, loaded, eval_sets: list[dict]) -> None:
    eval_shas = {e["sha256"]: e["path"] for e in eval_sets if e.get("sha256")}
    for i, c in enumerate(loaded.corpora):
        cites = [ctx.cite(ctx.paths.manifest, f"corpora[{i}].split")]
        if c.split is not None and is_eval_split(c.split):
            ctx.add("no eval split", "fail", f"{c.name}: split {c.split!r} is an evaluation split", cites)
            continue
        path = _corpus_file(ctx, c.name, c.path, loaded) if c.kind != "hf_dataset" else None
        if path is not None and path.is_file() and ctx.sha(path) in eval_shas:
            ctx.add("no eval split", "fail", f"{c.name}: {path} is byte-identical to the evaluation set "
                                             f"{eval_shas[ctx.sha(path)]}",
                    [ctx.cite(ctx.paths.manifest, f"corpora[{i}].path")])
            continue
        if path is not None and c.kind == "local_file" and is_eval_split(path.stem):
            ctx.add("no eval split", "warn", f"{c.name}: the file name {path.name} looks like an evaluation "
                                             "split", [ctx.cite(ctx.paths.manifest, f"corpora[{i}].path")])
            continue
        what = f"split {c.split!r}" if c.split else {"local_file": "a local file", "packaged": "a packaged corpus file"
                                                     }.get(c.kind, c.kind)
        ctx.add("no eval split", "pass", f"{c.name}: {what}, not an evaluation split", cites)


def _prompts(ctx: AuditContext, loaded) -> None:
    p, stats, rows = ctx.paths.prompts, ctx.stats, ctx.prompts
    if rows is None:
        return
    ctx.facts["prompts"] = len(rows)
    if stats is not None:
        ctx.check_equal("prompts sha256", ctx.sha(p), stats.get("prompts_sha256"),
                        "prompts.jsonl and prompts.stats.json (sha256)",
                        [ctx.cite(p), ctx.cite(ctx.paths.prompts_stats, "prompts_sha256")], short)
        ctx.check_equal("prompts count", len(rows), stats.get("total"), "prompts in prompts.jsonl and recorded",
                        [ctx.cite(p), ctx.cite(ctx.paths.prompts_stats, "total")])
    bad_rows = [f"line {r['_line']}" for r in rows if not all(isinstance(r.get(k), str) for k in ("id", "prompt"))]
    ids = Counter(str(r.get("id")) for r in rows)
    dupes = sorted(i for i, n in ids.items() if n > 1)
    if bad_rows or dupes:
        ctx.add("prompts format", "fail", f"{len(bad_rows)} rows without string id/prompt, {len(dupes)} "
                                          "repeated ids", [ctx.cite(p, "id")],
                bad_rows + [f"repeated id {d!r}" for d in dupes])
    else:
        ctx.add("prompts format", "pass", f"{len(rows)} rows with unique ids", [ctx.cite(p, "id")])
    declared = _declared_names(ctx, loaded)
    if declared is None:
        ctx.add("prompt sources declared", "fail", "no readable manifest to compare the sources with",
                [ctx.cite(p, "source"), ctx.cite(ctx.paths.manifest, "corpora[].name")])
        return
    undeclared = [f"line {r['_line']} id {r.get('id')!r}: source {r.get('source')!r}" for r in rows
                  if r.get("source") not in declared]
    if undeclared:
        ctx.add("prompt sources declared", "fail",
                f"{len(undeclared)} prompts have a source that is not a corpus of data_manifest.json",
                [ctx.cite(p, "source"), ctx.cite(ctx.paths.manifest, "corpora[].name")], undeclared)
        return
    per = Counter(r["source"] for r in rows)
    ctx.add("prompt sources declared", "pass",
            "every source is a declared corpus: " + ", ".join(f"{k} {v}" for k, v in per.items()),
            [ctx.cite(p, "source"), ctx.cite(ctx.paths.manifest, "corpora[].name")])
    if stats is not None:
        kept = {name: _corpus_stats(stats, name).get("kept") for name in declared}
        wrong = [f"{n}: {per.get(n, 0)} in prompts.jsonl, {kept[n]} recorded" for n in sorted(declared)
                 if kept[n] is not None and kept[n] != per.get(n, 0)]
        ctx.add("prompt counts per corpus", "fail" if wrong else "pass",
                "per-corpus counts differ from prompts.stats.json" if wrong else
                "per-corpus counts equal prompts.stats.json",
                [ctx.cite(ctx.paths.prompts_stats, "corpora.*.kept")], wrong)


def _eval_sets(ctx: AuditContext) -> list[dict]:
    """The evaluation prompt files: --eval-set, else the prompts stage's plus the validation stage's."""
    sets: list[dict] = []
    if ctx.cfg.eval_set:
        for path in ctx.cfg.eval_set:
            sets.append({"path": path, "sha256": None, "cite": ctx.cite(path), "origin": "--eval-set"})
    else:
        for i, rec in enumerate(lookup(ctx.stats or {}, "contamination.eval_sets") or []):
            path = rec.get("resolved_path") or rec.get("path")
            sets.append({"path": path, "sha256": rec.get("sha256"), "origin": "prompts",
                         "cite": ctx.cite(ctx.paths.prompts_stats, f"contamination.eval_sets[{i}]")})
        if ctx.paths.validation_summary.is_file() and ctx.validation_summary is not None:
            ev = ctx.validation_summary.get("eval") or {}
            if ev.get("path"):
                sets.append({"path": ev["path"], "sha256": ev.get("sha256"), "origin": "validation",
                             "cite": ctx.cite(ctx.paths.validation_summary, "eval")})
    found: list[dict] = []
    seen: set[str] = set()
    for s in sets:
        path = Path(s["path"])
        if not path.is_absolute() and not path.is_file() and (ctx.run_dir / path).is_file():
            path = ctx.run_dir / path
        if not path.is_file():
            ctx.add("eval set present", "fail", f"evaluation set {s['path']} ({s['origin']}) is not on this "
                                                "machine: cannot check contamination against it", [s["cite"]])
            continue
        actual = ctx.sha(path)
        if s["sha256"] and actual != s["sha256"]:
            ctx.add("eval set present", "fail", f"evaluation set {path} has sha256 {short(actual)}, recorded "
                                                f"{short(s['sha256'])}", [s["cite"]])
        else:
            ctx.add("eval set present", "pass", f"{path} ({s['origin']}, sha256 {short(actual)})", [s["cite"]])
        if actual not in seen:
            seen.add(actual)
            found.append({"path": str(path), "sha256": actual, "origin": s["origin"], "cite": s["cite"]})
    if not sets:
        ctx.add("eval set present", "fail", "no evaluation prompt file recorded in prompts.stats.json or "
                                            "validation.summary.json: pass --eval-set",
                [ctx.cite(ctx.paths.prompts_stats, "contamination.eval_sets")])
    origins = {s["origin"]: s["sha256"] for s in found}
    if "validation" in origins and not ctx.cfg.eval_set:
        filtered = {s["sha256"] for s in found if s["origin"] == "prompts"}
        ok = origins["validation"] in filtered
        ctx.add("eval set filtered", "pass" if ok else "warn",
                "the prompts stage filtered against the validation prompts" if ok else
                "the prompts stage did not filter against the validation prompts (the overlap check below "
                "covers them)", [ctx.cite(ctx.paths.prompts_stats, "contamination.eval_sets"),
                                 ctx.cite(ctx.paths.validation_summary, "eval.sha256")])
    ctx.facts["eval_sets"] = [{k: v for k, v in s.items() if k != "cite"} for s in found]
    return found


def _contamination(ctx: AuditContext, eval_sets: list[dict]) -> None:
    n = ctx.cfg.ngram or lookup(ctx.stats or {}, "contamination.ngram") or 13
    eval_texts: list[str] = []
    for s in eval_sets:
        eval_texts.extend(read_eval_prompts(s["path"]))
    cites = [s["cite"] for s in eval_sets]
    if not eval_texts:
        ctx.add("contamination", "fail", f"no evaluation prompts to check the {n}-gram overlap against",
                [ctx.cite(ctx.paths.prompts_stats, "contamination.eval_sets")])
        return
    texts: list[str] = []
    labels: list[str] = []
    for r in ctx.prompts or []:
        texts.append(str(r.get("prompt", "")))
        labels.append(f"prompt {r.get('id')!r} (prompts.jsonl line {r['_line']})")
    completions = 0
    tok = ctx.tokenizer() if ctx.traces else None
    if ctx.traces and tok is not None:
        rows = [t for t in ctx.traces if isinstance(t.get("completion_ids"), list)]
        decoded = tok[0].batch_decode([t["completion_ids"] for t in rows], skip_special_tokens=True)
        texts.extend(decoded)
        labels.extend(f"completion of {t.get('id')!r} (traces.jsonl line {t['_line']})" for t in rows)
        completions = len(rows)
    answers, answer_cite = _labelled_answers(ctx, tok)
    texts.extend(text for text, _ in answers)
    labels.extend(label for _, label in answers)
    offending = ngram_overlap(texts, eval_texts, n)
    what = f"{len(ctx.prompts or [])} prompts + {completions} completions" + (
        f" + {len(answers)} labelled answers" if answer_cite else "")
    cites = [ctx.cite(ctx.paths.prompts, "prompt"), ctx.cite(ctx.paths.traces, "completion_ids"),
             *([answer_cite] if answer_cite else []), *cites]
    if offending:
        ctx.add("contamination", "fail", f"{len(offending)} of {what} share a {n}-gram with the "
                                         f"{len(eval_texts)} evaluation prompts", cites,
                [f"{labels[i]}: {gram!r}" for i, gram in offending])
    else:
        ctx.add("contamination", "pass", f"{n}-gram overlap is zero: {what} vs {len(eval_texts)} evaluation "
                                         "prompts", cites)
    if ctx.traces and tok is None:
        ctx.add("contamination", "fail", "completions not checked: no tokenizer found (target dir, checkpoint "
                                         "or model dir) to decode them",
                [ctx.cite(ctx.paths.traces, "completion_ids")])
    elif tok is not None:
        ctx.facts["decode_tokenizer"] = {"path": str(tok[1]), "target": tok[2]}


def _labelled_answers(ctx: AuditContext, tok) -> tuple[list[tuple[str, str]], dict[str, str] | None]:
    """(text, label) of each reference answer the draft was trained on via `specdraft label`, and the
    cite: labels.jsonl's completion_ids decoded, or -- no tokenizer -- prompts.jsonl's `response` of the
    labelled ids. ([], None) when training used no labels."""
    path = ctx.labels_file()
    if path is None:
        return [], None
    if not path.is_file():
        ctx.add("contamination", "fail", f"labelled answers not checked: {path} is gone",
                [ctx.cite(ctx.paths.train_meta, "labels.path")])
        return [], None
    rows = [r for r in ctx.jsonl(path) or [] if isinstance(r.get("completion_ids"), list)]
    if tok is not None:
        decoded = tok[0].batch_decode([r["completion_ids"] for r in rows], skip_special_tokens=True)
        return ([(text, f"response of {r.get('id')!r} ({path.name} line {r['_line']})")
                 for text, r in zip(decoded, rows)], ctx.cite(path, "completion_ids"))
    ids = {str(r.get("id")) for r in rows}
    return ([(str(r["response"]), f"response of {r.get('id')!r} (prompts.jsonl line {r['_line']})")
             for r in ctx.prompts or [] if str(r.get("id")) in ids and isinstance(r.get("response"), str)],
            ctx.cite(ctx.paths.prompts, "response"))
