"""Distil a draft model from the target's greedy traces.

The draft starts from a smaller pretrained model that shares the target's tokenizer, or from the
target's own first layers (``truncate:TARGET_SPEC:N``). It is trained with cross-entropy on the target's
greedy completion tokens (prompt positions masked) and, with ``kd``, a KL term to the target's logits
computed online (DistillSpec). ``labels`` adds teacher-forced rows (`specdraft label`): reference answers as
context, the target's argmax at each position as the label; cheaper per token than traces. ``qat_group_size``
trains through the packer's 4-bit rounding.

``run_train`` reads top to bottom: ``setup`` -> ``load_data`` -> ``choose_precision`` (float32 or bf16 autocast;
``auto`` measures on a CPU, ``quant.train_precision``) -> ``train_loop``, which feeds ``micro_batches``
(from ``make_batches``) to ``train_step`` and every ``eval_every`` steps calls ``evaluate`` (held-out loss +
simulated acceptance), ``save_checkpoint`` (the best draft, in ``out/``) and ``save_resume_state`` (``out/last``,
from which a killed run continues to the same weights as an uninterrupted one). This module is that
orchestration; what it computes lives a layer down: the micro-batches and the loss of one
(``model.distill``: ``batch_loss``, ``distill_loss``, ``stored_kd_loss``, ``heldout_loss``) and simulated
acceptance (``drafting.simulated``).

Several processes (``torchrun`` / ``accelerate launch``, docs/scale.md) train one model with data parallelism
(DDP, or FSDP from the accelerate config): rank r takes micro-batches r, r + n, r + 2n, ... of the same epoch
order, so an optimizer step over n ranks with ``grad_accum`` g sees the micro-batches one process with
``grad_accum`` g * n sees. Losses and token counts are summed over the ranks; every rank evaluates (FSDP needs all
of them for a forward); only rank 0 writes the checkpoint, the records, the plot and the log, and each rank writes
its own RNG state into ``last/``.

Simulated acceptance is exact for greedy drafting: because held-out completions are the target's own
greedy tokens, a k-token greedy draft (``num_draft``) starting at offset o accepts exactly the leading run of
positions where the draft's teacher-forced argmax equals the target token, so one forward pass per
sequence scores every offset. The score goes through ``AcceptanceStats``, as in ``specdraft eval``.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from pydantic import Field, model_validator
from tqdm.auto import tqdm

from specdraft.core.config import StageConfig
from specdraft.core.io import atomic_write_json, read_json, sha256_file
from specdraft.core.provenance import run_metadata, stage_log
from specdraft.core.records import Example, read_traces
from specdraft.core.stage import recorded_target, summary_path
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.drafting.simulated import simulated_acceptance
from specdraft.model.batching import collate
from specdraft.model.distill import batch_loss, heldout_loss, make_batches, micro_batches
from specdraft.model.specs import (
    DEFAULT_TARGET,
    describe_source,
    load_model,
    load_tokenizer,
    tokenizer_fingerprint,
    weight_file_problems,
    weights_sha256,
)
from specdraft.model.truncate import build_init
from specdraft.quant.qat import enable_qat
from specdraft.quant.train_precision import (
    NAMES,
    PRECISION_HELP,
    PrecisionSetting,
    recorded_precision,
    resolve_train_precision,
)
from specdraft.reports.train import plot_history

log = logging.getLogger(__name__)


class TrainConfig(StageConfig):
    @model_validator(mode="after")
    def _one_kd(self) -> "TrainConfig":
        if self.kd and self.kd_stored:
            raise ValueError("kd and kd_stored: choose one teacher (the target's logits, or the traces' top-K)")
        return self

    traces: str = Field(description="traces.jsonl written by `specdraft traces`")
    labels: Optional[str] = Field(None, description="labels.jsonl from `specdraft label` (the target's argmax on "
                                                    "reference answers), trained on together with the traces")
    init: str = Field(description="draft init: a model spec, or truncate:TARGET_SPEC:N "
                                  "(N layers, or a comma list of layer indices to keep)")
    out: str = Field(description="output checkpoint directory (the best checkpoint; last/ for resume)")
    target: Optional[str] = Field(None, description="target model spec (default: the one recorded in the "
                                                     "traces' summary, X.summary.json beside X.jsonl, else the "
                                                     "embedded default)")
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
    kd_stored: bool = Field(False, description="add KL to the target's top-K distribution stored in the traces "
                                               "(`traces --top-logprobs K`): distillation without a teacher "
                                               "forward; positions without one (labels) get CE alone")
    kd_weight: float = Field(0.5, ge=0, le=1, description="loss = (1-w)*CE + w*KL when kd or kd_stored is on")
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
    num_draft: int = Field(DRAFT_TOKENS, ge=1, description="draft length for simulated acceptance")
    seed: int = Field(0, description="seed for data order and init")
    mixed_precision: PrecisionSetting = Field("auto", description=PRECISION_HELP + "; a resumed run keeps the "
                                                                  "precision its first sitting used")
    threads: Optional[int] = Field(None, description="torch CPU threads (default: torch's choice)")


@dataclass
class TrainData:
    """The rows one run trains on and scores."""

    traces: list[Example]  # every usable row of the traces file
    train: list[Example]  # the traces not held out, then the teacher-forced rows
    heldout: list[Example]  # greedy traces that evaluate scores (at most heldout_max)
    labelled: list[Example]  # the teacher-forced rows (--labels); never held out


@dataclass
class Run:
    """What the steps of one run share."""

    cfg: TrainConfig
    out: Path
    accelerator: Accelerator
    model: Any  # the draft, as accelerate prepared it (DDP / FSDP-wrapped on several processes)
    optimizer: Any
    tokenizer: Any
    pad_id: int
    teacher: Any  # the target, loaded for kd only (else None)
    total_steps: int
    # the precision the run trains in and why (``quant.train_precision``), as its first sitting chose it
    precision: dict = field(default_factory=dict)


@dataclass
class TrainState:
    """Where a run stands; last/trainer_state.json keeps it (with the config) beside accelerate's state."""

    step: int = 0  # optimizer steps taken
    history: list[dict] = field(default_factory=list)  # one evaluate() record per evaluation
    best: dict | None = None  # the record of the checkpoint in out/
    # label tokens (of every rank) and seconds of the steps taken, over every sitting (steps redone after an
    # interruption counted once)
    train_tokens: int = 0
    train_seconds: float = 0.0


