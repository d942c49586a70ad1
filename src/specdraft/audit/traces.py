"""The traces link: the completions trained on are the declared target's own greedy choices for this run's
prompts, and the validation points come from the same target.

It proves that traces.summary.json describes a complete greedy run (hf, vllm or llama.cpp backend, no sampling
setting) of a pinned target still on disk with the recorded weights; that the rows, token counts, finish reasons
and sha256 are the recorded ones; that every trace id is a prompt of prompts.jsonl with the same source, and its
prompt_ids are that prompt in the target's chat template; that a few completions are the target's greedy
choices; and that validation.jsonl is complete and decoded by the same target.

The greedy choices are checked as the backend made them. hf and vllm traces are the float32 torch target's:
re-scored by it, their completion tokens must be its teacher-forced argmax. llama.cpp traces are the target's GGUF
file as llama.cpp computes it (quantised weights, 8-bit activations), which parts from the float32 model after some
tokens by design; so the GGUF file, its sha256 the one the traces recorded for the target, decodes the picked
prompts again through llama.cpp, one at a time, and must give every stored completion token for token (batched
decoding equals one prompt at a time bit for bit). Without llama-cpp-python, an engine that runs here, or the
target's GGUF file on this machine, that check is skipped, saying why.

A traces file merged from shards (`specdraft merge-traces`) is followed back to them: every shard i of n is there
once, unchanged since its own finished run (sha256 of its file and summary), of the same target and settings, and
the merged rows are exactly the shards' rows. The checks above then read the shards' shared settings
(``traces_config``) where a single run's summary has ``config``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from specdraft.audit.context import AuditContext, lookup, short
from specdraft.audit.models import argmax_mismatches, check_model_source, spread
from specdraft.core.io import read_json, read_jsonl
from specdraft.model.chat import encode_prompts
from specdraft.model.llamacpp import llama_cpp_module
from specdraft.model.llamacpp_check import engine_problem
from specdraft.model.specs import CONVERSION_RECORD, ModelSpecError, embedded_gguf_path, tokenizer_fingerprint
from specdraft.model.trace_llamacpp import LlamaCppBackend

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "do_sample", "sampling", "min_p", "typical_p")


def audit_traces(ctx: AuditContext) -> None:
    ctx.section = "traces"
    p = ctx.paths
    ctx.expect([(p.traces, "the target's traces, written by specdraft traces"),
                (p.traces_summary, "written by specdraft traces"),
                (p.validation, "evaluation points, written by specdraft validation"),
                (p.validation_summary, "written by specdraft validation")])
    summary = ctx.traces_summary
    if summary is None:  # what needs no summary still runs
        ctx.guard("trace ids", lambda: _ids(ctx))
        ctx.guard("validation", lambda: _validation(ctx, {}))
        return
    ctx.guard("traces summary", lambda: _summary(ctx, summary))
    if summary.get("stage") == "merge-traces":
        ctx.guard("traces shards", lambda: _shards(ctx, summary))
    ctx.run_checks(summary, [("target declared", _target), ("greedy", _greedy), ("traces counts", _counts),
                             ("trace ids", lambda c, _: _ids(c)), ("prompt ids", _prompt_ids),
                             ("finish reasons", _finish), ("stored distribution", _stored_distribution),
                             ("validation", _validation)])


def _settings_key(s: dict) -> str:
    """Where a summary keeps its decode settings: a merged file's are the shards' shared ``traces_config``."""
    return "traces_config" if s.get("stage") == "merge-traces" else "config"


def _summary(ctx: AuditContext, s: dict) -> None:
    sp = ctx.paths.traces_summary
    ok = s.get("stage") in ("traces", "merge-traces") and s.get("status") == "complete"
    ctx.add("traces complete", "pass" if ok else "fail",
            f"stage {s.get('stage')!r}, status {s.get('status')!r}",
            [ctx.cite(sp, "stage"), ctx.cite(sp, "status")])


def _shards(ctx: AuditContext, s: dict) -> None:
    """The merged file's lineage: each recorded shard file and summary unchanged, a finished traces run of the
    merged target and settings, shards 0..n-1 each once, and the merged rows exactly the shards' rows."""
    sp, tp = ctx.paths.traces_summary, ctx.paths.traces
    shards = s.get("shards") or []
    problems: list[str] = []
    indices: list[str] = []
    shard_rows: dict[str, dict] = {}
    for k, rec in enumerate(shards):
        path, summary_path = Path(rec.get("path") or ""), Path(rec.get("summary") or "")
        where = f"shards[{k}] ({rec.get('shard')}, {ctx.rel(path)})"
        if not path.is_file() or not summary_path.is_file():
            problems.append(f"{where}: file or summary missing")
            continue
        if ctx.sha(path) != rec.get("sha256"):
            problems.append(f"{where}: sha256 {short(ctx.sha(path))} != recorded {short(rec.get('sha256'))}")
        if ctx.sha(summary_path) != rec.get("summary_sha256"):
            problems.append(f"{where}: its summary changed since the merge")
        shard_summary = read_json(summary_path)
        if shard_summary.get("stage") != "traces" or shard_summary.get("status") != "complete":
            problems.append(f"{where}: not a finished traces run (status {shard_summary.get('status')!r})")
        if lookup(shard_summary, "target.weights_sha256") != lookup(s, "target.weights_sha256"):
            problems.append(f"{where}: another target than the merged file's")
        if shard_summary.get("resume_key") != s.get("resume_key"):
            problems.append(f"{where}: other decode settings (resume_key) than the merged file's")
        indices.append(str((shard_summary.get("config") or {}).get("shard")))
        for _, row in read_jsonl(path):
            if row.get("id") in shard_rows:
                problems.append(f"{where}: id {row.get('id')!r} is in two shards")
            shard_rows[str(row.get("id"))] = row
    count = len(shards)
    if sorted(indices) != sorted(f"{i}/{count}" for i in range(count)):
        problems.append(f"shards {sorted(indices)}: not every shard i/{count} once")
    if ctx.traces is not None:
        merged = {str(t.get("id")): {k: v for k, v in t.items() if k != "_line"} for t in ctx.traces}
        if merged != shard_rows:
            differ = sorted(i for i in {*merged, *shard_rows} if merged.get(i) != shard_rows.get(i))
            problems.append(f"{len(differ)} ids whose merged row is not the shards' row (first {differ[0]!r})")
    cites = [ctx.cite(sp, "shards"), ctx.cite(tp)]
    ctx.add("traces shards", "fail" if problems else "pass",
            f"{len(problems)} problems with the shards the traces were merged from" if problems else
            f"merged from {count} shard(s), each unchanged since its finished run, of the same target and "
            f"settings; the {len(shard_rows)} rows are exactly theirs", cites, problems)


