"""``--compute auto``: the linear-layer format that runs a stage's work fastest on this machine, by measurement.

The same format is the fastest on one CPU and far slower on another: the int4 kernel and bf16 matmuls
pay on CPUs with AVX-512 bf16 or AMX and cost more than float32 where torch has AVX2 alone. So instead of a fixed
default, ``choose_compute`` times each candidate (``CANDIDATES``: float32, bfloat16, and int4 decode steps with a
dense bf16, a dense float32 or an int4 prefill) on the draft's own linear shapes, at the rows the stage runs
(``Workload``: the rows of its decode steps, the tokens of its prefills), and keeps the one whose worst case over
those scenarios is closest to the fastest candidate for each. What the CPU reports (``cpu_features``) only orders
the candidates -- which one wins a tie and which are timed first --; the timing decides.

The measurement runs the linear modules the model would run (``quant.linear``'s) on constant weights of its
shapes, at the caller's thread count, and stops timing a candidate once it is far behind: the whole choice takes
a small fraction of a load. Attention and the rest of a forward do not depend on the format and are left out: the
choice compares formats, it does not predict a forward's time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from specdraft.quant import q4g
from specdraft.quant.linear import (
    RESCORE_TOP_K,
    BF16Linear,
    Compute,
    F32Linear,
    Int4Linear,
    Int4Prefill,
    int4_unsupported,
)

log = logging.getLogger(__name__)

ComputeSetting = Literal["auto", "float32", "bfloat16", "int4"]
COMPUTE_HELP = ("auto (time float32, bfloat16 and int4 on this machine at load, on the draft's own shapes, and "
                "keep the fastest for this stage's work), float32, bfloat16, or int4 (the QD04 4-bit codes run by "
                "torch's CPU int4 kernel)")
# A prefill is timed at most this many rows and scaled by its tokens: per token a matmul costs about the same at
# more rows, and the slow formats would otherwise take seconds to time
PREFILL_PROBE_ROWS = 128
# Likewise a layer with more outputs than this (a 49K-row vocabulary head) is timed on this many of its rows and
# scaled: building the whole head in every format would take longer than the rest of the choice
PROBE_OUT_FEATURES = 8192
# a candidate whose running total passes this multiple of the best finished candidate's is not timed further
PRUNE_FACTOR = 2.0
REPEATS = 3  # timed calls per (module, rows) after one warm-up call; the minimum is kept
# Candidates this close to the best are tied, and the CPU's likely fastest wins: a repeated measurement on a
# noisy machine then keeps choosing the same format (and drafting the same tokens)
TIE_MARGIN = 0.05


@dataclass(frozen=True)
class Candidate:
    """One way to run the linear layers: the format of the decode steps, and for int4 that of the prefill."""

    compute: Compute
    prefill: Int4Prefill = "bfloat16"  # int4 only: a dense bf16 or float32 copy of the weights, or the codes

    @property
    def name(self) -> str:
        return self.compute if self.compute != "int4" else f"int4, {self.prefill} prefill"

    def module(self, prefill: bool, head: bool) -> str:
        """Which kind of linear module runs a pass: ``f32``, ``bf16``, ``int4`` or ``int4-head`` (rescored)."""
        if self.compute != "int4":
            return MODULE_OF[self.compute]
        if head:  # the head keeps one row per sequence in both passes, on the codes
            return "int4-head"
        return MODULE_OF[self.prefill] if prefill else "int4"


MODULE_OF = {"float32": "f32", "bfloat16": "bf16", "int4": "int4"}
CANDIDATES = (Candidate("float32"), Candidate("bfloat16"), Candidate("int4", "bfloat16"),
              Candidate("int4", "float32"), Candidate("int4", "int4"))


@dataclass(frozen=True)
class Workload:
    """What a stage asks of its draft: prefills of ``context_tokens`` tokens, and ``draft_tokens`` decode steps
    at each of ``decode_rows`` rows (requests decoding together). Every pair is a scenario the choice weighs."""

    decode_rows: tuple[int, ...] = (1,)
    context_tokens: tuple[int, ...] = (256,)
    draft_tokens: int = 16

    def scenarios(self) -> list[tuple[int, int]]:
        return [(t, b) for t in self.context_tokens for b in self.decode_rows]


# The stages' workloads, defined once. The server answers one request or a few together, contexts up to a long
# conversation; eval drafts its points in batches; speculation drafts one sequence, extending a kept cache.
SERVE_WORKLOAD = Workload(decode_rows=(1, 4), context_tokens=(64, 256, 1024))
EVAL_WORKLOAD = Workload(decode_rows=(16,), context_tokens=(128, 512))
SPECULATE_WORKLOAD = Workload(decode_rows=(1,), context_tokens=(128,))


@dataclass(frozen=True)
class LinearShape:
    """A linear layer's (out_features, in_features), how many the model has, and whether it is the head."""

    out_features: int
    in_features: int
    count: int = 1
    head: bool = False


