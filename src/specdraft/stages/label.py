"""Teacher-forced labels: the target's greedy next token at every position of existing answers.

Greedy traces (`specdraft traces`) cost one sequential target step per token. Here the target reads a
prompt and the corpus's own reference answer in ONE forward pass and its argmax is kept at every answer
position: no sequential dependency, so where decoding is memory-bound (a GPU at small batch) many more
training tokens come from the same target time; on a compute-bound CPU the two cost about the same per
token, and the gain is long, varied contexts from the prompts at hand. The draft then learns "what would the
target say next after this context" on human-written contexts, next to the traces' target-written ones.
Traces stay the core signal; these labels add volume (docs/history.md, "3. Label", has both the cost per token
and what each adds to acceptance).

``--answers-from DRAFT_DIR`` labels the draft's own greedy continuations of the prompts instead (on-policy data,
as DistillSpec trains on): the contexts the draft will meet when it drafts, with what the target says next.

Output rows (traces-compatible, so `specdraft train --labels` reads them alongside traces):
``{"id", "source", "prompt_ids", "completion_ids": the reference answer's tokens (+ EOS), "target_ids":
the target's argmax at each of those positions}``; ``labels.summary.json`` and ``labels.log`` beside it.
Resumable: rows are appended per batch and a rerun skips the ids already written.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from pydantic import Field

from specdraft.core.config import StageConfig
from specdraft.core.io import RecordFileError, atomic_write_json, jsonl_line, read_jsonl, sha256_file
from specdraft.core.provenance import run_metadata
from specdraft.core.records import read_answers, read_prompts
from specdraft.core.stage import (
    LABEL_FIELDS,
    Progress,
    StageResult,
    peak_rss_mb,
    resume_rows,
    run_logged,
    write_running_summary,
)
from specdraft.model.chat import encode_prompts, has_chat_template
from specdraft.model.decode import iter_greedy
from specdraft.model.device import DEVICE_HELP, resolve_device
from specdraft.model.loader import ModelLoadError, load_draft, packed_weight_file
from specdraft.model.specs import (
    DEFAULT_TARGET,
    describe_source,
    load_model,
    load_tokenizer,
    tokenizer_fingerprint,
    weights_sha256,
)

log = logging.getLogger(__name__)


class LabelConfig(StageConfig):
    target: str = Field(DEFAULT_TARGET, description="target model spec (local dir | hub:ORG/NAME@REV | "
                                                    "embedded:NAME)")
    prompts: str = Field(description="prompts.jsonl from `specdraft prompts`; rows with a `response` are used")
    out: str = Field(description="output labels.jsonl; labels.summary.json and labels.log go beside it")
    limit: Optional[int] = Field(None, ge=1, description="label only the first N rows that have a response")
    max_seq_len: int = Field(1024, ge=16, description="prompt + answer tokens at most (the answer is cut)")
    min_answer_tokens: int = Field(8, ge=1, description="skip rows whose answer is shorter than this")
    batch_tokens: int = Field(8192, ge=64, description="padded tokens per forward pass")
    device: str = Field("auto", description=DEVICE_HELP)
    threads: Optional[int] = Field(None, ge=1, description="torch CPU threads (default: torch's choice)")
    answers_from: Optional[str] = Field(
        None, description="label a draft's own greedy continuations of the prompts instead of their reference "
                          "answers (on-policy data, as DistillSpec): a draft model dir, packed or HF; every prompt "
                          "is used, with a response or not")
    max_new_tokens: int = Field(64, ge=1, description="--answers-from: tokens the draft continues each prompt by")


def run_label(cfg: LabelConfig) -> StageResult:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    with torch.inference_mode():
        return run_logged(cfg.out, lambda out, summary_path, log_path: _run_label(cfg, out, summary_path, log_path))


def answer_ids(tokenizer, prompt_ids: list[int], response: str, max_seq_len: int) -> list[int]:
    """The answer's tokens as the target would write them after the prompt, ended by EOS, cut to fit."""
    ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids.append(int(eos))
    return ids[: max(0, max_seq_len - len(prompt_ids))]


def label_batch(model, sequences: list[list[int]], prompt_lens: list[int], pad_id: int) -> list[list[int]]:
    """Target argmax at each answer position, one right-padded forward pass; the head runs only on the
    positions that predict an answer token (prompt positions would waste most of the vocabulary matmul)."""
    device = next(model.parameters()).device
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    hidden = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
    rows, cols = [], []
    for row, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        # the prediction for answer token j comes from position p + j - 1
        rows += [row] * (len(seq) - p)
        cols += list(range(p - 1, len(seq) - 1))
    picked = hidden[torch.tensor(rows), torch.tensor(cols)]  # [T, H]
    head = model.get_output_embeddings()
    best = []
    for start in range(0, picked.shape[0], 1024):  # bounded [1024, V] logits, not [T, V]
        best += head(picked[start:start + 1024]).argmax(-1).tolist()
    out, start = [], 0
    for seq, p in zip(sequences, prompt_lens):
        n = len(seq) - p
        out.append(best[start:start + n])
        start += n
    return out


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so padding is small; each group's padded size fits batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, lengths[i])
        if current and w * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, w = [], lengths[i]
        current.append(i)
        width = w
    if current:
        batches.append(current)
    return batches


def _prompt_rows(cfg: LabelConfig) -> tuple[list[dict[str, Any]], int]:
    """Every prompt (first ``limit``) for on-policy labels; else the rows with a reference answer."""
    if not cfg.answers_from:
        return read_answers(cfg.prompts, cfg.limit)
    records = read_prompts(cfg.prompts)
    return [{"id": r.id, "source": r.source, "prompt": r.text} for r in records][: cfg.limit], len(records)