def _target(ctx: AuditContext, s: dict) -> None:
    check_model_source(ctx, s.get("target"), ctx.paths.traces_summary, "target", "target declared", "target")
    tok = ctx.tokenizer()
    recorded = lookup(s, "resume_key.tokenizer")
    if tok is not None and tok[2] and recorded:
        ctx.check_equal("target tokenizer", tokenizer_fingerprint(tok[0]), recorded,
                        "vocabulary sha256 of the target's tokenizer and the one the traces recorded",
                        [ctx.cite(ctx.paths.traces_summary, "resume_key.tokenizer")], short)


def _greedy(ctx: AuditContext, s: dict) -> None:
    sp = ctx.paths.traces_summary
    config = s.get(_settings_key(s)) or {}
    sampling = sorted(k for k in config if any(w in k.lower() for w in SAMPLING_KEYS))
    backend = s.get("backend") or config.get("backend")
    ok = not sampling and backend in ("hf", "vllm", "llama.cpp")
    ctx.add("greedy", "pass" if ok else "fail",
            f"backend {backend!r} decodes greedily only; no sampling settings in the config" if ok else
            f"backend {backend!r}, sampling settings {sampling}: not the greedy traces stage",
            [ctx.cite(sp, "backend"), ctx.cite(sp, _settings_key(s))])
    n = ctx.cfg.greedy_check
    rows = [t for t in ctx.traces or [] if t.get("completion_ids") and t.get("prompt_ids")]
    if n == 0:
        ctx.add("greedy re-scored", "skip", "--greedy-check 0", [ctx.cite(ctx.paths.traces, "completion_ids")])
        return
    if not rows:
        ctx.add("greedy re-scored", "skip", "no traces", [ctx.cite(sp, "target.path")])
        return
    if backend == "llama.cpp":  # another computation of the target than the float32 model: its own judge
        _regenerated(ctx, s, spread(rows, n))
        return
    model, why, field = ctx.rescoring_model(lookup(s, "target.weights_sha256"))
    if model is None:
        ctx.add("greedy re-scored", "skip", why, [ctx.cite(sp, field)])
        return
    picks = spread(rows, n)
    mismatched, total, bad = argmax_mismatches(model, picks, "completion_ids", "traces.jsonl")
    cites = [ctx.cite(ctx.paths.traces, "completion_ids"), ctx.cite(sp, "target.path")]
    if not mismatched:
        ctx.add("greedy re-scored", "pass", f"{len(picks)} traces re-scored with the target: all {total} "
                                            "completion tokens are its argmax", cites)
    elif mismatched <= max(1, total // 100):
        ctx.add("greedy re-scored", "warn", f"{mismatched} of {total} completion tokens differ from the "
                                            "target's teacher-forced argmax (float near-ties?)", cites, bad)
    else:
        ctx.add("greedy re-scored", "fail", f"{mismatched} of {total} completion tokens are not the target's "
                                            "greedy choice", cites, bad)


def _regenerated(ctx: AuditContext, s: dict, picks: list[dict]) -> None:
    """llama.cpp traces: the picked prompts decoded again, one at a time, by llama.cpp from the target's GGUF file
    (its sha256 the one the traces recorded), each for as many tokens as its stored completion, must give that
    completion token for token."""
    sp = ctx.paths.traces_summary
    cites = [ctx.cite(ctx.paths.traces, "completion_ids"), ctx.cite(sp, "target.gguf_sha256")]
    gguf, why = _gguf_file(s)
    if gguf is None:
        ctx.add("greedy re-scored", "skip", f"llama.cpp traces, not decoded again: {why}", cites)
        return
    actual, recorded = ctx.sha(gguf), lookup(s, "target.gguf_sha256")
    if actual != recorded:
        ctx.add("greedy re-scored", "fail", f"{gguf} has sha256 {short(actual)}, the traces' target recorded "
                                            f"{short(recorded)}: not the file the traces were decoded from", cites)
        return
    gb = gguf.stat().st_size / 1e9
    if gb > ctx.cfg.greedy_check_max_gb:
        ctx.add("greedy re-scored", "skip", f"the target's GGUF file is {gb:.1f} GB, more than "
                                            f"--greedy-check-max-gb {ctx.cfg.greedy_check_max_gb}", cites)
        return
    try:
        llama_cpp_module()
    except ImportError as e:
        ctx.add("greedy re-scored", "skip", f"llama.cpp traces, not decoded again: {e}", cites)
        return
    problem = engine_problem()  # checked in a child: an engine that dies of an instruction would end the audit
    if problem:
        ctx.add("greedy re-scored", "skip", f"llama.cpp traces, not decoded again: {problem}", cites)
        return
    sizes = _recorded_batch_tokens(s)
    backends: dict[int | None, LlamaCppBackend] = {}
    bad, total = [], 0
    try:
        for t in picks:
            prompt, completion = list(t["prompt_ids"]), list(t["completion_ids"])
            total += len(completion)
            # a prompt longer than a prefill piece is split at the run's piece size, which moves its logits:
            # each recorded size that splits it differently is one way the run may have decoded it
            tries = {min(b, len(prompt)) if b else None: b for b in sizes}.values()
            got = []
            for b in tries:
                if b not in backends:
                    backends[b] = LlamaCppBackend(gguf, sequences=1, **({"batch_tokens": b} if b else {}))
                ((_, gen),) = backends[b].generate([prompt], len(completion))
                got = gen.tokens
                if got == completion:
                    break
            if got != completion:
                first = next((j for j, (x, y) in enumerate(zip(got, completion)) if x != y),
                             min(len(got), len(completion)))
                bad.append(f"{t.get('id')!r} (traces.jsonl line {t['_line']}): llama.cpp gives {len(got)} tokens, "
                           f"{len(completion)} stored, first different at completion position {first}")
    finally:
        for backend in backends.values():
            backend.close()
    cites.append(ctx.cite(sp, "runs"))
    if bad:
        ctx.add("greedy re-scored", "fail", f"{len(bad)} of {len(picks)} traces decoded again by llama.cpp from "
                                            f"{gguf.name} are not the stored completion", cites, bad)
    else:
        ctx.add("greedy re-scored", "pass", f"{len(picks)} traces decoded again by llama.cpp from {gguf.name} "
                                            f"(sha256 {short(actual)}, as recorded), one at a time: all {total} "
                                            "completion tokens are the stored ones", cites)


def _gguf_file(s: dict) -> tuple[Path | None, str | None]:
    """(the GGUF file of the traces' target, None), else (None, why not): an embedded target's own file, or the one
    its converted directory records. Its sha256 is the caller's to compare (``target_gguf`` would call a changed
    file absent)."""
    spec, path = str(lookup(s, "target.spec") or ""), lookup(s, "target.path")
    if spec.startswith("embedded:"):
        try:
            return embedded_gguf_path(spec.removeprefix("embedded:")), None
        except ModelSpecError as e:
            return None, str(e)
    record = Path(path or spec) / CONVERSION_RECORD
    if not record.is_file():
        return None, (f"target {spec!r} has no GGUF file on this machine (neither an embedded target nor a "
                      f"directory converted from one, with {CONVERSION_RECORD})")
    gguf = Path(read_json(record).get("gguf_path") or "")
    if not gguf.is_file():
        return None, f"{record}: its GGUF file {str(gguf)!r} is not on this machine"
    return gguf, None


def _recorded_batch_tokens(s: dict) -> list[int | None]:
    """The prefill piece sizes (``batch_tokens``) the runs that wrote the traces recorded -- a merged file's, its
    shards' runs; [None] (the backend's default) when none did."""
    runs = list(s.get("runs") or [])
    for rec in s.get("shards") or []:
        summary = Path(rec.get("summary") or "")
        if summary.is_file():
            runs += read_json(summary).get("runs") or []
    sizes = sorted({int(r["batch_tokens"]) for r in runs if isinstance(r, dict) and r.get("batch_tokens")})
    return sizes or [None]


def _counts(ctx: AuditContext, s: dict) -> None:
    sp, tp = ctx.paths.traces_summary, ctx.paths.traces
    if ctx.traces is None:
        return
    ctx.check_equal("traces sha256", ctx.sha(tp), s.get("traces_sha256"),
                    "traces.jsonl and traces.summary.json (sha256)",
                    [ctx.cite(tp), ctx.cite(sp, "traces_sha256")], short)
    rows = ctx.traces
    recount = {"rows": len(rows),
               "prompt_tokens": sum(len(t.get("prompt_ids") or []) for t in rows),
               "completion_tokens": sum(len(t.get("completion_ids") or []) for t in rows)}
    reasons = Counter(t.get("finish_reason") for t in rows)
    wrong = [f"{k}: {v} in traces.jsonl, {s.get(k)} recorded" for k, v in recount.items() if s.get(k) != v]
    recorded_reasons = s.get("finish_reasons") or {}
    wrong += [f"finish_reasons.{r}: {reasons.get(r, 0)} in traces.jsonl, {recorded_reasons.get(r)} recorded"
              for r in set(reasons) | set(recorded_reasons) if reasons.get(r, 0) != recorded_reasons.get(r, 0)]
    ctx.add("traces counts", "fail" if wrong else "pass",
            "counts differ from traces.summary.json" if wrong else
            f"{len(rows)} rows, {recount['prompt_tokens']} prompt + {recount['completion_tokens']} completion "
            "tokens, finish reasons " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=str)),
            [ctx.cite(sp, "rows"), ctx.cite(sp, "prompt_tokens"), ctx.cite(sp, "completion_tokens"),
             ctx.cite(sp, "finish_reasons")], wrong)
    ctx.facts["traces"] = recount
    if ctx.paths.prompts.is_file():
        ctx.check_equal("traces prompts sha256", ctx.sha(ctx.paths.prompts), lookup(s, "prompts.sha256"),
                        "prompts.jsonl and the prompts the traces were decoded from (sha256)",
                        [ctx.cite(ctx.paths.prompts), ctx.cite(sp, "prompts.sha256")], short)