@dataclass
class ComputeChoice:
    """What ``choose_compute`` picked and why: each candidate's estimated seconds per scenario, its worst ratio
    to the fastest, what the CPU reports, and how long the measurement took."""

    compute: Compute
    prefill: Int4Prefill
    reason: str
    cpu: dict[str, Any] = field(default_factory=dict)
    threads: int = 1
    workload: dict[str, Any] = field(default_factory=dict)
    candidates: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cpu_features() -> dict[str, Any]:
    """What torch reports of this CPU: the ATen kernels' instruction set and the matrix extensions."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": bool(caps.get("avx512_bf16", False)),
            "amx": bool(caps.get("amx_tile", False) or caps.get("amx_bf16", False)),
            "threads": torch.get_num_threads()}


def candidate_order(cpu: dict[str, Any]) -> list[Candidate]:
    """The candidates, the likely fastest first: the reduced-precision formats where the CPU has bf16 or AMX
    units, float32 first where it has neither."""
    float32, bfloat16, int4_bf16, int4_f32, int4_int4 = CANDIDATES
    if cpu.get("avx512_bf16") or cpu.get("amx"):
        return [int4_bf16, bfloat16, int4_f32, int4_int4, float32]
    return [float32, int4_f32, int4_int4, bfloat16, int4_bf16]


def linear_shapes(model: nn.Module) -> list[LinearShape]:
    """The distinct linear shapes of ``model``, with their counts; the output embedding marked as the head."""
    head = model.get_output_embeddings()
    counts: dict[tuple[int, int, bool], int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            key = (module.out_features, module.in_features, module is head)
            counts[key] = counts.get(key, 0) + 1
    return [LinearShape(n, k, c, h) for (n, k, h), c in sorted(counts.items())]


# ------------------------------------------------------------------------------------------- measuring

Measure = Callable[[str, LinearShape, int], float]  # (module kind, shape, rows) -> seconds of one call


class ModuleTimer:
    """Times the linear modules ``quant.linear`` builds, on random weights of each shape; one module per (kind,
    shape), built when first timed."""

    def __init__(self, group_size: int = q4g.DEFAULT_GROUP_SIZE, clock: Callable[[], float] = time.perf_counter,
                 repeats: int = REPEATS, row_block: int = 1):
        self.group_size, self.clock, self.repeats, self.row_block = group_size, clock, repeats, row_block
        self.modules: dict[tuple[str, int, int], nn.Module] = {}

    def _module(self, kind: str, n: int, k: int) -> nn.Module:
        if (kind, n, k) not in self.modules:
            self.modules[(kind, n, k)] = timing_module(kind, n, k, self.group_size, self.row_block).eval()
        return self.modules[(kind, n, k)]

    def __call__(self, kind: str, shape: LinearShape, rows: int) -> float:
        n = min(shape.out_features, PROBE_OUT_FEATURES)
        module = self._module(kind, n, shape.in_features)
        x = torch.empty(rows, shape.in_features).uniform_(-1, 1)
        times = []
        with torch.inference_mode():
            module(x)  # warm-up: first-call allocations and kernel selection
            for _ in range(self.repeats):
                started = self.clock()
                module(x)
                times.append(self.clock() - started)
        return min(times) * shape.out_features / n


def timing_module(kind: str, n: int, k: int, group_size: int, row_block: int = 1) -> nn.Module:
    """A linear module of ``kind`` and shape [n, k] as ``apply_compute`` would build it (``row_block`` > 1: float32
    rows padded to whole GEMM tiles, as a row-invariant server runs them). Its values are constants: a dense or int4
    matmul costs the same whatever they are, and filling a 49K-row head at random would cost more than timing it."""
    if kind == "f32":
        if row_block > 1:
            return F32Linear(torch.full((n, k), 0.01), row_block=row_block)
        module = nn.utils.skip_init(nn.Linear, k, n, bias=False)
        module.weight.data = torch.full((n, k), 0.01)
        return module
    if kind == "bf16" or int4_unsupported((n, k), group_size):  # where apply_compute falls back to bf16
        return BF16Linear(torch.full((n, k), 0.01, dtype=torch.bfloat16))
    groups = q4g.num_groups(k, group_size)
    codes = q4g.QuantizedTensor(codes=torch.full((n, k // 2), 0x5A, dtype=torch.uint8),
                                scales=torch.full((n, groups), 0.01, dtype=torch.float16),
                                mins=torch.full((n, groups), -0.08, dtype=torch.float16), shape=(n, k))
    return Int4Linear(codes, rescore_top_k=RESCORE_TOP_K if kind == "int4-head" else 0)


def choose_compute(shapes: Sequence[LinearShape], workload: Workload, *, measure: Measure | None = None,
                   cpu: dict[str, Any] | None = None, group_size: int = q4g.DEFAULT_GROUP_SIZE,
                   f32_row_block: int | None = 1) -> ComputeChoice:
    """The candidate whose worst scenario of ``workload`` is closest to that scenario's fastest candidate.

    A scenario (a context of T tokens, decode steps at B rows) costs a candidate its prefill of T tokens plus
    ``draft_tokens`` decode steps of B rows shared by B requests (so per request 1/B of each step). ``measure``
    times one call of a kind of module (``ModuleTimer`` by default; a test passes its own). ``f32_row_block``: how
    float32 rows run (> 1: padded to whole GEMM tiles, for a caller that needs each row the same in any batch; None:
    float32 cannot give it here, and the candidates that use float32 are left out).
    """
    started = time.perf_counter()
    cpu = cpu if cpu is not None else cpu_features()
    measure = measure or ModuleTimer(group_size, row_block=f32_row_block or 1)
    scenarios = workload.scenarios()
    memo: dict[tuple[str, LinearShape, int], float] = {}

    def seconds(kind: str, shape: LinearShape, rows: int) -> float:
        probe = min(rows, PREFILL_PROBE_ROWS)
        if (kind, shape, probe) not in memo:
            memo[(kind, shape, probe)] = measure(kind, shape, probe)
        return memo[(kind, shape, probe)] * rows / probe

    def forward(c: Candidate, rows: int, prefill: bool) -> float:
        """Linear seconds of one forward over ``rows`` rows; a prefill's head runs at its last position only."""
        total = 0.0
        for s in shapes:
            head_rows = 1 if prefill else rows
            total += s.count * seconds(c.module(prefill, s.head), s, head_rows if s.head else rows)
        return total

    costs: dict[str, dict[str, float]] = {}
    pruned: dict[str, str] = {}
    order = candidate_order(cpu)
    if f32_row_block is None:
        for c in order:
            if "f32" in (c.module(True, False), c.module(False, False)):
                pruned[c.name] = "float32 is not row-invariant on this machine: not a candidate"
        order = [c for c in order if c.name not in pruned]
    for c in order:
        per_scenario: dict[str, float] = {}
        for t, b in scenarios:
            key = f"{t} tokens, {b} rows"
            per_scenario[key] = forward(c, t, prefill=True) + workload.draft_tokens * forward(c, b, prefill=False) / b
            best_done = min((v[key] for v in costs.values()), default=None)
            if best_done is not None and per_scenario[key] > PRUNE_FACTOR * best_done:
                pruned[c.name] = f"{per_scenario[key] / best_done:.1f}x the fastest at {key}: not timed further"
                break
        if c.name not in pruned:
            costs[c.name] = per_scenario
    fastest = {key: min(v[key] for v in costs.values()) for key in next(iter(costs.values()))}
    worst = {name: max(v[key] / fastest[key] for key in fastest) for name, v in costs.items()}
    by_name = {c.name: c for c in order}
    # within TIE_MARGIN of the best is a tie, which the CPU's order breaks: a pick that does not flip with the noise
    best = min(worst.values())
    pick = next(c.name for c in order if c.name in worst and worst[c.name] <= best * (1 + TIE_MARGIN))
    chosen = by_name[pick]
    candidates: dict[str, dict[str, Any]] = {
        name: {"seconds_per_request": {k: round(v, 6) for k, v in costs[name].items()},
               "worst_ratio_to_fastest": round(worst[name], 3)} for name in costs}
    for name, why in pruned.items():
        candidates[name] = {"pruned": why}
    contexts = f"contexts of {_span(workload.context_tokens)} tokens, {_span(workload.decode_rows)} rows decoding"
    ratios = ", ".join([f"{name} {worst[name]:.2f}x" for name in sorted(worst, key=worst.get)]
                       + [f"{name} pruned" for name in pruned])
    tie = worst[pick] > best
    reason = (f"measured over {len(scenarios)} scenarios ({contexts}), each candidate's worst time against the "
              f"fastest: {ratios}" + (f" (within {TIE_MARGIN:.0%}: a tie, which the CPU's order breaks)" if tie else "")
              + f"; CPU {cpu.get('capability')}" + (" + avx512_bf16" if cpu.get("avx512_bf16") else "")
              + (" + AMX" if cpu.get("amx") else "") + f", {torch.get_num_threads()} thread(s)")
    prefill = chosen.prefill if chosen.compute == "int4" else chosen.compute  # a dense format prefills as it decodes
    choice = ComputeChoice(compute=chosen.compute, prefill=prefill, reason=reason, cpu=cpu,
                           threads=torch.get_num_threads(),
                           workload={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(workload).items()},
                           candidates=candidates,
                           seconds=round(time.perf_counter() - started, 3))
    log.info("compute auto: %s, %s (%.2fs)", chosen.name, reason, choice.seconds)
    return choice


def _span(values: Sequence[int]) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"

