"""`specdraft traces` and `specdraft validation`: the target's greedy continuations, written resumably.

traces      prompts.jsonl -> traces.jsonl, one line per prompt:
            {"id", "source", "prompt_ids", "completion_ids", "finish_reason": "eos" | "length"}, and with
            ``--top-logprobs K`` the target's K most likely ids and log-probabilities at every completion
            position ("top_ids", "top_logprobs": one list of K per completion token, the token itself first)
            + traces.summary.json (target source, prompts sha256, counts, tokens/s, config, versions,
            sha256 of traces.jsonl) + traces.log.
validation  held-out prompts (MT-bench ``turns[0]``, or prompts.jsonl) -> evaluation points, one line each:
            {"id", "category", "offset", "context_ids", "target_ids"}: the context is the templated prompt
            plus the target's greedy continuation up to ``offset`` (0, 16, 32, ...), the target the next
            ``num_draft`` greedy tokens. Acceptance is measured on this file. Prompts too short for one
            point are listed in the summary (``ids_without_points``) and not decoded again on a rerun.

Prompts are wrapped in the target's chat template (``add_generation_prompt=True``,
``enable_thinking=False``); a target without a template gets the raw prompt (logged). Decoding is greedy
only, in float32: the traces are the draft's training targets.

Backends are ``model.trace_backend.TraceBackend``s, used only through what that class declares: ``hf``
(``HFBackend``) runs ``model.decode.iter_greedy`` (continuous batching over a static KV cache, prompts longest
first) on CPU or GPU; ``vllm`` (``model.trace_vllm.VLLMBackend``) hands token ids to ``vllm.LLM.generate``
(imported only then) for GPUs, with tensor parallelism inside one process and data parallelism as
``--shard i/n``; ``llama.cpp`` (``model.trace_llamacpp.LlamaCppBackend``) decodes the target's GGUF file as
llama.cpp computes it, many prompts at once (CPU). A backend the stage builds it closes when decoding ends.

merge-traces  the shards of one traces run (``--shard i/n``, one process or job each) -> one traces.jsonl in the
            prompts file's order, the rows a single run writes (a single run's file lists them as they finish);
            traces.summary.json beside it records each shard's file and summary with their sha256, and the
            shards' shared settings (``traces_config``), so the audit follows it back to the shards.

Resumable: lines are appended and flushed as prompts finish. A rerun first cuts a torn last line (a
killed write), skips the ids already present and appends the rest, so a killed run loses at most the
rows in flight and never leaves a duplicate. A rerun with a different target, token limit or template
is refused rather than mixed into the same file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from pydantic import Field, field_validator, model_validator

from specdraft.core.config import StageConfig
from specdraft.core.io import (
    RecordFileError,
    atomic_file,
    atomic_write_json,
    drop_last_group,
    jsonl_line,
    read_json,
    read_jsonl,
    repair_jsonl,
    sha256_file,
)
from specdraft.core.provenance import run_metadata
from specdraft.core.records import PromptRecord, read_prompts
from specdraft.core.stage import (
    POINT_FIELDS,
    TRACE_FIELDS,
    Progress,
    StageResult,
    check_resume,
    checked_rows,
    peak_rss_mb,
    resume_key,
    resume_rows,
    run_logged,
    side_paths,
    write_running_summary,
)
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.model.chat import encode_prompts, has_chat_template
from specdraft.model.device import DEVICE_HELP
from specdraft.model.generation import Generation
from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_tokenizer, tokenizer_fingerprint
from specdraft.model.trace_backend import HFBackend, TraceBackend, append_generations
from specdraft.model.trace_llamacpp import LlamaCppBackend, target_gguf
from specdraft.model.trace_vllm import VLLMBackend

log = logging.getLogger(__name__)


Backend = Literal["hf", "vllm", "llama.cpp"]
FINISH_REASONS = ("eos", "length")
# stored log-probabilities are rounded: 1e-4 nats is far below what a draft's training resolves, and each
# position's K values are most of a row's bytes
LOGPROB_DECIMALS = 4


# ----------------------------------------------------------------------------------------------- configs

class _DecodeFields(StageConfig):
    target: str = Field(DEFAULT_TARGET, description="target model spec (local dir | hub:ORG/NAME@REV | embedded:NAME)")
    batch_size: int = Field(32, ge=1, description="hf and llama.cpp backends: rows (llama.cpp: sequences) decoded "
                                                  "together (finished rows are replaced by waiting prompts)")
    backend: Backend = Field("hf", description="hf: specdraft's decode loop (CPU or GPU), the float32 model; vllm: "
                                               "vllm.LLM (GPU); llama.cpp: the target's GGUF file as llama.cpp "
                                               "computes it (CPU; pip install 'specdraft[llama]')")
    threads: int = Field(0, ge=0, description="CPU threads: llama.cpp's, or torch's for hf on a CPU (0: one per "
                                              "core); with n shards on one machine, --threads 1 each")
    device: str = Field("auto", description=f"hf backend: {DEVICE_HELP}")
    limit: int | None = Field(None, ge=1, description="take only the first N prompts of the file")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm backend: GPUs per model (tensor parallel)")
    vllm_chunk: int = Field(1024, ge=1, description="vllm backend: prompts per LLM.generate() call; output is "
                                                    "flushed after each call")


class TracesConfig(_DecodeFields):
    """The target's greedy continuations of a prompts file, written resumably to traces.jsonl."""

    prompts: Path = Field(description="prompts.jsonl ({id, source, prompt} per line)")
    out: Path = Field(description="output traces.jsonl; traces.summary.json and traces.log go beside it")
    max_new_tokens: int = Field(256, ge=1, description="tokens generated per prompt at most (stop at EOS)")
    shard: str = Field("0/1", description="i/n: decode only prompts i, i+n, i+2n, ... (after --limit); run one "
                                          "process per shard (data parallel), each with its own --out")
    top_logprobs: int = Field(0, ge=0, le=64, description="keep the target's K most likely tokens and their "
                                                          "log-probabilities at every completion position (fields "
                                                          "top_ids, top_logprobs; `train --kd-stored` distils from "
                                                          "them); 0: tokens only. hf and llama.cpp backends")

    @model_validator(mode="after")
    def _top_logprobs_backend(self) -> "TracesConfig":
        if self.top_logprobs and self.backend == "vllm":
            raise ValueError("top_logprobs: the hf and llama.cpp backends only (vLLM's per-token logprobs are not "
                             "wired into the records yet)")
        return self

    @field_validator("shard")
    @classmethod
    def _check_shard(cls, v: str) -> str:
        parse_shard(v)
        return v