def _ids(ctx: AuditContext) -> None:
    tp = ctx.paths.traces
    if ctx.traces is None or ctx.prompts is None:
        ctx.add("trace ids in prompts", "skip", "traces.jsonl or prompts.jsonl missing", [ctx.cite(tp, "id")])
        return
    prompts = {str(r.get("id")): r for r in ctx.prompts}
    ids = Counter(str(t.get("id")) for t in ctx.traces)
    missing = [f"line {t['_line']}: id {t.get('id')!r}" for t in ctx.traces if str(t.get("id")) not in prompts]
    dupes = [f"id {i!r} appears {n} times" for i, n in ids.items() if n > 1]
    wrong_source = [f"line {t['_line']}: id {t.get('id')!r} source {t.get('source')!r}, prompts.jsonl says "
                    f"{prompts[str(t.get('id'))].get('source')!r}" for t in ctx.traces
                    if str(t.get("id")) in prompts and t.get("source") != prompts[str(t.get("id"))].get("source")]
    cites = [ctx.cite(tp, "id"), ctx.cite(ctx.paths.prompts, "id")]
    if missing or dupes:
        ctx.add("trace ids in prompts", "fail", f"{len(missing)} trace ids are not in prompts.jsonl, "
                                                f"{len(dupes)} repeated", cites, missing + dupes)
    else:
        ctx.add("trace ids in prompts", "pass", f"all {len(ctx.traces)} trace ids are in prompts.jsonl "
                                                f"({len(prompts) - len(ids)} prompts without a trace)", cites)
    if wrong_source:
        ctx.add("trace sources", "fail", f"{len(wrong_source)} traces name a different source than their prompt",
                [ctx.cite(tp, "source"), ctx.cite(ctx.paths.prompts, "source")], wrong_source)


