"""The serve link: the packed model dir holds only what the server needs, loads strictly, and serves without
the network or any file outside it.

It proves that the model dir holds only config, generation config, tokenizer, weights and the pack records (and
the pack stage's own log); that the strict loader finds every tensor name it expects and nothing else; and --
unless --no-serve-check -- that `specdraft serve` started in the sandbox (see ``sandbox``) answers one
POST /draft, logs missing=0 unexpected=0, makes no outgoing connection or name lookup, spawns no process, writes
no file but its own, and reads nothing but the model dir, Python code and package metadata, /proc /sys /dev and
its own temp files.
"""

from __future__ import annotations

import json

from specdraft.audit.context import AuditContext
from specdraft.audit.sandbox import allowed_roots, classify_opens, classify_path, run_server_sandboxed, under
from specdraft.model.loader import TOKENIZER_FILES, load_packed_model
from specdraft.quant.qd4 import QD4Error

# The files a packed model dir may hold (the pack stage writes pack.log there too: its own log, never read).
MODEL_DIR_BASE_FILES = ("config.json", "generation_config.json", "architecture.json", "pack_recipe.json")
MODEL_DIR_LOGS = ("pack.log",)


def audit_serve(ctx: AuditContext) -> None:
    ctx.section = "serve"
    md = ctx.paths.model_dir
    if not md.is_dir():
        ctx.require(md, "packed model dir, specdraft pack")
        return
    ctx.guard("model dir contents", lambda: _contents(ctx))
    ctx.guard("strict load", lambda: _load(ctx))
    if ctx.cfg.serve_check:
        ctx.guard("sandboxed server", lambda: _sandbox(ctx))
    else:
        ctx.add("sandboxed server", "skip", "--no-serve-check", [ctx.cite(md)])


def _contents(ctx: AuditContext) -> None:
    md = ctx.paths.model_dir
    arch = ctx.json(md / "architecture.json") or {}
    allowed = set(MODEL_DIR_BASE_FILES) | set(TOKENIZER_FILES) | {ctx.weight_path(arch).name}
    entries = sorted(md.iterdir(), key=lambda p: p.name)
    stray, logs, present = [], [], []
    for p in entries:
        if p.is_symlink() or not p.is_file():
            stray.append(p.name + ("/" if p.is_dir() else " (not a regular file)"))
        elif p.name in allowed:
            present.append(p.name)
        elif p.name in MODEL_DIR_LOGS:
            logs.append(p.name)
        else:
            stray.append(p.name)
    if stray:
        ctx.add("model dir contents", "fail", f"{len(stray)} files that are not config, generation config, "
                                              "tokenizer or weights: " + ", ".join(stray),
                [ctx.cite(md, "directory listing")], [f"stray: {s}" for s in stray])
    else:
        ctx.add("model dir contents", "pass", "only " + ", ".join(present)
                + (f" (and the pack stage's own {', '.join(logs)})" if logs else ""),
                [ctx.cite(md, "directory listing")])


def _load(ctx: AuditContext) -> None:
    md = ctx.paths.model_dir
    try:
        _, info = load_packed_model(md)
    except (QD4Error, OSError, ValueError) as e:
        ctx.add("strict load", "fail", f"the strict loader refuses the model dir: {e}",
                [ctx.cite(md / "draft.qd4", "QD04 header")])
        return
    ok = info.missing == 0 and info.unexpected == 0
    ctx.add("strict load", "pass" if ok else "fail",
            f"load_packed_model: missing={info.missing} unexpected={info.unexpected}",
            [ctx.cite(md / "draft.qd4", "header tensor names"), ctx.cite(md / "config.json")],
            info.unexpected_keys)


def _draft_context(ctx: AuditContext) -> list[int]:
    for t in ctx.traces or []:
        if t.get("prompt_ids"):
            return [int(x) for x in t["prompt_ids"][-64:]]
    return [1, 2, 3]


def _sandbox(ctx: AuditContext) -> None:
    md = ctx.paths.model_dir.resolve()
    out = ctx.paths.out
    result = run_server_sandboxed(md, out / "serve_check.log", out / "serve_check.events.jsonl",
                                  _draft_context(ctx), timeout_s=ctx.cfg.serve_timeout_s)
    ctx.facts["serve_check"] = result.to_json()
    log_path, events = out / "serve_check.log", out / "serve_check.events.jsonl"
    if result.error:
        ctx.add("server answers", "fail", f"sandboxed server: {result.error}",
                [ctx.cite(log_path, "listening on URL")], result.log_tail.splitlines()[-8:])
    else:
        ctx.add("server answers", "pass", f"started on {result.url}; POST /draft returned "
                                          f"{len(result.draft_ids)} tokens in {result.draft_seconds:.2f}s",
                [ctx.cite(log_path, "listening on URL")])
    load_cite = [ctx.cite(log_path, "loaded qd4 missing=.. unexpected=.. line")]
    if result.loaded is None:
        ctx.add("server load", "fail", "the server log has no 'loaded qd4 missing=.. unexpected=..' line",
                load_cite)
    else:
        ok = result.loaded == (0, 0)
        ctx.add("server load", "pass" if ok else "fail",
                f"server log: loaded qd4 missing={result.loaded[0]} unexpected={result.loaded[1]}", load_cite)
    roots = allowed_roots(md, result.python_roots, denied=[ctx.run_dir], own_dirs=[result.sandbox_dir],
                          created=result.created, absent=result.absent)
    opened = classify_opens(result.opens, roots)
    ctx.facts["serve_opens"] = {k: sorted(v) for k, v in opened.items()}
    net = result.network
    ctx.add("no network", "fail" if net else "pass",
            f"{len(net)} network attempts blocked and recorded" if net else
            f"no outgoing connection or name lookup (bind only: {', '.join(result.binds) or 'none'})",
            [ctx.cite(events, "event=connect|getaddrinfo|gethostbyname|sendto|bind|urllib")],
            [json.dumps(e) for e in net])
    other = sorted(opened["other"])
    writes = sorted(p for p, w in result.opens.items()
                    if w and classify_path(p, roots) != "temp" and not under(p, "/dev"))
    ctx.add("files read", "fail" if other else "pass",
            f"{len(other)} files opened outside the model dir, Python code/metadata and the server's own "
            "temp files" if other else
            f"{len(opened['model_dir'])} files opened in the model dir; the rest are Python code/metadata "
            f"({len(opened['python'])}), /proc /sys /dev ({len(opened['system'])}) and the server's own "
            f"sandbox dir or files it created ({len(opened['temp'])})",
            [ctx.cite(events, "event=open")], other)
    ctx.add("files written", "fail" if writes else "pass",
            f"{len(writes)} files opened for writing" if writes else
            "no file opened for writing (but /dev and files the server created itself)",
            [ctx.cite(events, "event=open write=true")], writes)
    spawned = result.spawned
    ctx.add("no subprocess", "fail" if spawned else "pass",
            f"{len(spawned)} processes spawned" if spawned else "no process spawned",
            [ctx.cite(events, "event=spawn")], [json.dumps(e) for e in spawned])
