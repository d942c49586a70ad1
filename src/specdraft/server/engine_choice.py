"""``--engine auto``: the engine that serves a speculation loop cheapest on this machine, by measurement.

The same draft runs in torch (its QD04 pack) or in llama.cpp (its GGUF export), and which is cheaper in the loop a
draft server exists for depends on the CPU: with reuse a loop's call costs mostly its decode steps, where
llama.cpp's 4-bit kernels lead on a CPU that gives torch AVX2 alone, while torch prefills a new context faster and
its int4 and bf16 kernels pay with AVX-512 or AMX. So, given the export (``--gguf``), ``auto`` loads both and
replays a short loop on each (``LoopReplay``) through the lanes the server would run, each engine's prefix cache
on: a prompt, then calls that each add the drafted tokens the target kept and the target's own token. A loop costs
its first call and ``calls_per_loop - 1`` later calls; the cheaper engine serves, torch on a tie (its tokens are
the pack's own, which eval and the audit read). Without ``--gguf`` there is nothing to compare: torch serves.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

from specdraft.model.generation import DraftSampling
from specdraft.model.llamacpp_check import engine_problem
from specdraft.server.config import ServeConfig
from specdraft.server.engine import DraftEngine, load_engine, load_llamacpp_engine

log = logging.getLogger(__name__)

TIE_MARGIN = 0.05  # engines this close are tied, and torch serves: a choice that does not flip with the noise
REPLAY_CACHE_BYTES = 64 << 20  # the torch replay's prefix cache: the loop's blocks, many times over
FIRST_TOKEN = 3  # the replay's token ids start here: below are pad / bos / eos in the vocabularies served


@dataclass(frozen=True)
class LoopReplay:
    """The loop ``auto`` times: a prompt of ``prompt_tokens``, then ``timed_calls`` calls that each add
    ``accepted`` drafted tokens and the target's own; a whole loop makes ``calls_per_loop`` calls (96 generated
    tokens at three a call)."""

    prompt_tokens: int = 64
    timed_calls: int = 3
    accepted: int = 2
    calls_per_loop: int = 32
    seed: int = 0

    def capacity(self, num_draft: int) -> int:
        return self.prompt_tokens + self.timed_calls * (self.accepted + 1) + num_draft


LOOP_REPLAY = LoopReplay()

Replay = Callable[[DraftEngine, LoopReplay, int], dict[str, float]]  # (engine, replay, num_draft) -> seconds


def replay_loop(engine: DraftEngine, replay: LoopReplay, num_draft: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds of the replay's first call and the median of its later calls, on one row of ``engine`` with its
    prefix cache on (a warm-up draft first, so neither engine's first-call costs count)."""
    rng = random.Random(replay.seed)
    vocab = engine.vocab_size
    cache = engine.prefix_cache(32, REPLAY_CACHE_BYTES)
    lane = engine.lane(1, replay.capacity(num_draft), num_draft, cache)
    greedy = DraftSampling()

    def call(context: list[int]) -> tuple[float, list[int]]:
        started = clock()
        drafts = lane.admit([0], [context], [greedy])
        while len(drafts[0].tokens) < num_draft and not drafts[0].stopped:
            drafts = lane.step()
        return clock() - started, drafts[0].tokens

    try:
        call([rng.randrange(FIRST_TOKEN, vocab) for _ in range(8)])  # warm-up, another context: nothing reused
        context = [rng.randrange(FIRST_TOKEN, vocab) for _ in range(replay.prompt_tokens)]
        times = []
        for _ in range(replay.timed_calls + 1):
            seconds, drafted = call(context)
            times.append(seconds)
            kept = min(replay.accepted, len(drafted) - 1)  # a server of --num-draft 1 or 2 keeps fewer
            target = FIRST_TOKEN + (drafted[kept] + 1 - FIRST_TOKEN) % (vocab - FIRST_TOKEN)  # not the drafted one
            context = context + drafted[:kept] + [target]
    finally:
        lane.close()
    later = statistics.median(times[1:])
    return {"first_call_s": round(times[0], 6), "later_call_s": round(later, 6),
            "loop_s": round(times[0] + (replay.calls_per_loop - 1) * later, 6)}