def _prompt_ids(ctx: AuditContext, s: dict) -> None:
    tp = ctx.paths.traces
    tok = ctx.tokenizer()
    if ctx.traces is None or ctx.prompts is None or tok is None or not tok[2]:
        ctx.add("prompt ids", "skip", "needs traces.jsonl, prompts.jsonl and the target's tokenizer",
                [ctx.cite(tp, "prompt_ids")])
        return
    prompts = {str(r.get("id")): r.get("prompt") for r in ctx.prompts}
    rows = [t for t in ctx.traces if str(t.get("id")) in prompts]
    encoded = encode_prompts(tok[0], [prompts[str(t.get("id"))] for t in rows])
    bad = [f"line {t['_line']}: id {t.get('id')!r}" for t, ids in zip(rows, encoded)
           if list(t.get("prompt_ids") or []) != list(ids)]
    cites = [ctx.cite(tp, "prompt_ids"), ctx.cite(ctx.paths.prompts, "prompt"),
             ctx.cite(ctx.paths.traces_summary, "chat_template")]
    if bad:
        ctx.add("prompt ids", "fail", f"{len(bad)} traces' prompt_ids are not their prompt in the target's "
                                      "chat template", cites, bad)
    else:
        ctx.add("prompt ids", "pass", f"all {len(rows)} traces' prompt_ids are their prompt.jsonl text in the "
                                      "target's chat template", cites)