# ------------------------------------------------------------------------------------------- setup

def setup(cfg: TrainConfig) -> PartialState:
    """Threads, the processes the launcher started, and the seed. The precision is chosen once the draft is built
    (``choose_precision``), and the ``Accelerator`` made with it then (``make_accelerator``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    launched = launched_processes()
    processes = PartialState(cpu=_on_cpu(launched))
    if processes.num_processes != launched:
        raise ValueError(f"the launcher started {launched} processes (WORLD_SIZE) but accelerate joined "
                         f"{processes.num_processes}: launch with torchrun or `accelerate launch` "
                         "(docs/scale.md)")
    set_seed(cfg.seed)
    return processes


def _on_cpu(launched: int) -> bool:
    # Without a GPU, accelerate joins the processes a launcher started only when told to run on the CPU; left
    # alone, each rank would train on its own and every one of them would write the same files.
    return launched > 1 and not torch.cuda.is_available()


def make_accelerator(cfg: TrainConfig, precision: str) -> Accelerator:
    """The run's ``Accelerator``: ``precision`` (accelerate's ``mixed_precision``), gradient accumulation."""
    state = AcceleratorState._shared_state
    if state.get("_mixed_precision", precision) != precision:
        # accelerate keeps one precision per process and refuses another; an earlier run in this process (the
        # demo's phases, the tests) may have chosen differently: its state is dropped, the processes' kept
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.grad_accum,
                              cpu=_on_cpu(launched_processes()))
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and \
            accelerator.distributed_type != DistributedType.FSDP:
        log.warning("the launcher asked for FSDP, but accelerate runs %s: it shards only on GPUs and other "
                    "accelerators, so every rank holds the whole draft", accelerator.distributed_type.value)
    return accelerator


def choose_precision(cfg: TrainConfig, processes: PartialState, out: Path, model, train: list[Example]) -> dict:
    """The precision to train in and why (``quant.train_precision.resolve_train_precision``: as given, bf16 on a
    GPU, or measured on the CPU on the draft's own layers at a micro-batch's rows); ``auto`` in a run resumed from
    a state that recorded the choice: that choice, so the run keeps one precision throughout. Rank 0 decides,
    every rank uses its pick."""
    choice: list[dict | None] = [None]
    if processes.is_main_process:
        saved = saved_precision(out) if cfg.mixed_precision == "auto" else None
        if saved is not None:
            choice[0] = {**saved, "kept_from_first_sitting": True}
        else:
            labelled = sum(len(ex.completion) for ex in train) / max(1, sum(len(ex.input_ids) for ex in train))
            choice[0] = {**resolve_train_precision(model, cfg.mixed_precision, processes.device, cfg.batch_tokens,
                                                   max(1, round(cfg.batch_tokens * labelled))),
                         "kept_from_first_sitting": False}
    if processes.num_processes > 1:
        broadcast_object_list(choice)
    assert choice[0] is not None
    log.info("mixed precision: %s%s, %s", NAMES.get(choice[0]["precision"], choice[0]["precision"]),
             " (kept from the run's first sitting)" if choice[0]["kept_from_first_sitting"] else "",
             choice[0]["reason"])
    return choice[0]


def saved_precision(out: Path) -> dict | None:
    """The precision choice recorded in the resume state under ``out`` (``last/``, else a complete ``last.tmp/``
    that ``load_resume_state`` will take), None without one."""
    return recorded_precision([out / folder / "trainer_state.json" for folder in ("last", "last.tmp")])


def launched_processes() -> int:
    """How many processes the launcher (torchrun, accelerate launch) started: its WORLD_SIZE, else 1."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        raise ValueError(f"WORLD_SIZE={world!r}: expected a positive process count")
    return int(world)


