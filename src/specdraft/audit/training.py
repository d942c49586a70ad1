"""The training link: the draft was trained from the recorded init model on this run's traces (and labels),
and the checkpoint is what training wrote.

It proves that the init model is pinned (and still has the recorded weights where it is on disk) and the
training target is the traces' target; that the traces and the teacher-forced labels trained on still have the
recorded sha256, the labels were written by the same target from this run's prompts and a few re-scored rows
are its argmax; that the checkpoint's weights have the recorded sha256 and its tensors have exactly the names
and shapes of its config's architecture; and that its config is the init's architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig

from specdraft.audit.context import AuditContext, lookup, short
from specdraft.audit.models import argmax_mismatches, check_model_source, spread
from specdraft.core.io import safetensors_shapes
from specdraft.model.specs import weight_files
from specdraft.quant import qd4

CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
               "max_position_embeddings")


def audit_training(ctx: AuditContext) -> None:
    ctx.section = "training"
    ctx.expect([(ctx.paths.checkpoint, "training checkpoint dir, written by specdraft train"),
                (ctx.paths.train_meta, "written by specdraft train")])
    meta = ctx.train_meta
    if meta is None:
        return
    ctx.run_checks(meta, [("init model", _init), ("train target", _target), ("train traces", _traces),
                          ("train labels", _labels), ("checkpoint weights", _weights),
                          ("tensor shapes", lambda c, _: _shapes(c)), ("config vs init", _config_vs_init)])


def _init(ctx: AuditContext, meta: dict) -> None:
    mp = ctx.paths.train_meta
    init = meta.get("init")
    check_model_source(ctx, init, mp, "init", "init model", "init")
    if isinstance(init, dict) and init.get("init"):
        layers = init.get("truncate_layers")
        ctx.add("init spec", "pass", f"init {init['init']!r}"
                + (f", decoder layers {layers}" if layers is not None else ""),
                [ctx.cite(mp, "init.init"), ctx.cite(mp, "init.truncate_layers")])


def _target(ctx: AuditContext, meta: dict) -> None:
    mp = ctx.paths.train_meta
    t = meta.get("target") or {}
    s = lookup(ctx.traces_summary or {}, "target") or {}
    if not s:
        ctx.add("train target", "skip", "no traces summary target to compare with", [ctx.cite(mp, "target")])
        return
    ctx.check_same_target("train target", mp, t, "the training target")


def _traces(ctx: AuditContext, meta: dict) -> None:
    mp, tp = ctx.paths.train_meta, ctx.paths.traces
    rec = meta.get("traces") or {}
    if tp.is_file():
        ctx.check_equal("train traces sha256", ctx.sha(tp), rec.get("sha256"),
                        "traces.jsonl and the traces the draft was trained on (sha256)",
                        [ctx.cite(tp), ctx.cite(mp, "traces.sha256")], short)
    if ctx.traces is not None and rec.get("count") is not None:
        usable = sum(1 for t in ctx.traces if t.get("completion_ids"))
        ctx.check_equal("train traces count", rec.get("count"), usable,
                        "traces trained on (recorded) and traces with a completion in traces.jsonl",
                        [ctx.cite(mp, "traces.count")])
    if rec.get("summary_sha256") and ctx.paths.traces_summary.is_file():
        same = rec["summary_sha256"] == ctx.sha(ctx.paths.traces_summary)
        ctx.add("train traces summary", "pass" if same else "warn",
                "traces.summary.json is the one training read" if same else
                "traces.summary.json was rewritten after training (the traces sha256 above is what counts)",
                [ctx.cite(mp, "traces.summary_sha256")])


def _labels(ctx: AuditContext, meta: dict) -> None:
    """Teacher-forced labels (`specdraft label`), when the draft was trained on them: the file is the one
    trained on, it was labelled by the traces' target from this run's prompts, and its labels are the
    target's argmax (re-scored on a few rows)."""
    mp = ctx.paths.train_meta
    rec = meta.get("labels")
    if not rec:
        ctx.add("train labels", "pass", "trained on greedy traces only (no teacher-forced labels)",
                [ctx.cite(mp, "labels")])
        return
    path = ctx.labels_file()
    if not path.is_file():
        ctx.add("train labels", "fail", f"the labels the draft was trained on are gone ({path})",
                [ctx.cite(mp, "labels.path")])
        return
    ctx.check_equal("train labels sha256", ctx.sha(path), rec.get("sha256"),
                    "labels.jsonl and the labels the draft was trained on (sha256)",
                    [ctx.cite(path), ctx.cite(mp, "labels.sha256")], short)
    sp = path.with_name(path.stem + ".summary.json")
    summary = ctx.json(sp)
    if summary is None:
        ctx.add("labels summary", "fail", f"missing: {ctx.rel(sp)} (written by specdraft label)", [ctx.cite(sp)])
        return
    ctx.check_equal("labels sha256", ctx.sha(path), summary.get("labels_sha256"),
                    "labels.jsonl and labels.summary.json (sha256)",
                    [ctx.cite(path), ctx.cite(sp, "labels_sha256")], short)
    t, s = summary.get("target") or {}, lookup(ctx.traces_summary or {}, "target") or {}
    ctx.check_equal("labels target", (t.get("spec"), t.get("weights_sha256")),
                    (s.get("spec"), s.get("weights_sha256")),
                    "the labelling target and the traces' target (spec, weights sha256)",
                    [ctx.cite(sp, "target.spec"), ctx.cite(ctx.paths.traces_summary, "target.spec")],
                    lambda x: f"{x[0]} {short(x[1])}")
    if ctx.paths.prompts.is_file():
        same = lookup(summary, "prompts.sha256") == ctx.sha(ctx.paths.prompts)
        # The answers' own contamination is checked in the data section, whichever file they came from.
        ctx.add("labels prompts", "pass" if same else "fail",
                "labelled answers come from this run's prompts.jsonl" if same else
                "labelled answers come from another prompts file than this run's: its data provenance is "
                "not the one audited here",
                [ctx.cite(sp, "prompts.sha256"), ctx.cite(ctx.paths.prompts)])
    rows = [r for r in ctx.jsonl(path) or [] if r.get("prompt_ids") and r.get("completion_ids")]
    model, why, field = ctx.rescoring_model(t.get("weights_sha256"))
    if ctx.cfg.greedy_check == 0 or not rows or model is None:
        ctx.add("labels re-scored", "skip", "--greedy-check 0" if ctx.cfg.greedy_check == 0 else
                "no rows" if not rows else why, [ctx.cite(sp, field or "target.path")])
        return
    picks = spread(rows, ctx.cfg.greedy_check)
    mismatched, total, bad = argmax_mismatches(model, picks, "target_ids", path.name)
    cites = [ctx.cite(path, "target_ids"), ctx.cite(sp, "target.path")]
    if mismatched <= max(0, total // 100):  # float near-ties on another machine, as for traces
        ctx.add("labels re-scored", "pass" if not mismatched else "warn",
                f"{len(picks)} labelled rows re-scored with the target: {total - mismatched} of {total} labels "
                "are its argmax", cites, bad)
    else:
        ctx.add("labels re-scored", "fail", f"{mismatched} of {total} labels are not the target's argmax",
                cites, bad)


def _weights(ctx: AuditContext, meta: dict) -> None:
    mp = ctx.paths.train_meta
    ctx.check_equal("checkpoint weights sha256", ctx.weights_sha(ctx.paths.checkpoint),
                    meta.get("checkpoint_weights_sha256"),
                    "the checkpoint's weights and train_meta.json (sha256)",
                    [ctx.cite(ctx.paths.checkpoint / "model.safetensors"),
                     ctx.cite(mp, "checkpoint_weights_sha256")], short)


def _shapes(ctx: AuditContext) -> None:
    ck = ctx.paths.checkpoint
    if not ctx.require(ck / "config.json", "the checkpoint's config"):
        return
    files = [f for f in weight_files(ck) if f.suffix == ".safetensors"]
    if not files:
        ctx.add("tensor shapes", "fail", f"{ctx.rel(ck)} holds no .safetensors weight file",
                [ctx.cite(ck, "directory listing")])
        return
    config = AutoConfig.from_pretrained(ck)
    arch = (config.architectures or [type(config).__name__])[0]
    expected = {n: list(t.shape) for n, t in qd4.stored_tensors(qd4.meta_model(config)).items()}
    stored: dict[str, list[int]] = {}
    for f in files:
        stored.update(safetensors_shapes(f))
    problems = [f"{n}: file {stored[n]} vs {arch} {expected[n]}" for n in expected
                if n in stored and stored[n] != expected[n]]
    problems += [f"{n}: missing from the checkpoint" for n in expected if n not in stored]
    problems += [f"{n}: not a tensor of {arch}" for n in stored if n not in expected]
    cites = [ctx.cite(files[0], "safetensors header"), ctx.cite(ck / "config.json", "architectures")]
    if problems:
        ctx.add("tensor shapes", "fail", f"the checkpoint's tensors are not those of its config ({arch})",
                cites, problems)
    else:
        ctx.add("tensor shapes", "pass", f"{len(stored)} tensors with {arch} shapes", cites)
    ctx.facts["checkpoint"] = {"architecture": arch, "tensors": len(stored)}


def _config_vs_init(ctx: AuditContext, meta: dict) -> None:
    init = meta.get("init") or {}
    path = init.get("path")
    ck_cfg = ctx.paths.checkpoint / "config.json"
    if not path or not Path(path, "config.json").is_file() or not ck_cfg.is_file():
        ctx.add("config vs init", "skip", f"the init model {path!r} is not on this machine",
                [ctx.cite(ctx.paths.train_meta, "init.path")])
        return
    a = json.loads(Path(path, "config.json").read_text())
    b = json.loads(ck_cfg.read_text())
    diffs = [f"{k}: init {a.get(k)!r}, checkpoint {b.get(k)!r}" for k in CONFIG_KEYS if a.get(k) != b.get(k)]
    keep = init.get("truncate_layers")
    layers = (keep if isinstance(keep, int) else len(keep)) if keep is not None else a.get("num_hidden_layers")
    if b.get("num_hidden_layers") != layers:
        diffs.append(f"num_hidden_layers: expected {layers} from the init, checkpoint {b.get('num_hidden_layers')}")
    ctx.add("config vs init", "fail" if diffs else "pass",
            "the checkpoint's config is not the init's architecture" if diffs else
            f"the checkpoint's config is the init's ({b.get('model_type')}, {layers} layers)",
            [ctx.cite(ck_cfg), ctx.cite(ctx.paths.train_meta, "init.truncate_layers")], diffs)
