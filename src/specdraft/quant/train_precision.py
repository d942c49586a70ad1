"""``train --mixed-precision auto``: float32 or bf16 autocast for training, by measurement on a CPU.

bf16 autocast (what accelerate's ``mixed_precision="bf16"`` runs on a CPU) pays on CPUs with AVX-512 bf16 or AMX
and costs several times float32 where torch has AVX2 alone, as ``compute_choice`` finds for serving. So on a CPU
``choose_train_precision`` times one forward and backward of the draft's own linear layers (``train_shapes``: each
with the gradients its backward computes) at a micro-batch's rows, in float32 and under bf16 autocast, and keeps
bf16 only when it is at least ``BF16_MARGIN`` times as fast: bf16 changes the numerics of training, and a small gain
does not pay for that. What the CPU reports (``cpu_features``) only orders the two -- the likely faster is timed
first, the other stops once the outcome is known --; the timing decides. On a CUDA GPU bf16 is kept without
measuring (``resolve_train_precision``).

The linear layers are most of a draft's step; attention, the norms and the loss run in either precision and are
left out: the choice compares precisions, it does not predict a step's time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from specdraft.core.io import read_json
from specdraft.quant.compute_choice import PROBE_OUT_FEATURES, REPEATS, cpu_features

log = logging.getLogger(__name__)

Precision = Literal["no", "bf16"]  # accelerate's mixed_precision values: "no" trains in float32
PrecisionSetting = Literal["auto", "no", "bf16"]
PRECISION_HELP = ("auto (bf16 on a CUDA GPU; on a CPU, time one step's linear layers in float32 and under bf16 "
                  "autocast and keep bf16 only when it is clearly faster), no (float32), or bf16 (bf16 autocast)")
# bf16 is kept only when one step's linear layers run at least this many times as fast as in float32
BF16_MARGIN = 1.25
# A micro-batch's rows are timed at most this many at a time and scaled: per row a matmul costs about the same at
# more rows, and bf16 would take seconds to time where it is slow
PROBE_ROWS = 128
# the precisions' names in the records and the log
NAMES = {"no": "float32", "bf16": "bf16"}


@dataclass(frozen=True)
class TrainShape:
    """A linear layer's (out_features, in_features), how many the model has, whether it is the head, and what its
    backward computes: the gradient of its input (anything trained below it), of its weight (trained itself);
    neither, in a frozen layer below every trained one: a forward alone."""

    out_features: int
    in_features: int
    count: int = 1
    head: bool = False
    input_grad: bool = True
    weight_grad: bool = True


@dataclass
class PrecisionChoice:
    """What ``choose_train_precision`` picked and why: the seconds of one step's linear layers in each precision
    (or how far one got before it could no longer change the pick), bf16's speed-up, and what the CPU reports."""

    precision: Precision
    reason: str
    given: bool = False
    requested: str = "auto"
    cpu: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    rows: dict[str, int] = field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    bf16_speedup: float | None = None  # float32's seconds over bf16's; a bound when one was not timed to the end
    margin: float = BF16_MARGIN
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def precision_order(cpu: dict[str, Any]) -> list[Precision]:
    """The two precisions, the likely faster first: bf16 where the CPU has bf16 or AMX units, else float32."""
    return ["bf16", "no"] if cpu.get("avx512_bf16") or cpu.get("amx") else ["no", "bf16"]


def train_shapes(model: nn.Module) -> list[TrainShape]:
    """The distinct linear shapes one training forward of ``model`` runs, with their counts and the gradients
    their backward computes, as its parameters' ``requires_grad`` stand (frozen layers, a frozen head, QAT): read
    from one forward of two tokens, the head at one position. The RNG is left as it was."""
    head = model.get_output_embeddings()
    seen: dict[int, tuple[int, int, bool, bool, bool]] = {}

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        seen.setdefault(id(module), (module.out_features, module.in_features, module is head,
                                     bool(args[0].requires_grad), bool(module.weight.requires_grad)))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    counts: dict[tuple[int, int, bool, bool, bool], int] = {}
    for key in seen.values():
        counts[key] = counts.get(key, 0) + 1
    return [TrainShape(n, k, c, h, i, w) for (n, k, h, i, w), c in sorted(counts.items())]