class ValidationConfig(_DecodeFields):
    """Held-out evaluation points: context_ids and the target's next num_draft greedy tokens."""

    prompts: Path = Field(description="held-out prompts: MT-bench jsonl (question_id, category, turns; the first "
                                      "turn is used) or prompts.jsonl (id, source, prompt)")
    out: Path = Field(description="output validation.jsonl; validation.summary.json and validation.log go "
                                  "beside it")
    max_new_tokens: int = Field(256, ge=1, description="length of the target's greedy continuation (stop at EOS)")
    num_draft: int = Field(DRAFT_TOKENS, ge=1, description="target tokens per evaluation point; points every "
                                                           "num_draft tokens (offsets 0, n, 2n, ...) while n tokens "
                                                           "remain")


class MergeTracesConfig(StageConfig):
    """The shards of one traces run, merged into one traces file."""

    shards: list[Path] = Field(description="a shard's traces.jsonl (its X.summary.json beside it); repeat for "
                                           "every shard i/n of the run, each once")
    out: Path = Field(description="merged traces.jsonl; traces.summary.json and traces.log go beside it")
    prompts: Path | None = Field(None, description="the prompts file the shards decoded (default: the path "
                                                   "their summaries record); its sha256 must be theirs")


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"shard {text!r}: expected i/n, e.g. 0/4")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {text!r}: need 0 <= i < n")
    return i, n