def check_tokenizer(draft_tokenizer, target_spec: str) -> None:
    target_tokenizer = load_tokenizer(target_spec)
    draft_fp, target_fp = tokenizer_fingerprint(draft_tokenizer), tokenizer_fingerprint(target_tokenizer)
    if draft_fp != target_fp:
        raise ValueError(f"the draft's tokenizer differs from the target's ({target_spec}) that wrote the "
                         f"traces: draft vocab sha256 {draft_fp} != target vocab sha256 {target_fp}")


def load_data(cfg: TrainConfig, target_spec: str, vocab_size: int) -> TrainData:
    """The traces split by id hash (or scored against --heldout-traces), plus the teacher-forced labels."""
    traces = _read_examples(cfg.traces, cfg.max_seq_len, vocab_size)
    train, heldout = split_heldout(traces, cfg.heldout_fraction)
    if cfg.heldout_traces:
        heldout = _read_examples(cfg.heldout_traces, cfg.max_seq_len, vocab_size)
    if any(ex.targets is not None for ex in heldout):
        raise ValueError("held-out examples must be greedy traces (simulated acceptance compares drafts with "
                         "the completion): pass teacher-forced labels as --labels, not as traces")
    labelled: list[Example] = []
    if cfg.labels:
        labelled = _read_examples(cfg.labels, cfg.max_seq_len, vocab_size)
        labels_target = recorded_target(cfg.labels)
        if labels_target and labels_target != target_spec:
            raise ValueError(f"{cfg.labels} was labelled by {labels_target}, not by the target {target_spec}")
    train = train + labelled  # never held out: held-out points are greedy traces
    if cfg.kd_stored and not any(ex.top_ids for ex in train):
        raise ValueError(f"{cfg.traces}: kd_stored needs the target's stored top-K distribution, and no trace "
                         "has one; write the traces with `specdraft traces --top-logprobs K`")
    if not train:
        raise ValueError(f"{cfg.traces}: no traces left for training after the held-out split")
    return TrainData(traces=traces, train=train, heldout=heldout[: cfg.heldout_max], labelled=labelled)