def _eos_ids(ctx: AuditContext) -> set[int]:
    for d in (ctx.target_dir(), ctx.paths.checkpoint, ctx.paths.model_dir):
        for name in ("generation_config.json", "config.json"):
            f = Path(d, name) if d else None
            if f is not None and f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                if eos is not None:
                    return set(eos) if isinstance(eos, list) else {int(eos)}
    return set()


def _finish(ctx: AuditContext, s: dict) -> None:
    if ctx.traces is None:
        return
    max_new = lookup(s, f"{_settings_key(s)}.max_new_tokens")
    eos = _eos_ids(ctx)
    bad = []
    for t in ctx.traces:
        comp, reason = t.get("completion_ids") or [], t.get("finish_reason")
        where = f"line {t['_line']}: id {t.get('id')!r}"
        if reason == "length" and max_new is not None and len(comp) != max_new:
            bad.append(f"{where}: finish_reason length with {len(comp)} tokens (max_new_tokens {max_new})")
        elif reason == "eos" and eos and (not comp or comp[-1] not in eos):
            bad.append(f"{where}: finish_reason eos but the last token is not an EOS id {sorted(eos)}")
        elif reason not in ("eos", "length"):
            bad.append(f"{where}: finish_reason {reason!r}")
        elif max_new is not None and len(comp) > max_new:
            bad.append(f"{where}: {len(comp)} tokens > max_new_tokens {max_new}")
    cites = [ctx.cite(ctx.paths.traces, "finish_reason"), ctx.cite(ctx.paths.traces_summary,
                                                                   f"{_settings_key(s)}.max_new_tokens")]
    ctx.add("finish reasons", "fail" if bad else "pass",
            f"{len(bad)} traces end inconsistently with their finish_reason" if bad else
            f"every trace ends at an EOS {sorted(eos)} or at max_new_tokens={max_new}", cites, bad)