def _draft_weights_sha256(model_dir: str) -> str:
    """The draft's weights as the resume key knows them: its safetensors, or its packed QD04 file."""
    sha = weights_sha256(model_dir)
    if sha is None:
        packed = packed_weight_file(model_dir)
        if packed is None:
            raise ModelLoadError(f"--answers-from {model_dir}: no draft weights there (draft.qd4 or *.safetensors)")
        sha = sha256_file(packed)
    return sha


def _draft_answers(cfg: LabelConfig, prompt_ids: list[list[int]]) -> list[list[int]]:
    """The draft's greedy continuation of each templated prompt (its own EOS ends one), cut to fit max_seq_len."""
    draft, _ = load_draft(cfg.answers_from, "float32", device=resolve_device(cfg.device))
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    gens = dict(iter_greedy(draft, prompt_ids, cfg.max_new_tokens, batch_size=32, order=order))
    return [gens[i].tokens[: max(0, cfg.max_seq_len - len(p))] for i, p in enumerate(prompt_ids)]


def _run_label(cfg: LabelConfig, out: Path, summary_path: Path, log_path: Path) -> StageResult:
    started = time.time()
    rows, total_in_file = _prompt_rows(cfg)
    if not rows:  # an empty labels file would pass for a finished run
        raise RecordFileError(f"prompts file {cfg.prompts}: no row with a reference answer ('response') among "
                          f"{total_in_file}; label needs answers to teacher-force (the data stage keeps them)")
    target = describe_source(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    template = has_chat_template(tokenizer)
    key = {"target_weights_sha256": target.get("weights_sha256"), "target_gguf_sha256": target.get("gguf_sha256"),
           "chat_template": template, "tokenizer": tokenizer_fingerprint(tokenizer), "max_seq_len": cfg.max_seq_len}
    if cfg.answers_from:  # whose continuations, and how long: rows from another draft must not mix in
        key["answers_from"] = {"weights_sha256": _draft_weights_sha256(cfg.answers_from),
                               "max_new_tokens": cfg.max_new_tokens}
    done = resume_rows(out, summary_path, key, LABEL_FIELDS)  # ids and fields checked, a duplicate refused
    todo = [r for r in rows if str(r["id"]) not in done]
    base = {"stage": "label", "target": target,
            "prompts": {"path": str(cfg.prompts), "sha256": sha256_file(cfg.prompts), "records": total_in_file,
                        "with_response": len(rows)},
            "chat_template": template, "config": cfg.to_json_dict(), "resume_key": key}
    previous = write_running_summary(summary_path, base, len(done))
    log.info("label: %d prompts in %s, %d with a reference answer (limit %s), %d already in %s, %d to label",
             total_in_file, cfg.prompts, len(rows), cfg.limit, len(done), out, len(todo))

    this_run: dict[str, Any] = {"prompts": 0, "skipped_short": 0}
    if todo:
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in todo])
        drafted = _draft_answers(cfg, prompt_ids) if cfg.answers_from else None
        keep, sequences, prompt_lens = [], [], []
        for i, (rec, p) in enumerate(zip(todo, prompt_ids)):
            answer = drafted[i] if drafted is not None else answer_ids(tokenizer, p, rec["response"], cfg.max_seq_len)
            if not p or len(answer) < cfg.min_answer_tokens:  # prompt too long for max_seq_len, or no answer
                this_run["skipped_short"] += 1
                continue
            keep.append(rec)
            sequences.append(p + answer)
            prompt_lens.append(len(p))
        model = load_model(cfg.target, device=resolve_device(cfg.device))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        progress = Progress(len(keep), "label")
        agree = 0
        with open(out, "a", encoding="utf-8") as f:
            for batch in token_batches([len(s) for s in sequences], cfg.batch_tokens):
                labels = label_batch(model, [sequences[i] for i in batch], [prompt_lens[i] for i in batch], pad_id)
                for i, target_ids in zip(batch, labels):
                    p = prompt_lens[i]
                    answer = sequences[i][p:]
                    agree += sum(a == b for a, b in zip(answer, target_ids))
                    f.write(jsonl_line({"id": str(keep[i]["id"]), "source": keep[i].get("source"),
                                         "prompt_ids": sequences[i][:p], "completion_ids": answer,
                                         "target_ids": target_ids}) + "\n")
                    progress.update(p, len(answer))
                f.flush()  # one flush per batch: a kill loses at most the batch in flight
            os.fsync(f.fileno())
        this_run.update(progress.close())
        this_run["answer_tokens_equal_to_target_argmax"] = round(agree / max(1, this_run["completion_tokens"]), 4)
        log.info("labelled %d answers, %d tokens in %.1f s (%.1f labelled tok/s); the target's argmax equals the "
                 "reference token at %.1f%% of positions", this_run["prompts"], this_run["completion_tokens"],
                 this_run["wall_s"], this_run["completion_tokens_per_s"] or 0,
                 100 * this_run["answer_tokens_equal_to_target_argmax"])

    rows_written = tokens = 0
    for _, obj in read_jsonl(out):
        rows_written += 1
        tokens += len(obj["target_ids"])
    summary = {**base, "status": "complete", "rows": rows_written, "label_tokens": tokens,
               "this_run": {**this_run, "peak_rss_mb": peak_rss_mb()}, "runs": previous + [this_run],
               "wall_s": round(time.time() - started, 3), "run": run_metadata(), "log": str(log_path),
               "labels_sha256": sha256_file(out)}
    atomic_write_json(summary_path, summary)
    log.info("wrote %s (%d rows, %d labelled tokens) and %s", out, rows_written, tokens, summary_path)
    return StageResult(out=out, summary=summary_path, rows=rows_written, new_prompts=this_run["prompts"],
                       summary_data=summary)