def make_backend(cfg: _DecodeFields) -> TraceBackend:
    if cfg.backend == "vllm":
        return VLLMBackend(cfg.target, cfg.tensor_parallel_size, cfg.vllm_chunk)
    if cfg.backend == "llama.cpp":
        return LlamaCppBackend(target_gguf(cfg.target), sequences=cfg.batch_size, threads=cfg.threads or None)
    return HFBackend(cfg.target, cfg.device, cfg.batch_size, threads=cfg.threads)


def engine_key(cfg: _DecodeFields) -> dict[str, Any]:
    """What the resume key adds for the engine: llama.cpp's continuations are another model's (the GGUF file, whose
    sha256 the target record holds, as llama.cpp computes it) than hf's and vllm's float32 ones, so their rows never
    mix; hf and vllm keep the key they had."""
    return {"engine": "llama.cpp"} if cfg.backend == "llama.cpp" else {}


@contextlib.contextmanager
def opened_backend(cfg: _DecodeFields, given: TraceBackend | None) -> Iterator[TraceBackend]:
    """``given`` as it is (its caller closes it), else the config's backend, closed when decoding ends."""
    if given is not None:
        yield given
        return
    with make_backend(cfg) as backend:
        yield backend


def run_traces(cfg: TracesConfig, backend: TraceBackend | None = None) -> StageResult:
    """``backend`` (optional) replaces the one built from the config (tests pass a fake vLLM engine); its caller
    closes it."""
    return run_logged(cfg.out, lambda out, summary_path, log_path: _run_traces(cfg, out, summary_path, log_path,
                                                                                backend))


def _limited_prompts(cfg: TracesConfig | ValidationConfig) -> tuple[list, int]:
    """(the prompts file's first ``--limit`` records, how many the file holds)."""
    records = read_prompts(cfg.prompts)
    return (records if cfg.limit is None else records[:cfg.limit]), len(records)