def _stored_distribution(ctx: AuditContext, s: dict) -> None:
    """With ``top_logprobs`` K in the config, every row keeps K ids and log-probabilities per completion token,
    the greedy token first (it is the argmax); without it, no row has them."""
    if ctx.traces is None:
        return
    k = lookup(s, f"{_settings_key(s)}.top_logprobs") or 0
    bad = []
    for t in ctx.traces:
        comp, ids, lps = t.get("completion_ids") or [], t.get("top_ids"), t.get("top_logprobs")
        where = f"line {t['_line']}: id {t.get('id')!r}"
        if not k:
            if ids is not None or lps is not None:
                bad.append(f"{where}: top_ids / top_logprobs without top_logprobs in the config")
            continue
        if not (isinstance(ids, list) and isinstance(lps, list) and len(ids) == len(lps) == len(comp)):
            bad.append(f"{where}: not one top-{k} list per completion token")
        elif any(len(i) != k or len(v) != k or not i or i[0] != tok for i, v, tok in zip(ids, lps, comp)):
            bad.append(f"{where}: a position without {k} ids and log-probabilities, or whose most likely id is not "
                       "the greedy token")
    if not k and not bad:
        return  # nothing stored, nothing to say
    cites = [ctx.cite(ctx.paths.traces, "top_ids"),
             ctx.cite(ctx.paths.traces_summary, f"{_settings_key(s)}.top_logprobs")]
    ctx.add("stored distribution", "fail" if bad else "pass",
            f"{len(bad)} traces do not hold the declared top-{k} distribution" if bad else
            f"every completion token has the target's top-{k} ids and log-probabilities, the greedy token first",
            cites, bad)


def _validation(ctx: AuditContext, s: dict) -> None:
    vp, vs_path = ctx.paths.validation, ctx.paths.validation_summary
    vs = ctx.validation_summary
    if vs is None:
        return
    ok = vs.get("stage") == "validation" and vs.get("status") == "complete"
    ctx.add("validation complete", "pass" if ok else "fail",
            f"stage {vs.get('stage')!r}, status {vs.get('status')!r}", [ctx.cite(vs_path, "status")])
    if vp.is_file():
        ctx.check_equal("validation sha256", ctx.sha(vp), vs.get("validation_sha256"),
                        "validation.jsonl and validation.summary.json (sha256)",
                        [ctx.cite(vp), ctx.cite(vs_path, "validation_sha256")], short)
        with open(vp, encoding="utf-8") as f:
            points = sum(1 for line in f if line.strip())
        ctx.check_equal("validation points", points, vs.get("points"), "evaluation points",
                        [ctx.cite(vp), ctx.cite(vs_path, "points")])
    ctx.check_same_target("validation target", vs_path, vs.get("target") or {}, "the validation stage's target")
