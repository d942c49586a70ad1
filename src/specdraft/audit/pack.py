"""The pack link: draft.qd4 is the packed training output, intact and described by its records.

It proves that the weight file's bytes and sha256 are those of architecture.json and pack_recipe.json, its
QD04 header and payload checksum verify, and its per-tensor group sizes are the recorded ones; that the recipe's
source is the checkpoint training wrote (and still on disk); that gptq calibration traces still hold the
recorded bytes; that the config and tokenizer files are the checkpoint's, byte for byte, and generation_config.json
the checkpoint's plus the draft's recorded assisted-generation settings; and, for the demo's
self-draft (RUN_DIR/model_self), that its file matches its records and it packed the target's own weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdraft.audit.context import AuditContext, lookup, short
from specdraft.model.export import ASSISTED_GENERATION, GENERATION_CONFIG
from specdraft.model.loader import TOKENIZER_FILES, WEIGHT_FILE
from specdraft.quant import qd4


def _bytes(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def audit_pack(ctx: AuditContext) -> None:
    ctx.section = "pack"
    md = ctx.paths.model_dir
    ctx.expect([(md, "packed model dir, written by specdraft pack")])
    if not md.is_dir():
        return
    ctx.expect([(md / "architecture.json", "written by specdraft pack"),
                (md / "pack_recipe.json", "written by specdraft pack")])
    arch = ctx.json(md / "architecture.json")
    recipe = ctx.json(md / "pack_recipe.json")
    ctx.guard("weight file", lambda: _weight(ctx, arch, recipe))
    ctx.guard("recipe source", lambda: _source(ctx, recipe))
    ctx.guard("calibration", lambda: _calibration(ctx, recipe))
    ctx.guard("side files", lambda: _side_files(ctx))
    ctx.guard("self-draft", lambda: _self_draft(ctx))


def _weight(ctx: AuditContext, arch: dict | None, recipe: dict | None) -> None:
    md = ctx.paths.model_dir
    w = ctx.weight_path(arch)
    if not ctx.require(w, "the QD04 weight file"):
        return
    size, sha = w.stat().st_size, ctx.sha(w)
    ctx.facts["weight_file"] = {"path": str(w), "bytes": size, "sha256": sha}
    ap, rp = md / "architecture.json", md / "pack_recipe.json"
    if arch is not None:
        ctx.check_equal("weight bytes", size, arch.get("bytes"), f"{w.name} bytes and architecture.json",
                        [ctx.cite(w), ctx.cite(ap, "bytes")], _bytes)
        ctx.check_equal("weight sha256", sha, arch.get("sha256"), f"{w.name} and architecture.json (sha256)",
                        [ctx.cite(w), ctx.cite(ap, "sha256")], short)
    if recipe is not None:
        ctx.check_equal("weight bytes", size, lookup(recipe, "output.bytes"), f"{w.name} bytes and pack_recipe.json",
                        [ctx.cite(w), ctx.cite(rp, "output.bytes")], _bytes)
        ctx.check_equal("weight sha256", sha, lookup(recipe, "output.sha256"),
                        f"{w.name} and pack_recipe.json (sha256)", [ctx.cite(w), ctx.cite(rp, "output.sha256")],
                        short)
    try:
        header = qd4.verify_qd4(w)
    except qd4.QD4Error as e:
        ctx.add("weight file structure", "fail", e.reason, [ctx.cite(w, "QD04 header + payload sha256")])
        return
    ctx.add("weight file structure", "pass", f"QD04 v{header.format_version}, {len(header.entries)} tensors, "
                                             f"q4g tensors by G {header.q4g_group_sizes()}, payload sha256 "
                                             "verified", [ctx.cite(w, "header.payload_sha256")])
    if recipe is not None:
        ctx.check_equal("payload sha256", header.payload_sha256, lookup(recipe, "output.payload_sha256"),
                        "the file header's payload sha256 and pack_recipe.json",
                        [ctx.cite(w, "header.payload_sha256"), ctx.cite(rp, "output.payload_sha256")], short)
        if "group_sizes" in recipe:  # recipes before QD04 v2 have no such record
            own = {e.name: e.group_size for e in header.entries
                   if e.group_size is not None and e.group_size != header.group_size}
            ctx.check_equal("group sizes", own, recipe["group_sizes"],
                            "tensors the file stores at their own G and pack_recipe.json's group_sizes",
                            [ctx.cite(w, "header.tensors[].group_size"), ctx.cite(rp, "group_sizes")],
                            lambda d: f"{len(d)} tensors at {sorted(set(d.values()))}" if d else "none")


def _source(ctx: AuditContext, recipe: dict | None) -> None:
    if recipe is None:
        return
    rp = ctx.paths.model_dir / "pack_recipe.json"
    src = lookup(recipe, "source.weights_sha256")
    meta = ctx.train_meta if ctx.paths.train_meta.is_file() else None
    if meta is not None:
        ctx.check_equal("recipe source", src, meta.get("checkpoint_weights_sha256"),
                        "the packed checkpoint and the training output (weights sha256)",
                        [ctx.cite(rp, "source.weights_sha256"),
                         ctx.cite(ctx.paths.train_meta, "checkpoint_weights_sha256")], short)
    if ctx.paths.checkpoint.is_dir():
        actual = ctx.weights_sha(ctx.paths.checkpoint)
        if actual != src or meta is None:
            ctx.check_equal("recipe source on disk", src, actual,
                            f"the packed checkpoint and {ctx.rel(ctx.paths.checkpoint)} on disk "
                            "(weights sha256)",
                            [ctx.cite(rp, "source.weights_sha256"), ctx.cite(ctx.paths.checkpoint)], short)


def _self_draft(ctx: AuditContext) -> None:
    """The demo's reference draft (RUN_DIR/model_self, when there): its weight file is the one its records
    describe, and what it packed is the target's own weights."""
    md = ctx.paths.model_self
    if not md.is_dir():
        return
    ap, rp = md / "architecture.json", md / "pack_recipe.json"
    ctx.expect([(ap, "written by specdraft pack"), (rp, "written by specdraft pack")])
    arch, recipe = ctx.json(ap), ctx.json(rp)
    if arch is None or recipe is None:
        return
    w = md / str(arch.get("weight_file") or WEIGHT_FILE)
    if not ctx.require(w, "the self-draft's QD04 weight file"):
        return
    sha = ctx.sha(w)
    for record, path in ((arch, ap), (lookup(recipe, "output") or {}, rp)):
        ctx.check_equal("self-draft weight file", [w.stat().st_size, sha], [record.get("bytes"),
                        record.get("sha256")], f"{ctx.rel(w)} and {path.name} (bytes, sha256)",
                        [ctx.cite(w), ctx.cite(path, "bytes, sha256")], lambda v: f"{v[0]} B {short(v[1])}")
    try:
        qd4.verify_qd4(w)
    except qd4.QD4Error as e:
        ctx.add("self-draft weight file", "fail", e.reason, [ctx.cite(w, "QD04 header + payload sha256")])
    target = ctx.target_dir()
    if target is not None:
        ctx.check_equal("self-draft source", lookup(recipe, "source.weights_sha256"), ctx.weights_sha(target),
                        "the self-draft's packed checkpoint and the target that wrote the traces "
                        "(weights sha256)", [ctx.cite(rp, "source.weights_sha256"), ctx.cite(target)], short)