def _run_traces(cfg: TracesConfig, out: Path, summary_path: Path, log_path: Path,
                backend: TraceBackend | None) -> StageResult:
    started = time.time()
    records, total_in_file = _limited_prompts(cfg)
    shard_i, shard_n = parse_shard(cfg.shard)
    records = records[shard_i::shard_n]

    target = describe_source(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    template = has_chat_template(tokenizer)
    if not template:
        log.warning("target %s has no chat template: prompts are tokenized raw", cfg.target)
    key = resume_key(target, cfg, template, {"tokenizer": tokenizer_fingerprint(tokenizer), **engine_key(cfg)})
    done = resume_rows(out, summary_path, key)
    todo = [r for r in records if r.id not in done]
    log.info("traces: %d prompts in %s, %d selected (limit %s, shard %s), %d already in %s, %d to decode",
             total_in_file, cfg.prompts, len(records), cfg.limit, cfg.shard, len(done & {r.id for r in records}),
             out, len(todo))
    prompts_sha = sha256_file(cfg.prompts)
    if done and summary_path.is_file():
        old_sha = (read_json(summary_path).get("prompts") or {}).get("sha256")
        if old_sha and old_sha != prompts_sha:
            log.warning("%s changed since the rows in %s were made (sha256 %s -> %s); ids already there are kept",
                        cfg.prompts, out, old_sha[:12], prompts_sha[:12])
    base = {"stage": "traces", "target": target, "prompts": {"path": str(cfg.prompts), "sha256": prompts_sha,
                                                              "records": total_in_file, "selected": len(records)},
            "chat_template": template, "config": cfg.to_json_dict(), "resume_key": key}
    earlier_runs = write_running_summary(summary_path, base, len(done))

    if todo:
        this_run = _decode_traces(cfg, out, todo, encode_prompts(tokenizer, [r.text for r in todo]), backend)
    else:
        this_run = {"prompts": 0}
        log.info("nothing to decode: every selected prompt is already in %s", out)

    totals = _trace_totals(out, {r.id for r in records})
    this_run = {**this_run, "peak_rss_mb": peak_rss_mb()}
    summary = {**base, "status": "complete", **totals, "this_run": this_run,
               "runs": earlier_runs + [this_run],
               "backend": cfg.backend, "wall_s": round(time.time() - started, 3), "run": run_metadata(),
               "log": str(log_path), "traces_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s (%d rows: %d eos, %d length) and %s", out, totals["rows"], totals["finish_reasons"]["eos"],
             totals["finish_reasons"]["length"], summary_path)
    return StageResult(out=out, summary=summary_path, rows=totals["rows"], new_prompts=this_run["prompts"],
                       summary_data=summary)


def _decode_traces(cfg: TracesConfig, out: Path, todo: list[PromptRecord], ids: list[list[int]],
                   given: TraceBackend | None) -> dict[str, Any]:
    """Decode ``todo`` (encoded as ``ids``), appending each row to ``out`` and flushing it as its prompt
    finishes; this run's record (counts, speed, the backend's info)."""
    for rec, p in zip(todo, ids):
        if not p:
            raise RecordFileError(f"{cfg.prompts}: prompt {rec.id!r} has no tokens")
    with opened_backend(cfg, given) as backend:
        if cfg.top_logprobs and not backend.supports_top_logprobs:
            raise ValueError(f"top_logprobs: backend {backend.name!r} cannot return them; use --backend hf")
        log.info("backend %s; decoding %d prompts (%d prompt tokens), max_new_tokens=%d, batch_size=%d",
                 backend.name, len(todo), sum(map(len, ids)), cfg.max_new_tokens, cfg.batch_size)
        this_run = append_generations(backend, out, ids, cfg.max_new_tokens,
                                      lambda i, gen: _trace_row(todo[i], ids[i], gen, cfg.top_logprobs), "traces",
                                      cfg.top_logprobs)
    log.info("decoded %d prompts, %d completion tokens in %.1f s (%.1f tok/s)", this_run["prompts"],
             this_run["completion_tokens"], this_run["wall_s"], this_run["completion_tokens_per_s"] or 0)
    return this_run


def _trace_row(rec: PromptRecord, prompt_ids: list[int], gen: Generation, top_logprobs: int) -> dict[str, Any]:
    row = {"id": rec.id, "source": rec.source, "prompt_ids": prompt_ids, "completion_ids": gen.tokens,
           "finish_reason": gen.finish_reason}
    if top_logprobs:
        row["top_ids"] = gen.top_ids
        row["top_logprobs"] = [[round(x, LOGPROB_DECIMALS) for x in pos] for pos in gen.top_logprobs]
    return row


def _trace_totals(path: Path, selected: set[str]) -> dict[str, Any]:
    rows = prompt_tokens = completion_tokens = 0
    reasons: Counter = Counter({r: 0 for r in FINISH_REASONS})
    sources: Counter = Counter()
    found: set[str] = set()
    for _, obj in read_jsonl(path):
        rows += 1
        prompt_tokens += len(obj["prompt_ids"])
        completion_tokens += len(obj["completion_ids"])
        reasons[obj["finish_reason"]] += 1
        sources[obj.get("source")] += 1
        found.add(obj["id"])
    missing = len(selected - found)
    return {"rows": rows, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reasons": dict(reasons), "sources": dict(sources), "selected_missing": missing}


# ------------------------------------------------------------------------------------------ validation

def _ids_without_points(summary_path: Path, key: dict[str, Any]) -> set[str]:
    """Ids an earlier run with the same settings decoded and found too short for a point."""
    if not summary_path.is_file():
        return set()
    previous = read_json(summary_path)
    if previous.get("resume_key") != key:
        return set()
    return set(previous.get("ids_without_points") or [])


def evaluation_points(completion: Sequence[int], num_draft: int) -> list[int]:
    """Offsets 0, n, 2n, ... at which ``num_draft`` tokens of the continuation remain."""
    return list(range(0, len(completion) - num_draft + 1, num_draft))


def run_validation(cfg: ValidationConfig, backend: TraceBackend | None = None) -> StageResult:
    """``backend`` (optional) replaces the one built from the config; its caller closes it."""
    return run_logged(cfg.out, lambda out, summary_path, log_path: _run_validation(cfg, out, summary_path,
                                                                                    log_path, backend))


def _run_validation(cfg: ValidationConfig, out: Path, summary_path: Path, log_path: Path,
                    backend: TraceBackend | None) -> StageResult:
    started = time.time()
    records, total_in_file = _limited_prompts(cfg)
    repair_jsonl(out)
    # The last prompt's points may have been cut short by a kill: redo that prompt, unless the summary
    # vouches for the file as a finished run left it.
    finished = (summary_path.is_file() and out.is_file()
                and read_json(summary_path).get("validation_sha256") == sha256_file(out))
    dropped = None if finished else drop_last_group(out)
    if dropped is not None:
        log.info("%s: redoing the points of the last prompt written (%r), in case a kill cut them short",
                 out, dropped)
    out.touch()
    done = {obj["id"] for _, obj in checked_rows(out, POINT_FIELDS)}
    target = describe_source(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    template = has_chat_template(tokenizer)
    if not template:
        log.warning("target %s has no chat template: prompts are tokenized raw", cfg.target)
    key = resume_key(target, cfg, template, {"num_draft": cfg.num_draft,
                                              "tokenizer": tokenizer_fingerprint(tokenizer), **engine_key(cfg)})
    check_resume(summary_path, out, key, len(done))
    # Prompts whose continuation is too short for one point write no line: remember them, or every rerun
    # would decode them again.
    no_points = _ids_without_points(summary_path, key)
    todo = [r for r in records if r.id not in done and r.id not in no_points]
    base = {"stage": "validation", "target": target,
            "eval": {"path": str(cfg.prompts), "sha256": sha256_file(cfg.prompts), "records": total_in_file,
                     "selected": len(records)},
            "chat_template": template, "num_draft": cfg.num_draft, "config": cfg.to_json_dict(), "resume_key": key}
    running = {**base, "status": "running", "run": run_metadata()}
    atomic_write_json(summary_path, {**running, "ids_without_points": sorted(no_points)})
    log.info("validation: %d prompts selected, %d already in %s, %d known to give no point, %d to decode",
             len(records), len(done & {r.id for r in records}), out, len(no_points & {r.id for r in records}),
             len(todo))

    this_run: dict[str, Any] = {"prompts": 0}
    if todo:
        ids = encode_prompts(tokenizer, [r.text for r in todo])
        this_run = _decode_points(cfg, out, summary_path, todo, ids, backend, running, no_points)

    points = 0
    prompts_with_points: set[str] = set()
    categories: Counter = Counter()
    for _, obj in read_jsonl(out):
        points += 1
        prompts_with_points.add(obj["id"])
        categories[obj["category"]] += 1
    summary = {**base, "status": "complete", "points": points, "prompts": len(prompts_with_points),
               "prompts_without_points": len({r.id for r in records} - prompts_with_points),
               "ids_without_points": sorted(no_points),
               "points_per_category": dict(sorted(categories.items())),
               "this_run": {**this_run, "peak_rss_mb": peak_rss_mb()}, "backend": cfg.backend,
               "wall_s": round(time.time() - started, 3), "run": run_metadata(), "log": str(log_path),
               "validation_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s: %d points from %d prompts", out, points, len(prompts_with_points))
    return StageResult(out=out, summary=summary_path, rows=points, new_prompts=this_run["prompts"],
                       summary_data=summary)


def _decode_points(cfg: ValidationConfig, out: Path, summary_path: Path, todo: list[PromptRecord],
                   ids: list[list[int]], given: TraceBackend | None, running: dict[str, Any],
                   no_points: set[str]) -> dict[str, Any]:
    """Decode ``todo`` (encoded as ``ids``), appending each prompt's points to ``out`` in one write as it
    finishes; a prompt without a point joins ``no_points`` and the running summary at once. This run's record."""
    with opened_backend(cfg, given) as backend:
        progress = Progress(len(todo), "validation")
        with open(out, "a", encoding="utf-8") as f:
            for i, gen in backend.generate(ids, cfg.max_new_tokens):
                rec, cont = todo[i], gen.tokens
                lines = [jsonl_line({"id": rec.id, "category": rec.category, "offset": o,
                                      "context_ids": ids[i] + cont[:o], "target_ids": cont[o:o + cfg.num_draft]})
                         for o in evaluation_points(cont, cfg.num_draft)]
                if lines:
                    f.write("\n".join(lines) + "\n")  # one prompt's points in one write
                    f.flush()
                else:
                    no_points.add(rec.id)  # recorded at once, so that a killed run keeps it too
                    atomic_write_json(summary_path, {**running, "ids_without_points": sorted(no_points)})
                progress.update(len(ids[i]), len(cont))
            os.fsync(f.fileno())
        return {**progress.close(), **backend.info()}


# ------------------------------------------------------------------------------------------ merge-traces

# Settings that change only how fast a shard ran, not its rows: shards may differ in them.
THROUGHPUT_FIELDS = ("batch_size", "device", "tensor_parallel_size", "vllm_chunk", "threads")
# Settings that differ between the shards of one run by construction.
PER_SHARD_FIELDS = ("shard", "out", "prompts")


@dataclass
class _Shard:
    path: Path
    summary_path: Path
    summary: dict[str, Any]
    index: int
    count: int


def run_merge_traces(cfg: MergeTracesConfig) -> StageResult:
    return run_logged(cfg.out, lambda out, summary_path, log_path: _run_merge_traces(cfg, out, summary_path,
                                                                                      log_path))


def _run_merge_traces(cfg: MergeTracesConfig, out: Path, summary_path: Path, log_path: Path) -> StageResult:
    started = time.time()
    shards = _finished_shards(cfg.shards)
    if any(Path(sh.path).resolve() == out.resolve() for sh in shards):
        raise ValueError(f"{out}: the merged file would overwrite a shard; choose another --out")
    first = shards[0]
    decode = _shared_settings(shards)
    prompts_path, prompts_sha = _shared_prompts(cfg, shards)
    records = read_prompts(prompts_path)
    total_in_file = len(records)
    limit = decode.get("limit")
    if limit is not None:
        records = records[:limit]
    position = {r.id: k for k, r in enumerate(records)}
    rows: dict[str, dict] = {}
    owner: dict[str, Path] = {}
    for sh in shards:
        expected = {r.id for r in records[sh.index::sh.count]}
        for lineno, row in checked_rows(sh.path, TRACE_FIELDS):
            rid = row["id"]
            if rid in owner:
                raise RecordFileError(f"{sh.path}:{lineno}: id {rid!r} is also in {owner[rid]}: the shards overlap")
            if rid not in expected:
                where = (f"shard {position[rid] % sh.count}/{sh.count}'s" if rid in position
                         else f"not one of the selected prompts of {prompts_path}")
                raise RecordFileError(f"{sh.path}:{lineno}: id {rid!r} is {where}, not shard "
                                      f"{sh.index}/{sh.count}'s")
            rows[rid], owner[rid] = row, sh.path
        missing = sorted(expected - {rid for rid, path in owner.items() if path == sh.path}, key=position.get)
        if missing:
            raise RecordFileError(f"{sh.path}: {len(missing)} of shard {sh.index}/{sh.count}'s prompts have no row "
                                  f"(first {missing[0]!r}); resume that shard before merging")

    with atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rid in sorted(rows, key=position.__getitem__):  # the prompts file's order: any sharding, one file
            f.write(jsonl_line(rows[rid]) + "\n")

    totals = _trace_totals(out, set(position))
    summary = {
        "stage": "merge-traces", "status": "complete", "target": first.summary.get("target"),
        "prompts": {"path": str(prompts_path), "sha256": prompts_sha, "records": total_in_file,
                    "selected": len(records)},
        "chat_template": first.summary.get("chat_template"), "resume_key": first.summary.get("resume_key"),
        "backend": decode.get("backend"), "config": cfg.to_json_dict(), "traces_config": decode,
        "shards": [{"shard": f"{sh.index}/{sh.count}", "path": str(sh.path), "sha256": sha256_file(sh.path),
                    "summary": str(sh.summary_path), "summary_sha256": sha256_file(sh.summary_path),
                    "rows": sh.summary.get("rows")} for sh in shards],
        **totals, "wall_s": round(time.time() - started, 3), "run": run_metadata(), "log": str(log_path),
        "traces_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("merged %d shards into %s (%d rows) and %s", len(shards), out, totals["rows"], summary_path)
    return StageResult(out=out, summary=summary_path, rows=totals["rows"], new_prompts=0, summary_data=summary)


def _finished_shards(paths: Sequence[Path]) -> list[_Shard]:
    """Each shard's file and summary, refused unless a finished traces run wrote them unchanged; every shard i of
    one n, each once, in shard order."""
    if not paths:
        raise ValueError("merge-traces: no --shards given")
    shards = []
    for path in map(Path, paths):
        summary_path = side_paths(path)[0]
        if not path.is_file() or not summary_path.is_file():
            raise RecordFileError(f"{path}: a shard needs its traces file and {summary_path.name} beside it")
        summary = read_json(summary_path)
        if summary.get("stage") != "traces" or summary.get("status") != "complete":
            raise RecordFileError(f"{summary_path}: not a finished traces run (stage {summary.get('stage')!r}, "
                                  f"status {summary.get('status')!r}); resume that shard before merging")
        if summary.get("traces_sha256") != sha256_file(path):
            raise RecordFileError(f"{path}: changed since its run finished (sha256 differs from "
                                  f"{summary_path.name}'s traces_sha256)")
        index, count = parse_shard(str((summary.get("config") or {}).get("shard", "0/1")))
        shards.append(_Shard(path, summary_path, summary, index, count))
    counts = {sh.count for sh in shards}
    if len(counts) > 1:
        raise RecordFileError("merge-traces: shards of different runs (" + ", ".join(
            f"{sh.path}: {sh.index}/{sh.count}" for sh in shards) + ")")
    (count,) = counts
    by_index: dict[int, _Shard] = {}
    for sh in shards:
        if sh.index in by_index:
            raise RecordFileError(f"{sh.path} and {by_index[sh.index].path} are both shard {sh.index}/{count}")
        by_index[sh.index] = sh
    missing = sorted(set(range(count)) - set(by_index))
    if missing:
        raise RecordFileError(f"merge-traces: shard(s) {', '.join(f'{i}/{count}' for i in missing)} missing; pass "
                              f"all {count}")
    return [by_index[i] for i in range(count)]


def _shared_settings(shards: list[_Shard]) -> dict[str, Any]:
    """The decode settings every shard used (their config less what differs per shard or only sets speed); a
    shard whose rows were made otherwise is refused with the fields that differ."""
    def settings(sh: _Shard) -> dict[str, Any]:
        return {k: v for k, v in (sh.summary.get("config") or {}).items()
                if k not in THROUGHPUT_FIELDS + PER_SHARD_FIELDS}
    first = shards[0]
    for sh in shards[1:]:
        for name, a, b in (("settings", settings(first), settings(sh)),
                           ("resume_key", first.summary.get("resume_key"), sh.summary.get("resume_key"))):
            if a != b:
                diff = sorted(k for k in {*a, *b} if a.get(k) != b.get(k)) if isinstance(a, dict) and \
                    isinstance(b, dict) else name
                raise RecordFileError(f"{sh.summary_path}: made with other {name} than {first.summary_path} "
                                      f"({diff}); these are not shards of one run")
    return settings(first)


def _shared_prompts(cfg: MergeTracesConfig, shards: list[_Shard]) -> tuple[Path, str]:
    """The prompts file every shard decoded (--prompts, else the path they record), checked by its sha256."""
    recorded = {(sh.summary.get("prompts") or {}).get("sha256") for sh in shards}
    if len(recorded) != 1:
        raise RecordFileError("merge-traces: the shards decoded different prompts files (" + ", ".join(
            f"{sh.summary_path}: {(sh.summary.get('prompts') or {}).get('sha256')}" for sh in shards) + ")")
    (sha,) = recorded
    path = Path(cfg.prompts or (shards[0].summary.get("prompts") or {}).get("path") or "")
    if not path.is_file():
        raise RecordFileError(f"{shards[0].summary_path}: its prompts file {str(path)!r} is not here; pass --prompts")
    if sha256_file(path) != sha:
        raise RecordFileError(f"{path}: not the prompts file the shards decoded (sha256 differs from "
                              f"{shards[0].summary_path.name}'s prompts.sha256)")
    return path, sha