# ------------------------------------------------------------------------------------------- measuring

TrainMeasure = Callable[[Precision, TrainShape, int], float]  # (precision, shape, rows) -> seconds of fwd + bwd


class StepTimer:
    """Times one forward (under bf16 autocast for ``bf16``) and the backward of a linear layer of each shape, on
    constant weights and inputs (a matmul costs the same whatever they are; the RNG is not touched)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, repeats: int = REPEATS):
        self.clock, self.repeats = clock, repeats

    def __call__(self, precision: Precision, shape: TrainShape, rows: int) -> float:
        n, k = min(shape.out_features, PROBE_OUT_FEATURES), shape.in_features
        module = nn.utils.skip_init(nn.Linear, k, n, bias=False)
        module.weight.data = torch.full((n, k), 0.01)
        module.weight.requires_grad_(shape.weight_grad)
        x = torch.full((rows, k), 0.01, requires_grad=shape.input_grad)
        bf16 = precision == "bf16"
        grad = torch.ones(rows, n, dtype=torch.bfloat16 if bf16 else torch.float32)  # the output's own dtype
        times = []
        with torch.enable_grad():
            for call in range(self.repeats + 1):  # the first call warms up: allocations and kernel selection
                module.weight.grad, x.grad = None, None
                started = self.clock()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    y = module(x)
                if shape.input_grad or shape.weight_grad:
                    y.backward(grad)
                if call:
                    times.append(self.clock() - started)
        return min(times) * shape.out_features / n


def choose_train_precision(shapes: Sequence[TrainShape], rows: int, head_rows: int | None = None, *,
                           measure: TrainMeasure | None = None, cpu: dict[str, Any] | None = None,
                           margin: float = BF16_MARGIN) -> PrecisionChoice:
    """bf16 when one step's linear layers (``shapes`` at ``rows`` rows, the head at ``head_rows``: the labelled
    positions) run at least ``margin`` times as fast under bf16 autocast as in float32, else float32 (``"no"``).

    ``measure`` times one forward and backward of a shape (``StepTimer`` by default; a test passes its own). The
    precision the CPU favours is timed first; the other stops once it can no longer change the pick.
    """
    started = time.perf_counter()
    cpu = cpu if cpu is not None else cpu_features()
    measure = measure or StepTimer()
    head_rows = max(1, rows if head_rows is None else head_rows)
    sizes = {"rows": rows, "head_rows": head_rows, "probe_rows": PROBE_ROWS}
    if not shapes:
        return PrecisionChoice(precision="no", reason="float32: no linear layer to time", cpu=cpu,
                               threads=torch.get_num_threads(), rows=sizes, margin=margin)

    def seconds(precision: Precision, shape: TrainShape) -> float:
        n = head_rows if shape.head else rows
        probe = min(n, PROBE_ROWS)
        return shape.count * measure(precision, shape, probe) * n / probe

    # the heaviest first: the second precision is decided, and stops, the sooner
    shapes = sorted(shapes, key=lambda s: -s.count * s.out_features * s.in_features * (head_rows if s.head else rows))
    first, second = precision_order(cpu)
    totals: dict[Precision, float] = {first: sum(seconds(first, s) for s in shapes)}
    measured: dict[str, dict[str, Any]] = {NAMES[first]: {"seconds_per_step": round(totals[first], 6)}}
    running, stopped = 0.0, ""
    for done, shape in enumerate(shapes, 1):
        running += seconds(second, shape)
        bf16_out = second == "bf16" and running * margin > totals["no"]  # bf16 can no longer be margin x faster
        bf16_in = second == "no" and running >= margin * totals["bf16"]  # float32 can no longer come within it
        if (bf16_out or bf16_in) and done < len(shapes):
            stopped = f"{done} of {len(shapes)} shapes"
            break
    if stopped:
        measured[NAMES[second]] = {"seconds_at_least": round(running, 6),
                                   "stopped": f"after {stopped}: the pick could no longer change"}
    else:
        totals[second] = running
        measured[NAMES[second]] = {"seconds_per_step": round(running, 6)}
    float32, bf16 = totals.get("no", running), totals.get("bf16", running)
    speedup = float32 / max(bf16, 1e-12)
    precision: Precision = "bf16" if speedup >= margin else "no"
    bound = ("at least " if second == "no" else "at most ") if stopped else ""
    partial = {p: bool(stopped) and p == second for p in ("no", "bf16")}  # timed only until the pick was known
    reason = (f"measured one training step's linear layers ({len(shapes)} shapes, {rows} rows, {head_rows} at the "
              f"head): float32 {_ms(float32, partial['no'])}, bf16 autocast {_ms(bf16, partial['bf16'])}, bf16 "
              f"{bound}{speedup:.2f}x as fast; {NAMES[precision]}, since bf16 is kept only at {margin:.2f}x or more "
              f"(it changes the numerics); CPU {cpu.get('capability')}"
              + (" + avx512_bf16" if cpu.get("avx512_bf16") else "") + (" + AMX" if cpu.get("amx") else "")
              + f", {torch.get_num_threads()} thread(s)")
    choice = PrecisionChoice(precision=precision, reason=reason, cpu=cpu, threads=torch.get_num_threads(),
                             rows=sizes, measured=measured, bf16_speedup=round(speedup, 3),
                             margin=margin, seconds=round(time.perf_counter() - started, 3))
    log.debug("mixed precision auto: %s, %s (%.2fs)", NAMES[precision], reason, choice.seconds)
    return choice


def _ms(seconds: float, partial: bool) -> str:
    return f"{'over ' if partial else ''}{seconds * 1e3:.1f} ms"


def resolve_train_precision(model: nn.Module, setting: PrecisionSetting, device: str | torch.device, rows: int,
                            head_rows: int | None = None, *, measure: TrainMeasure | None = None,
                            cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """The precision a training run of ``model`` uses, and why: an explicit ``setting`` as given; ``auto``: bf16 on
    a CUDA GPU (not measured), measured on the CPU (``choose_train_precision`` on ``train_shapes(model)``), and
    float32 on another accelerator (not measured). Keys as ``PrecisionChoice.to_json``: ``precision`` (``no`` or
    ``bf16``), ``reason``, ``given``, ``requested``, and where measured, ``measured`` and the rest."""
    if setting != "auto":
        return {"precision": setting, "requested": setting, "given": True,
                "reason": f"--mixed-precision {setting}"}
    device = torch.device(device)
    if device.type == "cuda":
        return {"precision": "bf16", "requested": "auto", "given": False,
                "reason": f"bf16 on {device.type} (not measured: a GPU's training format)"}
    if device.type != "cpu":
        return {"precision": "no", "requested": "auto", "given": False,
                "reason": f"float32 on {device.type} (not measured: auto measures on a CPU only)"}
    return choose_train_precision(train_shapes(model), rows, head_rows, measure=measure, cpu=cpu).to_json()


def recorded_precision(state_files: Sequence[Path]) -> dict[str, Any] | None:
    """The precision choice a run's resume state recorded (``precision_choice`` in the first of ``state_files``
    there is), None without a state. A state written before the choice was recorded ran under auto's earlier rule:
    bf16 with a CUDA GPU, else float32."""
    for state_file in state_files:
        if state_file.is_file():
            saved = read_json(state_file)
            if not isinstance(saved, dict):  # the run's resume refuses it
                return None
            if isinstance(saved.get("precision_choice"), dict):
                return {k: v for k, v in saved["precision_choice"].items() if k != "kept_from_first_sitting"}
            precision = "bf16" if torch.cuda.is_available() else "no"
            return {"precision": precision, "requested": "auto", "given": False,
                    "reason": f"{NAMES[precision]}: {state_file} recorded no choice, so the run's first sitting "
                              "took auto's earlier rule (bf16 with a CUDA GPU, else float32)"}
    return None