def choose_engine(engines: Mapping[str, DraftEngine], num_draft: int, replay: LoopReplay = LOOP_REPLAY,
                  measure: Replay = replay_loop) -> dict[str, Any]:
    """Which of ``engines`` (by name, torch first) makes the replayed loop cheapest, and why: each engine's
    seconds, its loop's ratio to the cheapest, the replay. ``measure`` times one engine (a test passes its own)."""
    started = time.perf_counter()
    seconds = {name: measure(engine, replay, num_draft) for name, engine in engines.items()}
    best = min(s["loop_s"] for s in seconds.values())
    ratios = {name: s["loop_s"] / best for name, s in seconds.items()}
    pick = next(name for name in engines if ratios[name] <= 1 + TIE_MARGIN)  # the first is the tie's winner
    listed = ", ".join(f"{name} {ratios[name]:.2f}x ({s['first_call_s'] * 1e3:.0f} ms first call, "
                       f"{s['later_call_s'] * 1e3:.0f} ms later calls)" for name, s in seconds.items())
    tie = "; within {:.0%}: a tie, torch serves".format(TIE_MARGIN) if ratios[pick] > 1 else ""
    reason = (f"measured on a replayed speculation loop (a {replay.prompt_tokens}-token prompt, then calls adding "
              f"{replay.accepted} kept and 1 target token; a loop of {replay.calls_per_loop} calls), each engine "
              f"against the cheapest: {listed}{tie}")
    log.info("engine auto: %s, %s", pick, reason)
    return {"engine": pick, "reason": reason, "replay": asdict(replay),
            "candidates": {name: {**s, "ratio_to_cheapest": round(ratios[name], 3)} for name, s in seconds.items()},
            "seconds": round(time.perf_counter() - started, 3)}


def load_serving_engine(cfg: ServeConfig, measure: Replay = replay_loop) -> DraftEngine:
    """The engine ``cfg`` asks for: torch (the QD04 pack), llama.cpp (the GGUF export), or with ``auto`` the one
    ``choose_engine`` measures cheaper in a loop -- torch when no ``--gguf`` is given or llama.cpp does not run
    here. The served engine's ``compute_choice`` says which and why (``/health``)."""
    if cfg.engine == "llama.cpp":
        return load_llamacpp_engine(cfg.model_dir, cfg.gguf, cfg.model_name, cfg.threads)
    torch_engine = load_engine(cfg.model_dir, cfg.weights, cfg.compute, cfg.model_name, cfg.int4_prefill, cfg.lean,
                               cfg.device)
    if cfg.engine == "torch":
        return torch_engine
    if cfg.gguf is None:
        return _served(torch_engine, {"engine": "torch", "reason": "--engine auto without --gguf: the QD04 pack "
                                                                   "in torch, nothing to compare it with"})
    problem = ("llama-cpp-python is not installed (pip install 'specdraft[llama]')"
               if importlib.util.find_spec("llama_cpp") is None else engine_problem())
    if problem:
        log.warning("engine auto: llama.cpp does not run here, torch serves (%s)", problem)
        return _served(torch_engine, {"engine": "torch", "reason": f"llama.cpp does not run here: {problem}"})
    llama_engine = load_llamacpp_engine(cfg.model_dir, cfg.gguf, cfg.model_name, cfg.threads)
    try:
        choice = choose_engine({"torch": torch_engine, "llama.cpp": llama_engine}, cfg.num_draft, measure=measure)
    except BaseException:
        llama_engine.close()
        raise
    if choice["engine"] == "torch":
        llama_engine.close()
        return _served(torch_engine, choice)
    return _served(llama_engine, choice)


def _served(engine: DraftEngine, choice: dict[str, Any]) -> DraftEngine:
    engine.compute_choice = {**engine.compute_choice, "engine_choice": choice}
    return engine