def _read_examples(path: str, max_seq_len: int, vocab_size: int) -> list[Example]:
    examples = read_traces(path, max_seq_len)
    max_id = max(max(max(ex.input_ids), max(ex.targets or [0]), max(map(max, ex.top_ids or [[0]])))
                 for ex in examples)
    if max_id >= vocab_size:
        raise ValueError(f"{path} uses token id {max_id} but the draft's vocab has {vocab_size}")
    return examples


def split_heldout(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Deterministic split by id hash, so the split does not move when traces are appended."""
    def bucket(ex: Example) -> float:
        return int(hashlib.sha256(ex.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    heldout = [ex for ex in examples if bucket(ex) < fraction]
    train = [ex for ex in examples if bucket(ex) >= fraction]
    return train, heldout


def trainable_parameters(model, cfg: TrainConfig) -> list[torch.nn.Parameter]:
    """Freeze the (tied) embedding unless train_embeddings and the first freeze_layers decoder layers, switch
    QAT on; the parameters left to train."""
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
    return [p for p in model.parameters() if p.requires_grad]


def load_teacher(target_spec: str, device):
    teacher = load_model(target_spec).to(device)
    teacher.requires_grad_(False)
    return teacher


def count_steps(cfg: TrainConfig, train: list[Example], world: int) -> int:
    """Optimizer steps for cfg.epochs passes (at epoch 0's batch count), at most max_steps."""
    steps_per_epoch = len(make_batches(train, cfg.batch_tokens, cfg.seed, 0)) // (cfg.grad_accum * world)
    total_steps = max(1, int(steps_per_epoch * cfg.epochs))
    return min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps


# ------------------------------------------------------------------------------------------- step

def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up to lr, then a cosine down to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def train_step(run: Run, batch: dict[str, torch.Tensor], step: int) -> float:
    """Forward and backward one micro-batch; on the last micro-batch of optimizer step ``step``, clip, set the
    step's learning rate and update. The micro-batch's loss."""
    cfg, accelerator = run.cfg, run.accelerator
    with accelerator.accumulate(run.model):
        loss, _ = batch_loss(run.model, batch, teacher=run.teacher, kd_stored=cfg.kd_stored,
                             kd_weight=cfg.kd_weight, temperature=cfg.kd_temperature)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            # all the model's parameters: frozen ones have no gradient, and FSDP clips only through its own list
            accelerator.clip_grad_norm_(run.model.parameters(), cfg.clip_norm)
            for group in run.optimizer.param_groups:
                group["lr"] = lr_at(step, run.total_steps, cfg)
        run.optimizer.step()  # accelerate skips it (and zero_grad) until the last micro-batch of the step
        run.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


# ------------------------------------------------------------------------------------------- eval

def evaluate(run: Run, heldout: Sequence[Example], step: int, train_loss: float | None) -> dict:
    """The history record of one evaluation: held-out loss and simulated acceptance. Every rank scores the same
    held-out traces with the same weights (FSDP needs each rank's shard for a forward)."""
    unwrapped = run.accelerator.unwrap_model(run.model)
    stats = simulated_acceptance(unwrapped, heldout, run.cfg.num_draft, run.pad_id)
    record = {"step": step, "train_loss": train_loss,
              "heldout_loss": heldout_loss(unwrapped, heldout, run.pad_id),
              "sim_accept": stats.mean_accepted_pooled, "sim_accept_per_prompt": stats.mean_accepted_per_prompt,
              "sim_points": stats.points}
    log.info("eval step %d: heldout_loss %.4f sim_accept %.3f (points %d)", step, record["heldout_loss"],
             record["sim_accept"], stats.points)
    return record


# ------------------------------------------------------------------------------------------- save

def save_checkpoint(run: Run, record: dict, best: dict | None) -> dict | None:
    """Write the draft and its tokenizer to out/ when ``record`` beats ``best`` on simulated acceptance; the
    best record so far."""
    if best is not None and record["sim_accept"] <= best["sim_accept"]:
        return best
    weights = run.accelerator.get_state_dict(run.model)  # on every rank: FSDP gathers the shards
    if run.accelerator.is_main_process:
        run.accelerator.unwrap_model(run.model).save_pretrained(run.out, state_dict=weights, safe_serialization=True)
        run.tokenizer.save_pretrained(run.out)
    return dict(record)


def save_resume_state(run: Run, state: TrainState) -> None:
    """last/ holds everything needed to continue exactly: weights, optimizer, RNG, step, history."""
    accelerator, tmp = run.accelerator, run.out / "last.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))  # rank 0 the weights and optimizer, each rank its RNG state
    accelerator.wait_for_everyone()  # every rank's file is in before the directory moves
    if accelerator.is_main_process:
        atomic_write_json(tmp / "trainer_state.json", {
            "step": state.step, "history": state.history, "best": state.best, "train_tokens": state.train_tokens,
            "train_seconds": state.train_seconds, "processes": accelerator.num_processes,
            "precision_choice": {k: v for k, v in run.precision.items() if k != "kept_from_first_sitting"},
            "config": run.cfg.to_json_dict()})
        # renames only between a complete last/ and the next: a kill in between leaves last.tmp complete (its
        # trainer_state.json is written last), which load_resume_state takes. Not core.io.atomic_dir: it removes
        # the old directory before its rename, and its temp folder has a random name, so a kill in that window
        # would leave no last/ and no state load_resume_state can find (a restart from step 0); every rank also
        # writes into the folder (save_state), so its name must be known to all of them.
        old = run.out / "last.old"
        shutil.rmtree(old, ignore_errors=True)
        if (run.out / "last").exists():
            os.replace(run.out / "last", old)
        os.replace(tmp, run.out / "last")
        shutil.rmtree(old, ignore_errors=True)


def load_resume_state(run: Run) -> TrainState:
    """The state saved in last/ (weights, optimizer and RNG restored into the run), or a fresh one."""
    last, tmp = run.out / "last", run.out / "last.tmp"
    if not (last / "trainer_state.json").is_file() and (tmp / "trainer_state.json").is_file():
        # killed between save_resume_state's renames: the new state is complete; it becomes last/
        if run.accelerator.is_main_process:
            shutil.rmtree(last, ignore_errors=True)
            os.replace(tmp, last)
            log.info("%s was complete but not yet moved: resuming from it", tmp)
        run.accelerator.wait_for_everyone()
    state_file = last / "trainer_state.json"
    if not state_file.is_file():
        return TrainState()
    saved = read_json(state_file)
    if not all(k in saved for k in ("config", "step", "history", "best")):
        raise ValueError(f"{state_file}: not a trainer state (needs config, step, history, best); use a new "
                         "--out or delete it")
    if saved["config"] != run.cfg.to_json_dict():
        raise ValueError(f"{last} was made with a different config; use a new --out or delete it")
    # the global batch is grad_accum x processes: on another count the steps left would be other steps
    processes = saved.get("processes", 1)  # states written before it was kept came from one process
    if processes != run.accelerator.num_processes:
        raise ValueError(f"{state_file}: made by {processes} process(es), resumed on "
                         f"{run.accelerator.num_processes}; relaunch on {processes} or use a new --out")
    corrupt = weight_file_problems(last)
    if corrupt:
        raise ValueError(f"cannot resume: corrupt weight file: {'; '.join(corrupt)}; use a new --out or delete "
                         f"{last}")
    run.accelerator.load_state(str(last))
    log.info("resuming from %s at step %d", last, saved["step"])
    # states written before the totals were kept have none: their earlier sittings count as 0
    return TrainState(step=saved["step"], history=saved["history"], best=saved["best"],
                      train_tokens=saved.get("train_tokens", 0), train_seconds=saved.get("train_seconds", 0.0))


def train_meta(run: Run, data: TrainData, state: TrainState, *, init_source: dict, target_spec: str,
               resumed_from_step: int, tokens_seen: int, seconds: float) -> dict:
    """train_meta.json: the inputs (init, target, traces, labels, config with their hashes), the results, and
    the run's provenance."""
    cfg = run.cfg
    return {
        "stage": "train",
        "init": init_source,
        "target": describe_source(target_spec),
        "traces": {"path": str(Path(cfg.traces).resolve()), "sha256": sha256_file(cfg.traces),
                   "count": len(data.traces), "train": len(data.train) - len(data.labelled),
                   "heldout": len(data.heldout),
                   "heldout_traces": str(Path(cfg.heldout_traces).resolve()) if cfg.heldout_traces else None,
                   "summary_sha256": _sha256_if_file(summary_path(cfg.traces))},
        "labels": ({"path": str(Path(cfg.labels).resolve()), "sha256": sha256_file(cfg.labels),
                    "count": len(data.labelled), "tokens": sum(len(ex.targets or ()) for ex in data.labelled),
                    "summary_sha256": _sha256_if_file(summary_path(cfg.labels))}
                   if cfg.labels else None),
        "config": cfg.to_json_dict(),
        "steps": state.step,
        "total_steps": run.total_steps,
        "processes": run.accelerator.num_processes,
        "distributed": run.accelerator.distributed_type.value,
        "precision_choice": run.precision,
        "micro_batches_per_step": cfg.grad_accum * run.accelerator.num_processes,
        "resumed_from_step": resumed_from_step,
        "train_tokens": state.train_tokens,
        "train_seconds": round(state.train_seconds, 1),
        "train_tokens_this_run": tokens_seen,
        "seconds_this_run": round(seconds, 1),
        "parameters": sum(p.numel() for p in run.accelerator.unwrap_model(run.model).parameters()),
        "best": state.best,
        "final": state.history[-1] if state.history else None,
        "history": state.history,
        **run_metadata(),
    }


def _sha256_if_file(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


# ------------------------------------------------------------------------------------------- loop

def summed_over_ranks(accelerator: Accelerator, *values: float) -> list[float]:
    """Each value summed over the processes (itself on one), in float64 so that token counts stay exact."""
    if accelerator.num_processes == 1:
        return list(values)
    total = accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=accelerator.device), "sum")
    return total.tolist()


def train_loop(run: Run, data: TrainData, state: TrainState) -> int:
    """Optimizer steps from ``state.step`` to the last, evaluating and saving every eval_every steps and at the
    end; the number of label tokens trained on (over every rank)."""
    cfg, accelerator = run.cfg, run.accelerator
    run.model.train()
    started, tokens_seen = time.time(), 0  # tokens_seen: every rank's, summed at each evaluation
    losses, tokens = [], 0  # this rank's micro-batch losses and label tokens since the last evaluation
    tokens_before, seconds_before = state.train_tokens, state.train_seconds
    bar = tqdm(total=run.total_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process)
    batches = micro_batches(data.train, batch_tokens=cfg.batch_tokens, seed=cfg.seed, grad_accum=cfg.grad_accum,
                            world=accelerator.num_processes, rank=accelerator.process_index)
    # a resumed run skips the micro-batches of the steps already taken, so it sees the batches it would have seen
    for batch_idx in itertools.islice(batches, state.step * cfg.grad_accum, None):
        if state.step >= run.total_steps:
            break
        batch = collate([data.train[i] for i in batch_idx], run.pad_id, accelerator.device, cfg.kd_stored)
        losses.append(train_step(run, batch, state.step))
        tokens += int((batch["labels"] != -100).sum())
        if not accelerator.sync_gradients:
            continue
        state.step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses) / len(losses):.3f}")  # rank 0's share of the window
        if state.step % cfg.eval_every == 0 or state.step == run.total_steps:
            # the window's mean micro-batch loss over every rank: what one process with the same global batch logs
            loss_sum, loss_count, window_tokens = summed_over_ranks(accelerator, sum(losses), len(losses), tokens)
            tokens_seen += int(window_tokens)
            losses, tokens = [], 0
            state.history.append(evaluate(run, data.heldout, state.step, loss_sum / loss_count))
            state.train_tokens = tokens_before + tokens_seen
            state.train_seconds = seconds_before + time.time() - started
            state.best = save_checkpoint(run, state.history[-1], state.best)
            save_resume_state(run, state)
            if accelerator.is_main_process:
                plot_history(state.history, run.out / "train_curves.png", cfg.num_draft)
    bar.close()
    return tokens_seen


