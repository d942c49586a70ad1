"""Distil a draft model from the target's greedy traces.

The draft starts from a smaller pretrained model that shares the target's tokenizer, or from the
target's own first layers (``truncate:TARGET_SPEC:N``). It is trained with cross-entropy on the target's
greedy completion tokens (prompt positions masked) and, with ``kd``, a KL term to the target's logits
computed online (DistillSpec). ``labels`` adds teacher-forced rows (`specdraft label`): reference answers as
context, the target's argmax at each position as the label; cheaper per token than traces. ``qat_group_size``
trains through the packer's 4-bit rounding. The loop reads top to bottom: ``make_batches`` -> ``train_step`` ->
``evaluate`` (held-out loss + simulated acceptance) -> ``save_checkpoint``.

Simulated acceptance is exact for greedy drafting: because held-out completions are the target's own
greedy tokens, a 16-token greedy draft starting at offset o accepts exactly the leading run of
positions where the draft's teacher-forced argmax equals the target token, so one forward pass per
sequence scores every offset. The score goes through ``metrics.AcceptanceStats``, as in ``specdraft eval``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field

from . import qd4
from .config import StageConfig
from .metrics import AcceptanceStats
from .models import (DEFAULT_TARGET, describe_source, resolve_model, tokenizer_fingerprint, tokenizer_from_dir,
                     weight_file_problems)
from .provenance import atomic_write_json, read_json, run_metadata, sha256_file, stage_log, text_lines

log = logging.getLogger("specdraft.train")


class TrainConfig(StageConfig):
    traces: str = Field(description="traces.jsonl written by `specdraft traces`")
    labels: Optional[str] = Field(None, description="labels.jsonl from `specdraft label` (the target's argmax on "
                                                    "reference answers), trained on together with the traces")
    init: str = Field(description="draft init: a model spec, or truncate:TARGET_SPEC:N "
                                  "(N layers, or a comma list of layer indices to keep)")
    out: str = Field(description="output checkpoint directory (the best checkpoint; last/ for resume)")
    target: Optional[str] = Field(None, description="target model spec (default: the one recorded "
                                                     "in traces.summary.json, else the embedded default)")
    epochs: float = Field(3.0, gt=0, description="passes over the training traces")
    max_steps: Optional[int] = Field(None, description="stop after this many optimizer steps")
    lr: float = Field(1e-3, gt=0, description="peak learning rate (AdamW)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    batch_tokens: int = Field(1024, gt=0, description="tokens per micro-batch (length-bucketed; padded "
                                                    "width x rows)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    clip_norm: float = Field(1.0, gt=0, description="gradient clipping norm")
    max_seq_len: int = Field(1024, gt=8, description="longer traces are cut from the left of the prompt")
    kd: bool = Field(False, description="add KL to the target's logits (target loaded alongside)")
    kd_weight: float = Field(0.5, ge=0, le=1, description="loss = (1-w)*CE + w*KL when kd is on")
    kd_temperature: float = Field(1.0, gt=0, description="softmax temperature for the KL term")
    train_embeddings: bool = Field(False, description="also train the (tied) embedding / lm_head")
    qat_group_size: Optional[int] = Field(
        None, ge=2, description="quantisation-aware training: the model computes with the weights `specdraft "
                                "pack --group-size G` will store (every linear layer and the embedding, 4-bit; "
                                "straight-through gradient for the trained ones), so fine-tuning deltas smaller "
                                "than a 4-bit step are not rounded away at pack time")
    freeze_layers: int = Field(0, ge=0, description="keep the first M decoder layers frozen (cheaper "
                                                    "backward, less overfitting on few traces)")
    heldout_fraction: float = Field(0.05, ge=0, lt=1, description="fraction of traces held out (by id hash)")
    heldout_traces: Optional[str] = Field(None, description="a separate greedy traces file to score instead "
                                                            "of the held-out fraction (e.g. eval prompts)")
    heldout_max: int = Field(64, ge=1, description="at most this many held-out traces are scored")
    eval_every: int = Field(25, ge=1, description="evaluate every K optimizer steps")
    num_draft: int = Field(16, ge=1, description="draft length for simulated acceptance")
    seed: int = Field(0, description="seed for data order and init")
    mixed_precision: Literal["auto", "no", "bf16"] = Field(
        "auto", description="auto = bf16 on GPU, fp32 on CPU")
    threads: Optional[int] = Field(None, description="torch CPU threads (default: torch's choice)")


# ------------------------------------------------------------------------------------------- init

def parse_truncate_spec(init: str) -> tuple[str, list[int] | int] | None:
    if not init.startswith("truncate:"):
        return None
    body = init.removeprefix("truncate:")
    spec, _, layers = body.rpartition(":")
    if not spec or not re.fullmatch(r"\d+(,\d+)*", layers):
        raise ValueError(f"--init {init!r}: expected truncate:TARGET_SPEC:N or truncate:TARGET_SPEC:i,j,k "
                         "(N, i, j, k: layer counts / indices)")
    if "," in layers:
        return spec, [int(x) for x in layers.split(",")]
    return spec, int(layers)


def truncate_model(model, keep: list[int] | int):
    """Keep the given decoder layers (first N when an int), with the target's embeddings, norm and head."""
    n_layers = model.config.num_hidden_layers
    keep = list(range(keep)) if isinstance(keep, int) else list(keep)
    if not keep or any(i < 0 or i >= n_layers for i in keep):
        raise ValueError(f"layers {keep} out of range for a {n_layers}-layer model")
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by position in the stack
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def build_init(init: str):
    """(model, tokenizer, source description) for the draft's initialisation."""
    from transformers import AutoModelForCausalLM

    truncated = parse_truncate_spec(init)
    spec = truncated[0] if truncated else init
    path = resolve_model(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = tokenizer_from_dir(path)
    source = describe_source(spec)
    if truncated:
        truncate_model(model, truncated[1])
        source["truncate_layers"] = truncated[1]
    source["init"] = init
    return model, tokenizer, source


# ------------------------------------------------------------------------------------------- data

@dataclass
class Example:
    id: str
    input_ids: list[int]
    prompt_len: int  # positions < prompt_len are not trained on
    # What the target says at each completion position. None for greedy traces, where it is the completion
    # itself; teacher-forced labels (`specdraft label`) differ from the (human-written) completion.
    targets: list[int] | None = None

    @property
    def completion(self) -> list[int]:
        return self.input_ids[self.prompt_len:]


def _token_ids(rec: dict, field: str, where: str) -> list[int]:
    ids = rec.get(field)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"{where}: field {field!r} must be a list of token ids (integers >= 0), "
                         f"got {type(ids).__name__}")
    return ids


