"""The export link: each export in RUN_DIR/export/ is what its record says, made from a model of this run.

For every record there (``<name>.export.json`` beside a GGUF file, ``<dir>/export_record.json`` in an HF dir,
written by `specdraft export`) it proves that the exported files hold the recorded bytes (sha256); for a GGUF
file, that its tensors have the recorded names and types (read from the file's own header); and that the
record's source sha256 is the weight file of this run's packed model (or its self-draft, or its training
output). An export of a model that is not this run's is a warning; a source that no longer matches, a failure.
No exports is a skip: they are optional.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from specdraft.audit.context import AuditContext, lookup, short
from specdraft.model.export import EXPORT_DIR, GGUF_RECORD_SUFFIX, HF_RECORD


def audit_export(ctx: AuditContext) -> None:
    ctx.section = "export"
    root = ctx.run_dir / EXPORT_DIR
    records = (sorted(root.glob(f"*{GGUF_RECORD_SUFFIX}")) + sorted(root.glob(f"*/{HF_RECORD}"))
               if root.is_dir() else [])
    if not records:
        ctx.add("exports", "skip", f"no export records in {ctx.rel(root)} (specdraft export writes them)",
                [ctx.cite(root)])
        return
    for path in records:
        ctx.guard(f"export {ctx.rel(path)}", lambda p=path: _one(ctx, p))


def _one(ctx: AuditContext, path: Path) -> None:
    record = ctx.json(path)
    if record is None:
        return
    fmt = record.get("format")
    if fmt == "gguf":
        _gguf_file(ctx, path, record)
    elif fmt == "hf":
        _hf_files(ctx, path, record)
    else:
        ctx.add("export format", "fail", f"{ctx.rel(path)}: unknown format {fmt!r}", [ctx.cite(path, "format")])
        return
    _source(ctx, path, record)


def _gguf_file(ctx: AuditContext, path: Path, record: dict) -> None:
    out = path.parent / str(lookup(record, "output.file"))
    if not ctx.require(out, f"the GGUF file {path.name} describes"):
        return
    ctx.check_equal("export file", ctx.sha(out), lookup(record, "output.sha256"),
                    f"{ctx.rel(out)} and {path.name} (sha256)", [ctx.cite(out), ctx.cite(path, "output.sha256")],
                    short)
    header = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    recorded = {t.get("gguf_name"): t.get("type") for t in record.get("tensors") or []}
    differ = [f"{n}: {header.get(n, 'absent')} in the file, {recorded.get(n, 'absent')} in the record"
              for n in sorted(set(header) | set(recorded)) if header.get(n) != recorded.get(n)]
    ctx.add("export tensors", "fail" if differ else "pass",
            f"{ctx.rel(out)}'s tensors are not the recorded ones" if differ else
            f"{ctx.rel(out)}: {len(header)} tensors with the recorded names and types "
            f"({_counts(header.values())}); {_exactness(record)}",
            [ctx.cite(out, "tensor infos"), ctx.cite(path, "tensors[].gguf_name, type")], differ)


def _hf_files(ctx: AuditContext, path: Path, record: dict) -> None:
    files = lookup(record, "output.files") or []
    differ = []
    for f in files:
        p = path.parent / str(f.get("name"))
        if not p.is_file():
            differ.append(f"{f.get('name')}: missing")
        elif ctx.sha(p) != f.get("sha256"):
            differ.append(f"{f.get('name')}: sha256 {short(ctx.sha(p))}, recorded {short(f.get('sha256'))}")
    ok = bool(files) and not differ
    ctx.add("export file", "pass" if ok else "fail",
            f"{ctx.rel(path.parent)}: {len(files)} files hold the recorded bytes; {_exactness(record)}" if ok else
            f"{ctx.rel(path.parent)}'s files are not the recorded ones" + ("" if files else " (none recorded)"),
            [ctx.cite(path.parent), ctx.cite(path, "output.files")], differ)


def _source(ctx: AuditContext, path: Path, record: dict) -> None:
    """The recorded source sha256 against the run's models; else against the recorded dir, if still there."""
    sha = lookup(record, "source.weights_sha256")
    arch = ctx.json(ctx.paths.model_dir / "architecture.json") if ctx.paths.model_dir.is_dir() else None
    candidates = [(ctx.paths.model_dir, ctx.weight_path(arch)),
                  (ctx.paths.model_self, ctx.paths.model_self / "draft.qd4")]
    for model_dir, weight in candidates:
        if weight.is_file() and ctx.sha(weight) == sha:
            ctx.add("export source", "pass", f"{path.name} was exported from {ctx.rel(model_dir)}: its weight file "
                    f"has the recorded sha256 {short(sha)}", [ctx.cite(path, "source.weights_sha256"),
                                                              ctx.cite(weight)])
            return
    if ctx.paths.checkpoint.is_dir() and ctx.weights_sha(ctx.paths.checkpoint) == sha:
        ctx.add("export source", "pass", f"{path.name} was exported from the training output "
                f"{ctx.rel(ctx.paths.checkpoint)} (weights sha256 {short(sha)})",
                [ctx.cite(path, "source.weights_sha256"), ctx.cite(ctx.paths.checkpoint)])
        return
    source = Path(str(lookup(record, "source.model_dir")))
    files = [source / str(f.get("name")) for f in lookup(record, "source.weight_files") or []]
    cites = [ctx.cite(path, "source")]
    if files and all(f.is_file() for f in files):
        current = ctx.sha(files[0]) if len(files) == 1 else ctx.weights_sha(source)
        if current == sha:
            ctx.add("export source", "warn", f"{path.name} was exported from {source}, which is not a model of this "
                    f"run (sha256 {short(sha)})", cites)
        else:
            ctx.add("export source", "fail", f"{path.name}'s source {source} no longer holds the recorded weights "
                    f"(sha256 {short(current)}, recorded {short(sha)})", cites)
        return
    ctx.add("export source", "fail", f"{path.name}'s source (sha256 {short(sha)}) is no model of this run, and "
            f"{source} is gone", cites)


def _counts(types) -> str:
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def _exactness(record: dict) -> str:
    total, not_exact = len(record.get("tensors") or []), record.get("not_exact") or []
    if not not_exact:
        return f"the record says all {total} hold the source's values exactly"
    return (f"the record says {total - len(not_exact)} of {total} hold the source's values exactly (not: "
            f"{', '.join(not_exact[:4])}{' ...' if len(not_exact) > 4 else ''})")
