"""`specdraft traces` and `specdraft validation`: the target's greedy continuations, written resumably.

traces      prompts.jsonl -> traces.jsonl, one line per prompt:
            {"id", "source", "prompt_ids", "completion_ids", "finish_reason": "eos" | "length"}
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

Backends: ``hf`` runs ``specdraft.decode.iter_greedy`` (continuous batching over a static KV cache,
prompts longest first) on CPU or GPU; ``vllm`` hands token ids to ``vllm.LLM.generate`` (imported only
then) for GPUs, with tensor parallelism inside one process and data parallelism as ``--shard i/n``.

Resumable: lines are appended and flushed as prompts finish. A rerun first cuts a torn last line (a
killed write), skips the ids already present and appends the rest, so a killed run loses at most the
rows in flight and never leaves a duplicate. A rerun with a different target, token limit or template
is refused rather than mixed into the same file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

from pydantic import Field, field_validator

from .config import StageConfig
from .decode import Generation
from .models import DEFAULT_TARGET
from .provenance import atomic_write_json, read_json, run_metadata, sha256_file, stage_log, text_lines

log = logging.getLogger("specdraft.traces")

Backend = Literal["hf", "vllm"]
FINISH_REASONS = ("eos", "length")


class TracesError(ValueError):
    """A bad input file or an output that cannot be resumed; the message names the file and the reason."""


# ----------------------------------------------------------------------------------------------- configs

class _DecodeFields(StageConfig):
    target: str = Field(DEFAULT_TARGET, description="target model spec (local dir | hub:ORG/NAME@REV | embedded:NAME)")
    batch_size: int = Field(32, ge=1, description="hf backend: rows decoded together (finished rows are "
                                                  "replaced by waiting prompts)")
    backend: Backend = Field("hf", description="hf: specdraft's decode loop (CPU or GPU); vllm: vllm.LLM (GPU)")
    device: str = Field("auto", description="hf backend: torch device (auto: cuda when available, else cpu)")
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
    num_draft: int = Field(16, ge=1, description="target tokens per evaluation point; points every num_draft "
                                                 "tokens (offsets 0, n, 2n, ...) while n tokens remain")


def parse_shard(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"shard {text!r}: expected i/n, e.g. 0/4")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {text!r}: need 0 <= i < n")
    return i, n


# ----------------------------------------------------------------------------------------------- prompts

@dataclass(frozen=True)
class PromptRecord:
    id: str
    source: str  # corpus name (prompts.jsonl) or MT-bench category
    category: str  # MT-bench category, else the source
    text: str


def read_prompts(path: str | os.PathLike) -> list[PromptRecord]:
    """prompts.jsonl (``id``, ``prompt``, ``source``) or MT-bench (``question_id``, ``category``, ``turns``:
    the first turn). Ids must be unique: resuming relies on them."""
    path = Path(path)
    if not path.is_file():
        raise TracesError(f"prompts file {path}: no such file")
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for lineno, line in text_lines(path):
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TracesError(f"{where}: not valid JSON ({e.msg})") from None
        rec = _prompt_record(obj, where)
        if rec.id in seen:
            raise TracesError(f"{where}: duplicate id {rec.id!r} (first on line {seen[rec.id]})")
        seen[rec.id] = lineno
        records.append(rec)
    if not records:
        raise TracesError(f"prompts file {path}: no prompts")
    return records


def _prompt_record(obj: Any, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise TracesError(f"{where}: expected a JSON object")
    if "turns" in obj:  # MT-bench / Spec-Bench question
        turns, qid = obj.get("turns"), obj.get("question_id", obj.get("id"))
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise TracesError(f"{where}: 'turns' must be a list whose first item is a non-empty string")
        if qid is None:
            raise TracesError(f"{where}: missing 'question_id'")
        category = str(obj.get("category", "unknown"))
        return PromptRecord(id=str(qid), source=category, category=category, text=turns[0])
    for key in ("id", "prompt"):
        if key not in obj:
            raise TracesError(f"{where}: missing field {key!r} (expected id, source, prompt or MT-bench turns)")
    if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
        raise TracesError(f"{where}: 'prompt' must be a non-empty string")
    if not isinstance(obj["id"], (str, int)):
        raise TracesError(f"{where}: 'id' must be a string")
    source = str(obj.get("source", "unknown"))
    return PromptRecord(id=str(obj["id"]), source=source, category=str(obj.get("category", source)),
                        text=obj["prompt"])


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt inside the chat template (generation prompt added, thinking off); raw
    text (with the tokenizer's own special tokens) when the tokenizer has no template."""
    if has_chat_template(tokenizer):
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  enable_thinking=False, tokenize=False) for t in texts]
        # transformers 5 returns a BatchEncoding from tokenize=True; render, then tokenize without extras.
        return [list(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"]]
    return [list(ids) for ids in tokenizer(list(texts))["input_ids"]]


# ------------------------------------------------------------------------------------ resumable JSONL

def repair_jsonl(path: Path) -> int:
    """Cut a torn last line (a write killed half-way) so the file ends with a newline; returns the bytes cut."""
    if not path.is_file():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        pos = size
        chunk = 1 << 16
        keep = 0
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            block = f.read(pos - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        cut = size - keep
        if cut:
            f.truncate(keep)
    if cut:
        log.warning("%s: discarded a torn last line (%d bytes) left by an interrupted run", path, cut)
    return cut


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise TracesError(f"{path}:{lineno}: not valid JSON ({e.msg}); the file is damaged beyond a "
                                  "torn last line: move it away and rerun") from None


def drop_last_group(path: Path, key: str = "id") -> str | None:
    """Truncate the lines of the last ``key`` value: a group written by one flush may be cut short by a kill
    (validation writes all points of a prompt together). Returns the key dropped."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    last_key, group_start, offset = None, 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                k = json.loads(raw)[key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TracesError(f"{path}:{lineno}: not a JSON object with {key!r}; the file is damaged beyond "
                                  "a torn last line: move it away and rerun") from None
            if k != last_key:
                last_key, group_start = k, offset
            offset += len(raw)
    with open(path, "r+b") as f:
        f.truncate(group_start)
    return last_key


def jsonl_dumps(obj: dict) -> str:
    """One line: ASCII-only JSON, so no character inside can split the line for any reader."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


# ------------------------------------------------------------------------------------------- backends

def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class HFBackend:
    """specdraft's own decode loop: continuous batching over a static KV cache, longest prompts first."""

    name = "hf"

    def __init__(self, spec: str, device: str, batch_size: int):
        from .models import load_model
        self.device = _resolve_device(device)
        self.model = load_model(spec, device=self.device)  # float32: traces define the training targets
        self.batch_size = batch_size

    def eos_ids(self) -> set[int]:
        from .decode import eos_token_ids
        return eos_token_ids(self.model)

    def info(self) -> dict[str, Any]:
        import torch
        return {"backend": self.name, "device": self.device, "dtype": str(next(self.model.parameters()).dtype),
                "batch_size": self.batch_size, "torch_threads": torch.get_num_threads()}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Iterator[tuple[int, Generation]]:
        from .decode import iter_greedy
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        yield from iter_greedy(self.model, prompts, max_new_tokens, batch_size=self.batch_size, order=order)


class VLLMBackend:
    """vLLM's offline engine: token ids in, token ids out; greedy (temperature 0), float32."""

    name = "vllm"

    def __init__(self, spec: str, tensor_parallel_size: int, chunk: int, llm: Any = None, vllm_module: Any = None):
        from .models import resolve_model
        path = resolve_model(spec)
        if vllm_module is None:
            try:
                import vllm as vllm_module  # noqa: F811  (optional dependency: pip install 'specdraft[vllm]')
            except ImportError as e:
                raise TracesError("backend 'vllm' needs the vllm package (pip install 'specdraft[vllm]', on a "
                                  "machine with a GPU); use --backend hf otherwise") from e
        self.vllm = vllm_module
        self.llm = llm if llm is not None else vllm_module.LLM(
            model=str(path), tokenizer=str(path), dtype="float32", tensor_parallel_size=tensor_parallel_size,
            seed=0)
        self.chunk = chunk
        # vLLM stops at the tokenizer's EOS and at every generation-config EOS (stop_token_ids): know both.
        self._tokenizer_eos = _tokenizer_eos(path)
        self._eos = _eos_from_model_dir(path) | ({self._tokenizer_eos} if self._tokenizer_eos is not None else set())

    def eos_ids(self) -> set[int]:
        return set(self._eos)

    def info(self) -> dict[str, Any]:
        return {"backend": self.name, "dtype": "float32", "chunk": self.chunk,
                "vllm_version": getattr(self.vllm, "__version__", None)}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Iterator[tuple[int, Generation]]:
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens,
                                          stop_token_ids=sorted(self._eos))
        for start in range(0, len(prompts), self.chunk):
            idx = list(range(start, min(len(prompts), start + self.chunk)))
            requests = [{"prompt_token_ids": list(prompts[i])} for i in idx]
            outputs = self.llm.generate(prompts=requests, sampling_params=params, use_tqdm=False)
            if len(outputs) != len(requests):
                raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(requests)} requests")
            for i, out in zip(idx, outputs):
                yield i, vllm_generation(out, self._eos, self._tokenizer_eos)


def vllm_generation(request_output: Any, eos: set[int], tokenizer_eos: int | None = None) -> Generation:
    """A vLLM RequestOutput (``.outputs[0].token_ids``, ``.finish_reason`` stop|length) as a Generation whose
    tokens end with the EOS when it stopped there, like the hf backend.

    ``eos``: every id vLLM stops at (the tokenizer's EOS and the generation config's). vLLM reports a stop
    token id in ``stop_reason`` and its own EOS check (``tokenizer_eos``) as ``stop_reason=None``; an EOS is
    appended only when the output says it stopped on one and the token is not already its last."""
    completion = request_output.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    reason = completion.finish_reason
    if reason == "length":
        return Generation(tokens, "length")
    if reason != "stop":
        raise RuntimeError(f"vllm request finished with {reason!r} (expected stop or length)")
    if tokens and tokens[-1] in eos:
        return Generation(tokens, "eos")
    stop = getattr(completion, "stop_reason", None)
    if isinstance(stop, int) and stop in eos:
        return Generation(tokens + [stop], "eos")
    if stop is None and tokenizer_eos is not None:
        return Generation(tokens + [tokenizer_eos], "eos")
    raise RuntimeError(f"vllm stopped without an EOS token in its output (last token "
                       f"{tokens[-1] if tokens else None}, stop_reason={stop!r}, EOS ids {sorted(eos)})")


def _eos_from_model_dir(path: Path) -> set[int]:
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = read_json(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {int(eos)}
    return set()


def _tokenizer_eos(path: Path) -> int | None:
    from .models import load_tokenizer
    eos = load_tokenizer(path).eos_token_id
    return None if eos is None else int(eos)


def _backend_info(backend: Any) -> dict[str, Any]:
    info = getattr(backend, "info", None)
    return info() if callable(info) else {"backend": getattr(backend, "name", type(backend).__name__)}


def make_backend(cfg: _DecodeFields):
    if cfg.backend == "vllm":
        return VLLMBackend(cfg.target, cfg.tensor_parallel_size, cfg.vllm_chunk)
    return HFBackend(cfg.target, cfg.device, cfg.batch_size)


# --------------------------------------------------------------------------------------------- stages

@dataclass
class StageResult:
    out: Path
    summary: Path
    rows: int  # lines in the output file
    new_prompts: int  # prompts decoded by this run
    summary_data: dict[str, Any] = field(default_factory=dict)


def _side_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.stem + ".summary.json"), out.with_name(out.stem + ".log")


def _resume_key(target: dict[str, Any], cfg: StageConfig, template: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """What must match for a rerun to append to an existing output."""
    return {"target_weights_sha256": target.get("weights_sha256"), "target_gguf_sha256": target.get("gguf_sha256"),
            "max_new_tokens": cfg.max_new_tokens, "chat_template": template, **extra}


def _check_resume(summary_path: Path, out: Path, key: dict[str, Any], done: int) -> None:
    if not done:
        return
    if not summary_path.is_file():
        log.warning("%s has %d rows but no %s: cannot check they come from the same target", out, done,
                    summary_path.name)
        return
    previous = read_json(summary_path)
    old = previous.get("resume_key")
    if old is not None and old != key:
        diff = {k: (old.get(k), v) for k, v in key.items() if old.get(k) != v}
        raise TracesError(f"{out}: its rows were made with different settings {diff} (old, new); refusing to "
                          "mix them: use another --out or move the file away")
    if previous.get("status") != "complete":
        log.info("resuming an interrupted run: %d rows already in %s", done, out)


class _Progress:
    """tqdm over prompts with completion tokens/s; also the numbers the summary needs."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True, mininterval=1.0,
                        file=sys.stderr)
        self.started = time.perf_counter()
        self.prompts = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def update(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix(tok_s=f"{self.completion_tokens / elapsed:.1f}", refresh=False)
        self.bar.update(1)

    def close(self) -> dict[str, Any]:
        self.bar.close()
        wall = time.perf_counter() - self.started
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "wall_s": round(wall, 3),
                "completion_tokens_per_s": round(self.completion_tokens / wall, 2) if wall > 0 else None,
                "total_tokens_per_s": round((self.prompt_tokens + self.completion_tokens) / wall, 2)
                if wall > 0 else None}


def _peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)


def run_traces(cfg: TracesConfig, backend: Any = None) -> StageResult:
    """``backend`` (optional) replaces the one built from the config (tests pass a fake vLLM engine)."""
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary_path, log_path = _side_paths(out)
    with stage_log(log_path):
        return _run_traces(cfg, out, summary_path, log_path, backend)


def _run_traces(cfg: TracesConfig, out: Path, summary_path: Path, log_path: Path, backend: Any) -> StageResult:
    from .models import describe_source, load_tokenizer, tokenizer_fingerprint

    started = time.time()
    records = read_prompts(cfg.prompts)
    total_in_file = len(records)
    if cfg.limit is not None:
        records = records[:cfg.limit]
    shard_i, shard_n = parse_shard(cfg.shard)
    records = records[shard_i::shard_n]

    repair_jsonl(out)
    out.touch()
    done = _trace_ids(out)
    target = describe_source(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    template = has_chat_template(tokenizer)
    if not template:
        log.warning("target %s has no chat template: prompts are tokenized raw", cfg.target)
    key = _resume_key(target, cfg, template, {"tokenizer": tokenizer_fingerprint(tokenizer)})
    _check_resume(summary_path, out, key, len(done))
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
    previous_runs = _previous_runs(summary_path, len(done))
    atomic_write_json(summary_path, {**base, "status": "running", "runs": previous_runs, "run": run_metadata()})

    this_run: dict[str, Any] = {"prompts": 0}
    if todo:
        ids = encode_prompts(tokenizer, [r.text for r in todo])
        for rec, p in zip(todo, ids):
            if not p:
                raise TracesError(f"{cfg.prompts}: prompt {rec.id!r} has no tokens")
        backend = backend or make_backend(cfg)
        log.info("backend %s; decoding %d prompts (%d prompt tokens), max_new_tokens=%d, batch_size=%d",
                 backend.name, len(todo), sum(map(len, ids)), cfg.max_new_tokens, cfg.batch_size)
        progress = _Progress(len(todo), "traces")
        with open(out, "a", encoding="utf-8") as f:
            for i, gen in backend.generate(ids, cfg.max_new_tokens):
                rec = todo[i]
                f.write(jsonl_dumps({"id": rec.id, "source": rec.source, "prompt_ids": ids[i],
                                     "completion_ids": gen.tokens, "finish_reason": gen.finish_reason}) + "\n")
                f.flush()
                progress.update(len(ids[i]), len(gen.tokens))
            os.fsync(f.fileno())
        this_run = {**progress.close(), **_backend_info(backend)}
        if this_run["prompts"] != len(todo):
            raise RuntimeError(f"backend returned {this_run['prompts']} of {len(todo)} prompts")
        log.info("decoded %d prompts, %d completion tokens in %.1f s (%.1f tok/s)", this_run["prompts"],
                 this_run["completion_tokens"], this_run["wall_s"], this_run["completion_tokens_per_s"] or 0)
    else:
        log.info("nothing to decode: every selected prompt is already in %s", out)

    totals = _trace_totals(out, {r.id for r in records})
    this_run = {**this_run, "peak_rss_mb": _peak_rss_mb()}
    summary = {**base, "status": "complete", **totals, "this_run": this_run,
               "runs": previous_runs + [this_run],
               "backend": cfg.backend, "wall_s": round(time.time() - started, 3), "run": run_metadata(),
               "log": str(log_path), "traces_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s (%d rows: %d eos, %d length) and %s", out, totals["rows"], totals["finish_reasons"]["eos"],
             totals["finish_reasons"]["length"], summary_path)
    return StageResult(out=out, summary=summary_path, rows=totals["rows"], new_prompts=this_run["prompts"],
                       summary_data=summary)


def _previous_runs(summary_path: Path, done: int) -> list[dict[str, Any]]:
    """The finished runs that made the rows already in the file (a killed run leaves no record)."""
    if not done or not summary_path.is_file():
        return []
    runs = read_json(summary_path).get("runs") or []
    return runs if isinstance(runs, list) else []


# What a resumed output file's rows must hold (checked before any decoding: the totals written after the run read
# them again, and a bad row found then would leave the new work behind an unfinished summary).
TRACE_FIELDS = {"prompt_ids": list, "completion_ids": list, "finish_reason": str}
POINT_FIELDS = {"category": str, "context_ids": list, "target_ids": list}
LABEL_FIELDS = {"prompt_ids": list, "completion_ids": list, "target_ids": list}


def _checked_rows(path: Path, fields: dict[str, type]) -> Iterator[tuple[int, dict]]:
    for lineno, obj in read_jsonl(path):
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            raise TracesError(f"{path}:{lineno}: not a row this stage wrote (a JSON object with a string 'id'); "
                              "move the file away and rerun")
        bad = [name for name, kind in fields.items() if not isinstance(obj.get(name), kind)]
        if bad:
            raise TracesError(f"{path}:{lineno}: field(s) {bad} missing or of the wrong type (expected "
                              f"{', '.join(f'{n}: {fields[n].__name__}' for n in bad)}); move the file away and rerun")
        yield lineno, obj


def _trace_ids(path: Path, fields: dict[str, type] = TRACE_FIELDS) -> set[str]:
    ids: set[str] = set()
    for lineno, obj in _checked_rows(path, fields):
        rid = obj["id"]
        if rid in ids:
            raise TracesError(f"{path}:{lineno}: duplicate id {rid!r}")
        ids.add(rid)
    return ids


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


def run_validation(cfg: ValidationConfig, backend: Any = None) -> StageResult:
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary_path, log_path = _side_paths(out)
    with stage_log(log_path):
        return _run_validation(cfg, out, summary_path, log_path, backend)


def _run_validation(cfg: ValidationConfig, out: Path, summary_path: Path, log_path: Path,
                    backend: Any) -> StageResult:
    from .models import describe_source, load_tokenizer, tokenizer_fingerprint

    started = time.time()
    records = read_prompts(cfg.prompts)
    total_in_file = len(records)
    if cfg.limit is not None:
        records = records[:cfg.limit]
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
    done = {obj["id"] for _, obj in _checked_rows(out, POINT_FIELDS)}
    target = describe_source(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    template = has_chat_template(tokenizer)
    if not template:
        log.warning("target %s has no chat template: prompts are tokenized raw", cfg.target)
    key = _resume_key(target, cfg, template, {"num_draft": cfg.num_draft,
                                              "tokenizer": tokenizer_fingerprint(tokenizer)})
    _check_resume(summary_path, out, key, len(done))
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
        backend = backend or make_backend(cfg)
        progress = _Progress(len(todo), "validation")
        with open(out, "a", encoding="utf-8") as f:
            for i, gen in backend.generate(ids, cfg.max_new_tokens):
                rec, cont = todo[i], gen.tokens
                lines = [jsonl_dumps({"id": rec.id, "category": rec.category, "offset": o,
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
        this_run = {**progress.close(), **_backend_info(backend)}

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
               "this_run": {**this_run, "peak_rss_mb": _peak_rss_mb()}, "backend": cfg.backend,
               "wall_s": round(time.time() - started, 3), "run": run_metadata(), "log": str(log_path),
               "validation_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s: %d points from %d prompts", out, points, len(prompts_with_points))
    return StageResult(out=out, summary=summary_path, rows=points, new_prompts=this_run["prompts"],
                       summary_data=summary)