def read_traces(path: str | Path, max_seq_len: int) -> list[Example]:
    """Greedy traces, or teacher-forced labels (rows with ``target_ids``, one per completion token)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such traces file")
    examples = []
    for lineno, line in text_lines(path):
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise ValueError(f"{where}: expected a JSON object with an 'id'")
        prompt, completion = _token_ids(rec, "prompt_ids", where), _token_ids(rec, "completion_ids", where)
        targets = _token_ids(rec, "target_ids", where) if rec.get("target_ids") is not None else None
        if targets is not None and len(targets) != len(completion):
            raise ValueError(f"{where}: {len(targets)} target_ids for {len(completion)} completion ids")
        if not completion:
            continue
        completion = completion[: max_seq_len - 1]
        prompt = prompt[-(max_seq_len - len(completion)):]
        examples.append(Example(str(rec["id"]), prompt + completion, len(prompt),
                                None if targets is None else list(targets[: len(completion)])))
    if not examples:
        raise ValueError(f"{path}: no usable traces")
    return examples


def _check_vocab(examples: list[Example], path, vocab_size: int) -> None:
    max_id = max(max(max(ex.input_ids), max(ex.targets or [0])) for ex in examples)
    if max_id >= vocab_size:
        raise ValueError(f"{path} uses token id {max_id} but the draft's vocab has {vocab_size}")


def split_heldout(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Deterministic split by id hash, so the split does not move when traces are appended."""
    def bucket(ex: Example) -> float:
        return int(hashlib.sha256(ex.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    heldout = [ex for ex in examples if bucket(ex) < fraction]
    train = [ex for ex in examples if bucket(ex) >= fraction]
    return train, heldout


def make_batches(examples: list[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches (indices) for one epoch: shuffle, sort within pools, pack to a token budget."""
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    pool = 256
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: len(examples[i].input_ids))
        batch: list[int] = []
        width = 0
        for i in chunk:
            n = len(examples[i].input_ids)
            if batch and max(width, n) * (len(batch) + 1) > batch_tokens:
                batches.append(batch)
                batch, width = [], 0
            batch.append(i)
            width = max(width, n)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(examples: Sequence[Example], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and labels (-100 on prompt and padding)."""
    width = max(len(ex.input_ids) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        ids[row, :n] = torch.tensor(ex.input_ids)
        mask[row, :n] = 1
        labels[row, ex.prompt_len:n] = (ids[row, ex.prompt_len:n] if ex.targets is None
                                        else torch.tensor(ex.targets, dtype=torch.long))
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


# ------------------------------------------------------------------------------------------- loss

def distill_loss(logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None,
                 kd_weight: float, temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """CE on the target's next tokens; optionally mixed with KL(teacher || student) at a temperature."""
    shift_logits = logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    keep = shift_labels != -100
    student = shift_logits[keep]  # [N, V]
    ce = F.cross_entropy(student.float(), shift_labels[keep])
    parts = {"ce": float(ce.detach())}
    if teacher_logits is None:
        return ce, parts
    teacher = teacher_logits[:, :-1, :][keep].float()
    t = temperature
    kl = F.kl_div(F.log_softmax(student.float() / t, -1), F.log_softmax(teacher / t, -1),
                  log_target=True, reduction="batchmean") * (t * t)
    parts["kl"] = float(kl.detach())
    return (1 - kd_weight) * ce + kd_weight * kl, parts


class _STEFakeQuant(torch.autograd.Function):
    """Forward: the packed (4-bit) weight; backward: the gradient passes straight to the float weight."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return qd4.fake_quantize(weight, group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def enable_qat(model, group_size: int) -> int:
    """Make the model compute with the weights `specdraft pack --group-size G` (default encodings) stores:
    every nn.Linear and the input embedding use ``qd4.fake_quantize`` of their weight. Trainable weights are
    re-quantised at every forward with a straight-through gradient; frozen ones (the tied embedding/head,
    ``freeze_layers``) once, into a non-persistent buffer, at the G the pack will store them at
    (``qd4.lossless_group_size``: a frozen layer on a finer grid stays exact). The parameters stay float (the
    optimizer's latent weights), so checkpoints, resume state and the packer see plain weights, and packing them
    reproduces exactly the model that was trained and evaluated. Returns the number of modules patched."""
    import types

    frozen: dict[int, torch.Tensor] = {}  # one quantised copy per frozen parameter (tied weights share it)

    def weight_of(module):
        if module.weight.requires_grad:
            return _STEFakeQuant.apply(module.weight, group_size)
        return module._qat_weight

    def linear_forward(self, x):
        return F.linear(x, weight_of(self), self.bias)

    def embedding_forward(self, ids):
        return F.embedding(ids, weight_of(self), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)

    embedding = model.get_input_embeddings()
    patched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            forward = linear_forward
        elif module is embedding:
            forward = embedding_forward
        else:
            continue
        if not module.weight.requires_grad:
            key = id(module.weight)
            if key not in frozen:
                with torch.no_grad():
                    w = module.weight.detach()  # the pack keeps a weight on its own finer grid as it is
                    frozen[key] = qd4.fake_quantize(w, qd4.lossless_group_size(w, group_size))
            module.register_buffer("_qat_weight", frozen[key], persistent=False)
        module.forward = types.MethodType(forward, module)
        patched += 1
    return patched


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


# ------------------------------------------------------------------------------------------- eval

@torch.no_grad()
def simulated_acceptance(model, examples: Sequence[Example], k: int = 16, pad_id: int = 0,
                         batch_size: int = 8) -> AcceptanceStats:
    """Mean accepted length of k-token greedy drafts at offsets 0, k, 2k, ... of each completion."""
    stats = AcceptanceStats(k=k)
    device = next(model.parameters()).device
    model_was_training = model.training
    model.eval()
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        batch = collate(chunk, pad_id, device)
        preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
        for row, ex in enumerate(chunk):
            completion = ex.completion
            # prediction for completion[j] comes from position prompt_len + j - 1
            row_preds = preds[row, ex.prompt_len - 1: len(ex.input_ids) - 1].tolist()
            for offset in range(0, len(completion) - k + 1, k):
                stats.add(row_preds[offset:offset + k], completion[offset:offset + k], prompt_id=ex.id)
    model.train(model_was_training)
    return stats


@torch.no_grad()
def heldout_loss(model, examples: Sequence[Example], pad_id: int, batch_size: int = 8) -> float:
    device = next(model.parameters()).device
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad_id, device)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        keep = labels != -100
        total += float(F.cross_entropy(logits[:, :-1][keep].float(), labels[keep], reduction="sum"))
        count += int(keep.sum())
    model.train(was_training)
    return total / max(1, count)


# ------------------------------------------------------------------------------------------- loop

def run_train(cfg: TrainConfig) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    mixed = cfg.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mixed, gradient_accumulation_steps=cfg.grad_accum)
    set_seed(cfg.seed)

    with stage_log(out / "train.log"), torch.enable_grad():
        traces_path = Path(cfg.traces)
        summary_path = traces_path.with_name("traces.summary.json")
        summary = read_json(summary_path) if summary_path.is_file() else {}
        target_spec = cfg.target or _target_spec_from_summary(summary) or DEFAULT_TARGET
        model, tokenizer, init_source = build_init(cfg.init)
        _check_tokenizer(tokenizer, target_spec, model)
        examples = read_traces(traces_path, cfg.max_seq_len)
        _check_vocab(examples, traces_path, model.config.vocab_size)
        train_set, heldout = split_heldout(examples, cfg.heldout_fraction)
        if cfg.heldout_traces:
            heldout = read_traces(cfg.heldout_traces, cfg.max_seq_len)
            _check_vocab(heldout, cfg.heldout_traces, model.config.vocab_size)
        if any(ex.targets is not None for ex in heldout):
            raise ValueError("held-out examples must be greedy traces (simulated acceptance compares drafts with "
                             "the completion): pass teacher-forced labels as --labels, not as traces")
        labelled = read_traces(cfg.labels, cfg.max_seq_len) if cfg.labels else []
        if labelled:
            _check_vocab(labelled, cfg.labels, model.config.vocab_size)
            labels_target = _target_spec_from_summary(_labels_summary(cfg.labels))
            if labels_target and labels_target != target_spec:
                raise ValueError(f"{cfg.labels} was labelled by {labels_target}, not by the target {target_spec}")
            train_set = train_set + labelled  # never held out: held-out points are greedy traces
        heldout = heldout[: cfg.heldout_max]
        if not train_set:
            raise ValueError(f"{traces_path}: no traces left for training after the held-out split")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        if not cfg.train_embeddings:
            model.get_input_embeddings().weight.requires_grad_(False)
            model.get_output_embeddings().weight.requires_grad_(False)
        if cfg.freeze_layers:
            if cfg.freeze_layers >= model.config.num_hidden_layers:
                raise ValueError(f"freeze_layers={cfg.freeze_layers} leaves nothing to train in a "
                                 f"{model.config.num_hidden_layers}-layer draft")
            for layer in model.model.layers[: cfg.freeze_layers]:
                layer.requires_grad_(False)
        if cfg.qat_group_size:
            patched = enable_qat(model, cfg.qat_group_size)
            log.info("QAT: %d linear/embedding modules compute on their 4-bit G=%d weights", patched,
                     cfg.qat_group_size)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        model, optimizer = accelerator.prepare(model, optimizer)
        teacher = None
        if cfg.kd:
            from .models import load_model
            teacher = load_model(target_spec).to(accelerator.device)
            teacher.requires_grad_(False)

        world, rank = accelerator.num_processes, accelerator.process_index
        steps_per_epoch = len(make_batches(train_set, cfg.batch_tokens, cfg.seed, 0)) // (cfg.grad_accum * world)
        total_steps = max(1, int(steps_per_epoch * cfg.epochs))
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)

        state = _load_resume_state(out, accelerator, cfg)
        step, history, best = state["step"], state["history"], state["best"]
        log.info("train: %d examples (%d teacher-forced), %d held out, %d steps, init %s, target %s, kd=%s, "
                 "resume from step %d", len(train_set), len(labelled), len(heldout), total_steps, cfg.init,
                 target_spec, cfg.kd, step)
        if step == 0 and not history:
            history.append(_evaluate(accelerator, model, heldout, pad_id, cfg, step=0, train_loss=None))
            best = _maybe_save_best(accelerator, model, tokenizer, out, history[-1], best)

        model.train()
        started, tokens_seen = time.time(), 0
        bar = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
        micro = _micro_batches(train_set, cfg, world, rank)
        skip = step * cfg.grad_accum
        running = []
        for epoch, batch_idx in micro:
            if step >= total_steps:
                break
            if skip > 0:
                skip -= 1
                continue
            batch = collate([train_set[i] for i in batch_idx], pad_id, accelerator.device)
            with accelerator.accumulate(model):
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                teacher_logits = None
                if teacher is not None:
                    with torch.no_grad():
                        teacher_logits = teacher(input_ids=batch["input_ids"],
                                                 attention_mask=batch["attention_mask"]).logits
                loss, parts = distill_loss(logits, batch["labels"], teacher_logits, cfg.kd_weight,
                                           cfg.kd_temperature)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, cfg.clip_norm)
                    for group in optimizer.param_groups:
                        group["lr"] = lr_at(step, total_steps, cfg)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            running.append(float(loss.detach()))
            tokens_seen += int((batch["labels"] != -100).sum())
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{sum(running) / len(running):.3f}",
                            tok_s=f"{tokens_seen / max(1e-9, time.time() - started):.0f}")
            if step % cfg.eval_every == 0 or step == total_steps:
                train_loss = sum(running) / len(running)
                running = []
                history.append(_evaluate(accelerator, model, heldout, pad_id, cfg, step, train_loss))
                best = _maybe_save_best(accelerator, model, tokenizer, out, history[-1], best)
                _save_resume_state(out, accelerator, model, tokenizer, cfg, step, history, best)
                _plot_history(history, out / "train_curves.png")
        bar.close()
        elapsed = time.time() - started
        meta = {
            "stage": "train",
            "init": init_source,
            "target": describe_source(target_spec),
            "traces": {"path": str(traces_path.resolve()), "sha256": sha256_file(traces_path),
                       "count": len(examples), "train": len(train_set) - len(labelled), "heldout": len(heldout),
                       "heldout_traces": (str(Path(cfg.heldout_traces).resolve()) if cfg.heldout_traces
                                          else None),
                       "summary_sha256": sha256_file(summary_path) if summary_path.is_file() else None},
            "labels": ({"path": str(Path(cfg.labels).resolve()), "sha256": sha256_file(cfg.labels),
                        "count": len(labelled), "tokens": sum(len(ex.targets or ()) for ex in labelled),
                        "summary_sha256": (sha256_file(_labels_summary_path(cfg.labels))
                                           if _labels_summary_path(cfg.labels).is_file() else None)}
                       if cfg.labels else None),
            "config": cfg.to_json_dict(),
            "steps": step,
            "total_steps": total_steps,
            "train_tokens_this_run": tokens_seen,
            "seconds_this_run": round(elapsed, 1),
            "parameters": sum(p.numel() for p in accelerator.unwrap_model(model).parameters()),
            "best": best,
            "final": history[-1] if history else None,
            "history": history,
            **run_metadata(),
        }
        if accelerator.is_main_process:
            meta["checkpoint_weights_sha256"] = _weights_sha(out)
            atomic_write_json(out / "train_meta.json", meta)
            _plot_history(history, out / "train_curves.png")
        log.info("train done: best simulated acceptance %.3f at step %s", best["sim_accept"] if best else -1,
                 best["step"] if best else None)
        return meta


def _micro_batches(train_set, cfg: TrainConfig, world: int, rank: int):
    epoch = 0
    while True:
        batches = make_batches(train_set, cfg.batch_tokens, cfg.seed, epoch)
        usable = len(batches) - len(batches) % (cfg.grad_accum * world)
        for i in range(rank, usable, world):
            yield epoch, batches[i]
        epoch += 1


def _evaluate(accelerator, model, heldout, pad_id, cfg: TrainConfig, step: int, train_loss) -> dict:
    unwrapped = accelerator.unwrap_model(model)
    stats = simulated_acceptance(unwrapped, heldout, cfg.num_draft, pad_id)
    record = {"step": step, "train_loss": train_loss, "heldout_loss": heldout_loss(unwrapped, heldout, pad_id),
              "sim_accept": stats.mean_accepted_pooled, "sim_accept_per_prompt": stats.mean_accepted_per_prompt,
              "sim_points": stats.points}
    log.info("eval step %d: heldout_loss %.4f sim_accept %.3f (points %d)", step, record["heldout_loss"],
             record["sim_accept"], stats.points)
    return record


def _maybe_save_best(accelerator, model, tokenizer, out: Path, record: dict, best: dict | None):
    if best is not None and record["sim_accept"] <= best["sim_accept"]:
        return best
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    return dict(record)


def _save_resume_state(out: Path, accelerator, model, tokenizer, cfg, step, history, best) -> None:
    """last/ holds everything needed to continue exactly: weights, optimizer, RNG, step, history."""
    tmp = out / "last.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        atomic_write_json(tmp / "trainer_state.json", {"step": step, "history": history, "best": best,
                                                       "config": cfg.to_json_dict()})
        shutil.rmtree(out / "last", ignore_errors=True)
        os.replace(tmp, out / "last")


def _load_resume_state(out: Path, accelerator, cfg: TrainConfig) -> dict:
    state_file = out / "last" / "trainer_state.json"
    if not state_file.is_file():
        return {"step": 0, "history": [], "best": None}
    saved = read_json(state_file)
    if not all(k in saved for k in ("config", "step", "history", "best")):
        raise ValueError(f"{state_file}: not a trainer state (needs config, step, history, best); use a new "
                         "--out or delete it")
    if saved["config"] != cfg.to_json_dict():
        raise ValueError(f"{out}/last was made with a different config; use a new --out or delete it")
    corrupt = weight_file_problems(out / "last")
    if corrupt:
        raise ValueError(f"cannot resume: corrupt weight file: {'; '.join(corrupt)}; use a new --out or delete "
                         f"{out / 'last'}")
    accelerator.load_state(str(out / "last"))
    log.info("resuming from %s at step %d", out / "last", saved["step"])
    return saved


def _labels_summary_path(labels: str | Path) -> Path:
    path = Path(labels)
    return path.with_name(path.stem + ".summary.json")


def _labels_summary(labels: str | Path) -> dict:
    path = _labels_summary_path(labels)
    return read_json(path) if path.is_file() else {}


def _target_spec_from_summary(summary: dict) -> str | None:
    target = summary.get("target")
    if isinstance(target, dict):
        return target.get("spec")
    return target if isinstance(target, str) else None


def _check_tokenizer(draft_tokenizer, target_spec: str, model) -> None:
    from .models import load_tokenizer
    target_tokenizer = load_tokenizer(target_spec)
    draft_fp, target_fp = tokenizer_fingerprint(draft_tokenizer), tokenizer_fingerprint(target_tokenizer)
    if draft_fp != target_fp:
        raise ValueError(f"the draft's tokenizer differs from the target's ({target_spec}) that wrote the "
                         f"traces: draft vocab sha256 {draft_fp} != target vocab sha256 {target_fp}")


def _weights_sha(out: Path) -> str | None:
    from .models import weights_sha256
    return weights_sha256(out)


def _plot_history(history: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([h["step"] for h in history if h["train_loss"] is not None],
             [h["train_loss"] for h in history if h["train_loss"] is not None], label="train")
    ax1.plot(steps, [h["heldout_loss"] for h in history], label="held-out")
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.set_title("loss")
    ax2.plot(steps, [h["sim_accept"] for h in history], marker="o")
    ax2.set_xlabel("step"), ax2.set_ylabel("mean accepted (of 16)"), ax2.set_title("simulated acceptance")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