def _calibration(ctx: AuditContext, recipe: dict | None) -> None:
    """--fit gptq chose codes from traces: the file it names must still hold the recorded bytes."""
    calibration = (recipe or {}).get("calibration")
    if not calibration:
        return
    rp = ctx.paths.model_dir / "pack_recipe.json"
    path = Path(str(calibration.get("traces")))
    cites = [ctx.cite(rp, "calibration.sha256"), ctx.cite(path)]
    if not path.is_file():  # a moved run dir: its own traces may be the calibration file
        if ctx.paths.traces.is_file() and ctx.sha(ctx.paths.traces) == calibration.get("sha256"):
            ctx.add("calibration", "pass", f"the gptq calibration traces ({path}, not on disk) are the run's "
                    f"traces {ctx.rel(ctx.paths.traces)} (sha256 {short(calibration.get('sha256'))})",
                    [*cites, ctx.cite(ctx.paths.traces)])
        else:
            ctx.add("calibration", "fail", f"calibration traces {path} are gone (recorded sha256 "
                    f"{short(calibration.get('sha256'))})", cites)
        return
    ctx.check_equal("calibration", ctx.sha(path), calibration.get("sha256"),
                    f"the gptq calibration traces {ctx.rel(path)} and pack_recipe.json (sha256)", cites, short)