def run_train(cfg: TrainConfig) -> dict:
    out = Path(cfg.out)
    processes = setup(cfg)
    if processes.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
    else:  # rank 0 speaks for the run: the other ranks' lines would repeat its own
        logging.getLogger("specdraft").setLevel(logging.WARNING)
    processes.wait_for_everyone()
    with (stage_log(out / "train.log") if processes.is_main_process else contextlib.nullcontext()), \
            torch.enable_grad():
        target_spec = cfg.target or recorded_target(cfg.traces) or DEFAULT_TARGET
        model, tokenizer, init_source = build_init(cfg.init)
        check_tokenizer(tokenizer, target_spec)
        data = load_data(cfg, target_spec, model.config.vocab_size)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        optimizer = torch.optim.AdamW(trainable_parameters(model, cfg), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                      betas=(0.9, 0.95))
        precision = choose_precision(cfg, processes, out, model, data.train)  # on the layers as they will train
        accelerator = make_accelerator(cfg, precision["precision"])
        model, optimizer = accelerator.prepare(model, optimizer)
        teacher = load_teacher(target_spec, accelerator.device) if cfg.kd else None
        total_steps = count_steps(cfg, data.train, accelerator.num_processes)
        run = Run(cfg=cfg, out=out, accelerator=accelerator, model=model, optimizer=optimizer, tokenizer=tokenizer,
                  pad_id=pad_id, teacher=teacher, total_steps=total_steps, precision=precision)

        state = load_resume_state(run)
        log.info("train: %d examples (%d teacher-forced), %d held out, %d steps, init %s, target %s, kd=%s, "
                 "resume from step %d, %d process(es) (%s)", len(data.train), len(data.labelled), len(data.heldout),
                 total_steps, cfg.init, target_spec, "stored top-K" if cfg.kd_stored else cfg.kd, state.step,
                 accelerator.num_processes, accelerator.distributed_type.value)
        if state.step == 0 and not state.history:  # score the init, the first best: training must beat it
            state.history.append(evaluate(run, data.heldout, step=0, train_loss=None))
            state.best = save_checkpoint(run, state.history[-1], state.best)
        started, resumed_from_step = time.time(), state.step
        tokens_seen = train_loop(run, data, state)

        meta = train_meta(run, data, state, init_source=init_source, target_spec=target_spec,
                          resumed_from_step=resumed_from_step, tokens_seen=tokens_seen,
                          seconds=time.time() - started)
        accelerator.wait_for_everyone()  # the last checkpoint is complete on disk before it is hashed
        if accelerator.is_main_process:
            meta["checkpoint_weights_sha256"] = weights_sha256(out)
            atomic_write_json(out / "train_meta.json", meta)
            plot_history(state.history, out / "train_curves.png", cfg.num_draft)
        log.info("train done: best simulated acceptance %.3f at step %s",
                 state.best["sim_accept"] if state.best else -1, state.best["step"] if state.best else None)
        return meta
