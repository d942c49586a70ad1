"""The demo's budgets: how much of the pipeline each runs (traces, training, evaluation, speculation), and the
draft the embedded target starts from. Each budget's measured time and figures are in BENCHMARKS.md; the
measurements behind each choice below are in docs/history.md."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Budget:
    """How much of the pipeline to run (BENCHMARKS.md has each budget's time and figures per CPU class)."""

    trace_prompts: int
    trace_tokens: int
    draft_init: str  # truncate:{target}:LAYERS template
    epochs: float
    lr: float
    freeze_layers: int
    val_prompts: int
    val_tokens: int
    spec_prompts: int
    spec_tokens: int
    spec_k: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    spec_repeats: int = 1  # passes over the speculation prompts: the spread of the speed-ups over passes
    qat: bool = False  # train through the 4-bit rounding of the pack that follows (its group size)
    eval_every: int = 25  # optimizer steps between scorings of the held-out traces (each scoring is a checkpoint)
    # GPTQ-calibrate the pack on the run's traces; not after QAT, whose weights are fitted to plain rounding
    gptq: bool = False
    # speculate's draft steps through torch.compile: its compile (minutes with an empty inductor cache) pays
    # over a long sweep, not over small's few hundred draft steps
    compile_drafts: bool = True
    # specdraft's own engine predicts each speed-up from measured costs (a replay of every drafter: as much
    # drafting again); llama.cpp always does, its drafts being cheap
    predict: bool = True
    # speculation in llama.cpp (when llama-cpp-python is installed): its draft lengths, and whether to add the
    # table of the target at F32 against its own 4-bit file (a second model load and pass over the prompts)
    llama_k: list[int] = field(default_factory=lambda: [2, 4, 8])
    llama_full_precision: bool = True
    # the target's first answers to MT-bench (where the shared data has it), up to this many tokens: the second
    # turn's context holds that answer (a follow-up asks to rewrite or extend it). 512 holds most answers whole; the
    # small budget's 128 keeps its decoding within the demo's time, its second turns then hold answers cut there
    mt_bench_answer_tokens: int = 512
    # the target's continuation evaluated on each MT-bench turn (a point every 16 tokens); None: val_tokens. The
    # small budget's 32 (two points a turn) keeps both turns' evaluation within the demo's time
    mt_bench_tokens: int | None = None

    @property
    def mt_bench_eval_tokens(self) -> int:
        return self.mt_bench_tokens or self.val_tokens


# The draft keeps 24 of the target's 30 layers; the default budget trains only the last 12 (the first 12 stay
# frozen), the small and full ones train all of them (below). Which 24:
# greedy elimination on the target's traces (`specdraft choose-layers`) drops 3, 5, 13, 14, 17 and 25; untrained,
# that cut accepts several times as much as dropping the block 16-21 (docs/history.md, "Which layers").
DRAFT_INIT = "truncate:{target}:" + ",".join(str(i) for i in range(30) if i not in (3, 5, 13, 14, 17, 25))
FROZEN_LAYERS = 12
# The self-draft (the target's own weights, packed, untrained) keeps its embedding in f16: the embedded
# target's linear layers sit on a 4-bit grid already (stored exactly), its Q8_0 embedding does not, and at 4
# bits it would lose much of the self-draft's acceptance.
SELF_DRAFT_EMBEDDING = "f16"

BUDGETS: dict[str, Budget] = {
    # 200 prompts traced 32 tokens deep, one pass: the same tokens and training steps as 102 prompts of 64 tokens
    # for 1.5 passes, spread over twice the prompts, accept more for a little more tracing (docs/history.md, "The
    # small budget's recipe", "Shorter traces over more prompts").
    # Speculation: two prompts, each drafter at k = 16 (the calibrated stop drafts fewer where that pays), two
    # passes so that the summary can tell a difference from the machine's noise, short enough to keep the whole
    # demo within its time on an AVX2-only CPU (speed only: no acceptance figure comes from it); no predicted
    # speed-ups; in llama.cpp one middling k and no full-precision table, to keep within its time. Every layer
    # trains: the layers next to the ones the cut drops are among the first 12, and at 22 steps training them pays
    # more than the backward pass through them costs (docs/history.md, "The small budget's recipe")
    "small": Budget(trace_prompts=200, trace_tokens=32, draft_init=DRAFT_INIT, epochs=1, lr=5e-4,
                    freeze_layers=0, val_prompts=16, val_tokens=64, spec_prompts=2, spec_tokens=32,
                    spec_k=[16], spec_repeats=2, qat=True, compile_drafts=False, predict=False, llama_k=[4],
                    llama_full_precision=False, mt_bench_answer_tokens=128, mt_bench_tokens=32),
    # 960 traces for 1 epoch rather than 480 for 3: more data beat more epochs (docs/history.md, "More traces, one
    # epoch"); scored every 100 steps rather than 25 so that the extra traces fit the budget's earlier wall time;
    # the first 12 layers frozen: training them too accepts a little more, but by a smaller share than it adds to
    # the wall time (docs/history.md, "Which layers train")
    "default": Budget(trace_prompts=960, trace_tokens=128, draft_init=DRAFT_INIT, epochs=1, lr=5e-4,
                      freeze_layers=FROZEN_LAYERS, val_prompts=80, val_tokens=128, spec_prompts=8, spec_tokens=96,
                      spec_repeats=2, gptq=True, eval_every=100),
    # 2 epochs, scored every 100 steps: at 3 epochs scored every 25 (scoring took much of the training time) the
    # budget ran over the 4 h it is meant for. Every layer trains: on the default budget's traces that accepts more
    # than 12 frozen for somewhat more training time, which the full budget's hours leave room for and the
    # default's wall time does not repay (docs/history.md, "Which layers train")
    "full": Budget(trace_prompts=2000, trace_tokens=128, draft_init=DRAFT_INIT, epochs=2, lr=5e-4,
                   freeze_layers=0, val_prompts=80, val_tokens=192, spec_prompts=16, spec_tokens=128,
                   spec_repeats=2, gptq=True, eval_every=100),
}