def _side_files(ctx: AuditContext) -> None:
    md, ck = ctx.paths.model_dir, ctx.paths.checkpoint
    if not ck.is_dir():
        return
    names = ["config.json"] + [n for n in TOKENIZER_FILES if (ck / n).is_file() or (md / n).is_file()]
    differ = []
    for n in names:
        a, b = md / n, ck / n
        if not a.is_file() or not b.is_file():
            where = "the model dir" if not a.is_file() else "the checkpoint"
            differ.append(f"{n}: missing from {where}")
        elif ctx.sha(a) != ctx.sha(b):
            differ.append(f"{n}: differs from the checkpoint's")
    ctx.add("side files", "fail" if differ else "pass",
            "config/tokenizer files are not the checkpoint's" if differ else
            f"config.json and {len(names) - 1} tokenizer files are the checkpoint's, byte for byte",
            [ctx.cite(md / "config.json"), ctx.cite(ck / "config.json")], differ)
    _generation_config(ctx)


def _generation_config(ctx: AuditContext) -> None:
    """generation_config.json is the checkpoint's (eos / bos / pad ids and the rest, as JSON values) plus the
    draft's assisted-generation settings, which pack_recipe.json records (a pack from before that record: the
    checkpoint's file, byte for byte)."""
    md, ck = ctx.paths.model_dir, ctx.paths.checkpoint
    a, b, rp = md / GENERATION_CONFIG, ck / GENERATION_CONFIG, md / "pack_recipe.json"
    if not a.is_file() or not b.is_file():
        if a.is_file() != b.is_file():
            ctx.add("generation config", "fail", f"{GENERATION_CONFIG}: missing from "
                    f"{'the model dir' if not a.is_file() else 'the checkpoint'}", [ctx.cite(a), ctx.cite(b)])
        return
    recorded = (ctx.json(rp) or {}).get("assisted_generation")
    cites = [ctx.cite(a), ctx.cite(b), ctx.cite(rp, "assisted_generation")]
    if recorded is None:
        same = ctx.sha(a) == ctx.sha(b)
        ctx.add("generation config", "pass" if same else "fail",
                f"{GENERATION_CONFIG} is the checkpoint's, byte for byte" if same else
                f"{GENERATION_CONFIG} differs from the checkpoint's and pack_recipe.json records no assisted-"
                "generation settings", cites[:2])
        return
    model, checkpoint = ctx.json(a), ctx.json(b)
    if model is None or checkpoint is None:
        return
    differ = [f"{k}: {model.get(k)!r} in the model dir, {checkpoint.get(k)!r} in the checkpoint"
              for k in sorted(set(model) | set(checkpoint)) if k not in ASSISTED_GENERATION
              and model.get(k) != checkpoint.get(k)]
    settings = {k: model.get(k) for k in ASSISTED_GENERATION}
    if settings != recorded:
        differ.append(f"assisted-generation settings {settings} are not pack_recipe.json's {recorded}")
    ctx.add("generation config", "fail" if differ else "pass",
            f"{GENERATION_CONFIG} is not the checkpoint's plus the recorded draft settings" if differ else
            f"{GENERATION_CONFIG} is the checkpoint's (every field) plus the recorded assisted-generation "
            f"settings {recorded}", cites, differ)
