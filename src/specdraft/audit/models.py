"""What the traces and training links both check about models: a recorded model source (``describe_source``)
names its spec and pins its weights -- and still matches them when the model is on this machine -- and a
model's teacher-forced argmax equals the tokens recorded as its choice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.audit.context import AuditContext, short
from specdraft.core.io import COMMIT_RE, SHA256_RE
from specdraft.model.specs import ModelSpecError, embedded_gguf_path


def check_model_source(ctx: AuditContext, src: dict | None, file: Path, key: str, check: str, role: str) -> None:
    """A model source record (describe_source): names the spec and pins it; re-hash it when it is here."""
    if not isinstance(src, dict) or not src.get("spec"):
        ctx.add(check, "fail", f"{role}: no model spec recorded", [ctx.cite(file, key)])
        return
    spec = str(src["spec"])
    cites = [ctx.cite(file, f"{key}.spec")]
    problems = []
    if not SHA256_RE.fullmatch(str(src.get("weights_sha256") or "")):
        problems.append("no weights_sha256")
    if spec.startswith("hub:"):
        rev = src.get("revision")
        cites.append(ctx.cite(file, f"{key}.revision"))
        spec_rev = spec.partition("@")[2]
        if not rev:
            problems.append("no revision")
        elif rev != spec_rev:
            problems.append(f"revision {rev!r} is not the spec's {spec_rev!r}")
        elif not COMMIT_RE.fullmatch(rev):
            ctx.add(check, "warn", f"{role} {spec}: revision {rev!r} is a tag, not a 40-hex commit", cites)
        pin = f"revision {rev}"
    elif spec.startswith("embedded:"):
        cites.append(ctx.cite(file, f"{key}.gguf_sha256"))
        if not SHA256_RE.fullmatch(str(src.get("gguf_sha256") or "")):
            problems.append("no gguf_sha256")
        pin = f"gguf sha256 {short(src.get('gguf_sha256'))}"
    else:
        pin = "local weights"
    cites.append(ctx.cite(file, f"{key}.weights_sha256"))
    if problems:
        ctx.add(check, "fail", f"{role} {spec}: " + "; ".join(problems), cites)
        return
    ctx.add(check, "pass", f"{role} {spec} ({pin}, weights sha256 {short(src['weights_sha256'])})", cites)
    _still_on_disk(ctx, src, file, key, check, role)
    if spec.startswith("embedded:"):
        _installed_gguf(ctx, src, file, key, check, role)


def _still_on_disk(ctx: AuditContext, src: dict, file: Path, key: str, check: str, role: str) -> None:
    path = src.get("path")
    if path and Path(path).is_dir():
        actual = ctx.weights_sha(path)
        if actual == src["weights_sha256"]:
            ctx.add(check + " still on disk", "pass", f"{role}: {path} still has weights sha256 "
                                                      f"{short(actual)}", [ctx.cite(file, f"{key}.path")])
        else:
            ctx.add(check + " still on disk", "fail", f"{role}: {path} now has weights sha256 {short(actual)}, "
                                                      f"recorded {short(src['weights_sha256'])}",
                    [ctx.cite(file, f"{key}.weights_sha256")])
    else:
        ctx.add(check + " still on disk", "skip",
                f"{role}: {path!r} is not on this machine; the recorded hashes are audited as they are",
                [ctx.cite(file, f"{key}.path")])


def _installed_gguf(ctx: AuditContext, src: dict, file: Path, key: str, check: str, role: str) -> None:
    spec = str(src["spec"])
    try:
        gguf = embedded_gguf_path(spec.removeprefix("embedded:"))
    except ModelSpecError as e:
        ctx.add(check + " gguf", "skip", f"{role}: {e}", [ctx.cite(file, f"{key}.gguf_sha256")])
        return
    actual = ctx.sha(gguf)
    ctx.add(check + " gguf", "pass" if actual == src.get("gguf_sha256") else "fail",
            f"{role}: installed {gguf.name} sha256 {short(actual)}, recorded "
            f"{short(src.get('gguf_sha256'))}", [ctx.cite(file, f"{key}.gguf_sha256")])


def spread(rows: list[dict], n: int) -> list[dict]:
    """Up to n rows spread evenly over the list (first and last included), each once."""
    picks = [rows[round(i * (len(rows) - 1) / max(1, n - 1))] for i in range(min(n, len(rows)))]
    return list({id(r): r for r in picks}.values())


def argmax_mismatches(model, rows: list[dict], expected_key: str, file_label: str) -> tuple[int, int, list[str]]:
    """Teacher-forced argmax of ``model`` over prompt_ids + completion_ids against ``row[expected_key]``:
    (tokens that differ, tokens compared, one line per row with a difference)."""
    device = next(model.parameters()).device
    mismatched, total, bad = 0, 0, []
    with torch.inference_mode():
        for t in rows:
            prompt, completion, expected = list(t["prompt_ids"]), list(t["completion_ids"]), list(t[expected_key])
            ids = torch.tensor([prompt + completion], device=device)
            preds = model(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            miss = sum(int(a != b) for a, b in zip(preds, expected))
            total += len(expected)
            mismatched += miss
            if miss:
                first = next(j for j, (a, b) in enumerate(zip(preds, expected)) if a != b)
                bad.append(f"{t.get('id')!r} ({file_label} line {t['_line']}): {miss} of {len(expected)} tokens "
                           f"differ from the target's argmax, first at completion position {first}")
    return mismatched, total, bad
