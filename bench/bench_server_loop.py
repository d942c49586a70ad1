"""The draft server in a speculation loop: with and without reusing what it computed (its prefix cache), against
llama.cpp's llama-server with its prompt cache, or with and without ending drafts early by their own confidence.

  .venv/bin/python bench/bench_server_loop.py                      # the stand-in draft, SmolLM2-135M-Instruct target
  .venv/bin/python bench/bench_server_loop.py --tiny --new-tokens 48   # tiny random models: a quick check
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/demo/model --turn 2 --name server_loop_turn2
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/demo/model --conversation --name server_loop_conversation
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/demo/model --stop-confidence 0.4 \
      --settings reuse stop_0.4 llama_server --name server_loop_stop   # drafts that stop, against full drafts
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/demo/model --loops 16 --prompts-per-loop 1 \
      --settings reuse --serve-args="--prefix-cache-mb 64" --name server_loop_soak   # memory within a small cache

The loop as a speculative decoder runs it: each call sends the prompt and every token generated so far; the
matching prefix of the 16 drafted tokens is accepted, plus the target's next token, and the next call sends the
longer context. The target is greedy-decoded ahead of time (--new-tokens per prompt, stopping at its EOS), so the
replay costs the server's time only, and every setting sees the target's exact tokens.

Prompts: --prompts-file (default ../shared/data/dev/mt_bench.jsonl, a public set nobody here trains on), else the
package's held-out prompts, in the target's chat template. --turn 1 (default): each question's first turn. --turn 2:
the conversation a chat client sends for the second question -- the first question, the target's own greedy first
answer (at most --first-answer-tokens), the second question -- so contexts are several hundred tokens long, and
each prompt reaches the server cold. --conversation: both turns in one loop, as a chat client holds the conversation
-- the first answer generated through the loop (at most --first-answer-tokens), then the second question asked after
it and --new-tokens of its answer -- so the second turn's context extends what the server saw in the first. The
draft: --draft-dir, or the stand-in bench_server.py builds (the target's first --standin-layers layers, packed
QD04); with --tiny, a tiny random Qwen3 as the target and itself packed as the draft.

Settings (--settings picks some): `reuse` (`specdraft serve` with its default prefix cache), `no_reuse`
(`--prefix-cache-mb 0`: every context prefilled whole), `llama_engine` and `llama_engine_no_reuse` (the same, with
`--engine llama.cpp` serving the draft's GGUF export: sessions reused token for token), and `llama_server` when its
binary is there
(bench/build_llama_cpp.sh; --llama-server): llama.cpp's server on the same draft exported as GGUF (`specdraft export
--format gguf`, its 4-bit codes as Q4_1 without loss; --gguf), one slot per loop, `"cache_prompt": true` (a slot
keeps its KV between requests and computes only what the new prompt adds, drafted tokens the next prompt confirms
included), greedy, the same compute threads as specdraft's server (--threads; default: the CPUs - 1).

For each --loops count C (default 1 and 4: C loops side by side, each working through --prompts-per-loop prompts
of its own) and each setting, a fresh server, a warm-up on a prompt the levels do not use, then the loops. The
settings take turns going first from one level to the next. specdraft's compute format: the first server's
`--compute auto` choice, given explicitly to every other specdraft server (one measurement at load per run).

With --stop-confidence T [T ...] there is also a setting `stop_T` for each T: reuse on, and every request carries
`"stop_confidence": T`, so a draft ends after its first token whose confidence is below T, and the server spends no
decode steps on the rest (`llama_engine_stop_T` likewise in the llama.cpp engine, `no_reuse_stop_T` without the
prefix cache). It reports the tokens drafted per call, the share of calls stopped early, and the share of
the contexts it and `reuse` both sent where its draft is `reuse`'s draft's prefix (bit for bit, as the server
promises).

With --guide-ratio R [R ...] there are settings `guided_R` and `llama_engine_guided_R`: every request carries prompt
lookup's copies of its context (`lookup_continuations`) as `guide_ids` and `guide_alternatives` with
`guide_min_ratio` R (the client's `HybridDrafter` under a guided rule; the lookup runs in the loop, outside the
server's time), so a call's draft takes a copy's token where the draft finds it plausible. Its accepted tokens per
call are what it changes.

Per level and setting: server time per generated token (the calls' latencies summed over the tokens the loops
generated: what a loop waits per token) and generated tokens per second (over the level's wall time), p50 / p99 of a
call (a 503's Retry-After waited out and the request sent again, the wait counted in the call; the 503s counted),
calls and mean accepted length, context tokens reused and computed (specdraft's /metrics; llama-server's
`timings.cache_n` / `prompt_n`), the server's peak RSS, and for specdraft the prefix cache's peak use against its
budget (/health, sampled twice a second); each other setting's ratios to `reuse` (above 1: it costs more); and
the share of identical drafts on the contexts it and `reuse` both sent (with reuse specdraft prefills in blocks,
without it whole: the last bits of the logits may differ, and a near-tie flip; llama.cpp computes with 8-bit
activations).

Writes ``bench/results/NAME.<cpu class>.json`` (--name, default server_loop) and --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench_server import build_standin
from bench_server_peers import LLAMA, SPECDRAFT, LlamaPeer, default_llama_server, default_threads
from harness import (
    RssSampler,
    add_out_argument,
    argument_parser,
    log_to_console,
    metric_values,
    percentile,
    save_result,
)
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.data.corpus import heldout_path
from specdraft.data.mt_bench import read_mt_bench
from specdraft.drafting.lookup import lookup_continuations
from specdraft.drafting.metrics import accepted_length
from specdraft.drafting.mt_bench import second_turn_context
from specdraft.drafting.remote import MAX_RETRY_WAIT_S, draft_request, retry_after_seconds
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench")

REPO = Path(__file__).resolve().parents[1]
MAX_REFUSALS = 50  # 503s waited out per call before the loop gives up
MT_BENCH = REPO.parent / "shared" / "data" / "dev" / "mt_bench.jsonl"


@dataclass(frozen=True)
class Setting:
    """A server the loops run against: which one, its extra arguments, the fields added to every request."""

    server: str = SPECDRAFT
    args: tuple[str, ...] = ()
    fields: dict[str, Any] = field(default_factory=dict)
    llama_engine: bool = False  # `specdraft serve --engine llama.cpp --gguf` the draft's GGUF export
    guide_min_ratio: float | None = None  # each request carries prompt lookup's copies as its guides


REUSE_SETTINGS = {"reuse": Setting(), "no_reuse": Setting(args=("--prefix-cache-mb", "0")),
                  "llama_engine": Setting(llama_engine=True),
                  "llama_engine_no_reuse": Setting(args=("--prefix-cache-mb", "0"), llama_engine=True),
                  "llama_server": Setting(server=LLAMA)}


def stop_settings(thresholds: list[float]) -> dict[str, Setting]:
    """For each threshold, drafts that stop (with the server's default prefix cache, like ``reuse``), in torch and
    in the llama.cpp engine, and in torch without the cache (``no_reuse_stop_T``: what reuse saves when drafts
    stop, their decode steps no longer the most of a call)."""
    return {**{f"stop_{t:g}": Setting(fields={"stop_confidence": t}) for t in thresholds},
            **{f"llama_engine_stop_{t:g}": Setting(fields={"stop_confidence": t}, llama_engine=True)
               for t in thresholds},
            **{f"no_reuse_stop_{t:g}": Setting(args=("--prefix-cache-mb", "0"), fields={"stop_confidence": t})
               for t in thresholds}}


def guided_settings(ratios: list[float]) -> dict[str, Setting]:
    """For each ratio, requests that carry prompt lookup's copy of the context as their guide (the client's
    ``HybridDrafter`` under a guided rule; the lookup runs in the loop, outside the server's time), in torch and in
    the llama.cpp engine, with the server's default prefix cache."""
    return {**{f"guided_{r:g}": Setting(guide_min_ratio=r) for r in ratios},
            **{f"llama_engine_guided_{r:g}": Setting(guide_min_ratio=r, llama_engine=True) for r in ratios}}


# ---------------------------------------------------------------------------------------------- inputs

def ensure_models(args) -> tuple[Path, str, str]:
    """(packed draft dir, its description, the target: a model spec or a dir)."""
    from specdraft.cli import main as cli

    work = Path(args.work)
    if args.tiny:
        from specdraft.model.tiny import build_tiny_model

        target = work / "tiny-qwen3"
        if not (target / "config.json").is_file():
            build_tiny_model(target, "qwen3", layers=4, hidden=128, max_positions=1024)
        float_dir, what = target, "tiny random Qwen3 (4 layers), packed QD04; the same model is the target"
    elif args.draft_dir:
        return Path(args.draft_dir), args.draft_label or f"the draft in {args.draft_dir}", args.target
    else:
        float_dir = build_standin(args.standin_layers, work / f"standin-L{args.standin_layers}", args.target)
        what = f"stand-in: first {args.standin_layers} layers of {args.target}, packed QD04"
    packed = float_dir.with_name(float_dir.name + "-packed")
    if not (packed / "draft.qd4").is_file():
        if cli(["pack", "--checkpoint", str(float_dir), "--out", str(packed), "--overwrite"]):
            raise SystemExit("pack failed")
    return packed, what, str(target) if args.tiny else args.target


def ensure_gguf(args, draft_dir: Path) -> Path:
    """The draft as llama-server loads it: --gguf, or `specdraft export --format gguf` of the packed draft."""
    from specdraft.cli import main as cli

    if args.gguf:
        return Path(args.gguf)
    gguf = Path(args.work) / "gguf" / f"{draft_dir.resolve().name}.gguf"
    if not gguf.is_file():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        if cli(["export", str(draft_dir), "--format", "gguf", "--out", str(gguf), "--overwrite"]):
            raise SystemExit("export to GGUF failed")
    return gguf


def load_questions(args, count: int) -> tuple[list[tuple[str, ...]], str]:
    """Each question's turns (one, or both for --turn 2 and --conversation) and where they come from."""
    path = Path(args.prompts_file)
    if path.is_file():
        which = "both turns in one loop" if args.conversation else f"turn {args.turn}"
        return [q.turns[:2 if args.conversation else args.turn] for q in read_mt_bench(path)][:count], \
            f"{path.name} ({which})"
    if args.turn == 2 or args.conversation:
        raise SystemExit(f"--turn 2 and --conversation need an MT-bench file with second turns; {path} is not there")
    rows = [json.loads(line) for line in heldout_path().read_text().splitlines() if line.strip()]
    return [(r["prompt"],) for r in rows][:count], "the package's held-out prompts"


def target_runs(args, target: str, questions: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    """[{prompt_ids, target_ids}]: each prompt in the chat template (for a second turn, the conversation with the
    target's own first answer) and the target's greedy continuation (cached in --work). With --conversation, each
    question's [{segments: [first turn, second turn]}], the first turn's target tokens its first answer."""
    import torch

    from specdraft.data.mt_bench import MTBenchQuestion
    from specdraft.model.chat import encode_prompts
    from specdraft.model.decode import greedy_decode
    from specdraft.model.specs import load_model, load_tokenizer

    two = args.turn == 2 or args.conversation
    key = (f"{target}|{args.new_tokens}|{args.first_answer_tokens if two else ''}|"
           f"{'conversation|' if args.conversation else ''}{json.dumps(questions)}")
    cache = Path(args.work) / "loop_targets.json"
    stored = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in stored:
        return stored[key]
    tok = load_tokenizer(target)
    model = load_model(target, torch.float32)
    first = prompts = encode_prompts(tok, [q[0] for q in questions])
    if two:
        log.info("greedy-decoding %d first answers x %d tokens with the target", len(prompts), args.first_answer_tokens)
        answers = greedy_decode(model, prompts, args.first_answer_tokens, batch_size=8)
        prompts = [second_turn_context(tok, MTBenchQuestion(str(i), "loop", (q[0], q[1])), a.tokens)
                   for i, (q, a) in enumerate(zip(questions, answers))]
    log.info("greedy-decoding %d prompts x %d tokens with the target", len(prompts), args.new_tokens)
    gens = greedy_decode(model, prompts, args.new_tokens, batch_size=8)
    stored[key] = [{"prompt_ids": p, "target_ids": g.tokens} for p, g in zip(prompts, gens)]
    if args.conversation:
        stored[key] = [{"segments": [{"prompt_ids": p, "target_ids": a.tokens}, second]}
                       for p, a, second in zip(first, answers, stored[key])]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(stored))
    return stored[key]


# ---------------------------------------------------------------------------------------------- the servers

@dataclass
class Reply:
    draft: list[int]
    stopped: bool = False
    reused: int | None = None  # context tokens the server took from its cache (llama-server says so per reply)
    computed: int | None = None


class SpecdraftLoopServer:
    """`specdraft serve` (ServerProcess) answering `POST /draft`; its counters from /metrics, its cache's use from
    /health sampled in a thread."""

    def __init__(self, draft_dir: Path, extra: list[str], fields: dict[str, Any], log_path: Path,
                 start_timeout: float, guide_min_ratio: float | None = None):
        self.process = ServerProcess(draft_dir, log_path, extra)
        self.fields, self.start_timeout, self.guide_min_ratio = fields, start_timeout, guide_min_ratio
        self.cache_peak = 0
        self._sampling = threading.Event()
        self._sampler = threading.Thread(target=self._sample_cache, daemon=True)

    def __enter__(self) -> SpecdraftLoopServer:
        self.process.__enter__()
        ok, what = self.process.wait_ready(self.start_timeout)
        if not ok:
            self.process.stop()
            raise SystemExit(f"specdraft serve did not start: {what}")
        self.health = httpx.get(self.url + "/health", trust_env=False, timeout=30).json()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sampling.set()
        self.process.__exit__(*exc)

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def compute_args(self) -> list[str]:
        choice = self.health["compute_choice"]
        return ["--compute", choice["compute"], "--int4-prefill", choice["prefill"]] \
            if choice["compute"] == "int4" else ["--compute", choice["compute"]]

    def request(self, context: list[int], num_draft: int) -> tuple[str, dict[str, Any]]:
        body = {"token_ids": context, "num_tokens": num_draft, **self.fields}
        if self.guide_min_ratio is not None:
            body.update(draft_request(context, num_draft, guides=lookup_continuations(context, num_draft)[0],
                                      guide_min_ratio=self.guide_min_ratio))
        return "/draft", body

    def reply(self, answer: dict[str, Any]) -> Reply:
        return Reply(answer["draft_ids"], stopped=answer.get("stop_reason") == "confidence")

    def counters(self) -> dict[str, float]:
        return metric_values(httpx.get(self.url + "/metrics", timeout=30, trust_env=False).text)

    def start_sampling(self) -> None:
        self._sampler.start()

    def _sample_cache(self) -> None:
        with httpx.Client(base_url=self.url, trust_env=False, timeout=10) as http:
            while not self._sampling.wait(0.5):
                try:
                    cache = http.get("/health").json().get("prefix_cache")
                except (httpx.HTTPError, ValueError):
                    continue
                if cache:
                    self.cache_peak = max(self.cache_peak, cache["used_bytes"])


class LlamaLoopServer:
    """llama-server (bench_server_peers.LlamaPeer) answering `POST /completion` with its prompt cache on."""

    def __init__(self, args, gguf: Path, loops: int, slot_context: int, log_path: Path):
        self.start_timeout = args.start_timeout
        peer_args = argparse.Namespace(llama_server=args.llama_server, gguf=gguf, num_tokens=args.num_draft,
                                       threads=args.threads, llama_args="")
        self.peer = LlamaPeer(peer_args, slot_context, cache_prompt=True)
        self.loops, self.log_path = loops, log_path

    def __enter__(self) -> LlamaLoopServer:
        self.props = self.peer.start(self.loops, self.log_path, self.start_timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.peer.stop()

    @property
    def url(self) -> str:
        return self.peer.url

    @property
    def pid(self) -> int:
        return self.peer.pid

    def request(self, context: list[int], num_draft: int) -> tuple[str, dict[str, Any]]:
        return self.peer.route, json.loads(self.peer.body(context))

    def reply(self, answer: dict[str, Any]) -> Reply:
        timings = answer.get("timings", {})
        return Reply(self.peer.tokens(answer), reused=timings.get("cache_n"), computed=timings.get("prompt_n"))


# ---------------------------------------------------------------------------------------------- the loop

def segments(run: dict[str, Any]) -> list[dict[str, list[int]]]:
    """A run's prompts in the order one loop sends them: a conversation's turns, else the one prompt."""
    return run.get("segments", [run])


def speculate_run(server, run: dict[str, Any], num_draft: int, calls: list[dict[str, Any]]) -> int:
    """A run's prompts one after the other in one loop (each call tagged with its turn); the tokens generated."""
    tokens = 0
    for turn, segment in enumerate(segments(run), 1):
        first = len(calls)
        tokens += speculate(server, segment, num_draft, calls)
        for call in calls[first:]:
            call["turn"] = turn
    return tokens


def speculate(server, run: dict[str, list[int]], num_draft: int, calls: list[dict[str, Any]]) -> int:
    """One prompt's loop to the end of the target's tokens; appends each call; returns the tokens generated."""
    prompt, target = run["prompt_ids"], run["target_ids"]
    generated = 0
    with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as client:
        while generated < len(target):
            context = prompt + target[:generated]
            route, body = server.request(context, num_draft)
            started, refused = time.perf_counter(), 0
            r = client.post(route, json=body)
            while r.status_code == 503 and refused < MAX_REFUSALS:  # a server that cannot keep up: wait, resend
                refused += 1
                time.sleep(min(MAX_RETRY_WAIT_S, retry_after_seconds(r)) * random.uniform(1.0, 1.25))  # as HTTPDrafter
                r = client.post(route, json=body)
            seconds = time.perf_counter() - started  # the waits included: the loop waited them
            r.raise_for_status()
            reply = server.reply(r.json())
            accepted = accepted_length(reply.draft, target[generated:generated + num_draft])
            calls.append({"context": len(context), "seconds": seconds, "accepted": accepted,
                          "key": hash(tuple(context)), "draft": reply.draft, "stopped": reply.stopped,
                          "reused": reply.reused, "computed": reply.computed, "refused": refused})
            generated += accepted + 1
    return len(target)


def run_loops(server, runs: list[dict], loops: int, num_draft: int) -> tuple[list[dict[str, Any]], int, float, Any]:
    """``loops`` loops side by side through ``runs``; (calls, tokens generated, wall seconds, the RSS sampler)."""
    calls: list[dict[str, Any]] = []
    with RssSampler(server.pid, every=0.5) as rss, ThreadPoolExecutor(loops) as pool:
        started = time.perf_counter()
        tokens = sum(pool.map(lambda i: sum(speculate_run(server, run, num_draft, calls) for run in runs[i::loops]),
                              range(loops)))
        wall = time.perf_counter() - started
    return calls, tokens, wall, rss


def run_level(args, draft_dir: Path, runs: list[dict], warmup: dict, loops: int, setting: Setting, name: str,
              compute_args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """One fresh server, ``loops`` loops through ``runs``; its figures, and specdraft's compute arguments."""
    log_path = Path(args.work) / f"server-loop-{loops}-{name}.log"
    cache: dict[str, Any] = {}
    if setting.server == LLAMA:
        slot_context = max(len(s["prompt_ids"]) + len(s["target_ids"])
                           for r in [*runs, warmup] for s in segments(r)) + 2 * args.num_draft
        with LlamaLoopServer(args, args.gguf, loops, slot_context, log_path) as server:
            speculate_run(server, warmup, args.num_draft, [])
            calls, tokens, wall, rss = run_loops(server, runs, loops, args.num_draft)
        reused, computed = (sum(c[k] or 0 for c in calls) for k in ("reused", "computed"))
        server_info = {"build_info": server.props.get("build_info"), "argv": server.peer.argv}
    else:
        engine = ["--engine", "llama.cpp", "--gguf", str(args.gguf)] if setting.llama_engine else compute_args
        extra = ["--threads", str(args.threads), *engine, *setting.args, *shlex.split(args.serve_args)]
        with SpecdraftLoopServer(draft_dir, extra, setting.fields, log_path, args.start_timeout,
                                 setting.guide_min_ratio) as server:
            if not setting.llama_engine:
                compute_args = server.compute_args()
            speculate_run(server, warmup, args.num_draft, [])
            before = server.counters()
            server.start_sampling()
            calls, tokens, wall, rss = run_loops(server, runs, loops, args.num_draft)
            after = server.counters()
            budget = (server.health.get("prefix_cache") or {}).get("budget_bytes")
            cache = {"cache_budget_mb": (budget or 0) / 2**20, "cache_peak_mb": server.cache_peak / 2**20,
                     "cache_within_budget": budget is None or server.cache_peak <= budget}
        reused = after["specdraft_context_tokens_reused_total"] - before["specdraft_context_tokens_reused_total"]
        computed = after["specdraft_context_tokens_total"] - before["specdraft_context_tokens_total"]
        server_info = {"compute": ["llama.cpp"] if setting.llama_engine else compute_args[1:], "argv_extra": extra}
    seconds = [c["seconds"] for c in calls]
    figures = {"server": setting.server, "calls": len(calls), "generated_tokens": tokens, "wall_s": wall,
               "ms_per_token": 1000 * sum(seconds) / tokens, "tokens_per_s": tokens / wall,
               "p50_ms": 1000 * percentile(seconds, 50), "p99_ms": 1000 * percentile(seconds, 99),
               "mean_accepted": statistics.mean(c["accepted"] for c in calls),
               "mean_drafted": statistics.mean(len(c["draft"]) for c in calls),
               "stopped_calls": sum(c["stopped"] for c in calls) / len(calls),
               "refused_503": sum(c["refused"] for c in calls),
               "mean_context_tokens": statistics.mean(c["context"] for c in calls),
               "context_tokens_reused": reused, "context_tokens_computed": computed,
               "rss_mb_peak": rss.peak_mb, "rss_mb_end": rss.samples[-1][1] if rss.samples else None,
               **cache, **server_info, "drafts": {c["key"]: c["draft"] for c in calls}}
    if args.conversation:  # each turn's own share: the second turn's calls start from what the first left
        figures["by_turn"] = {
            turn: {"calls": len(mine), "generated_tokens": generated,
                   "ms_per_token": 1000 * sum(c["seconds"] for c in mine) / generated,
                   "p50_ms": 1000 * percentile([c["seconds"] for c in mine], 50),
                   "p99_ms": 1000 * percentile([c["seconds"] for c in mine], 99)}
            for turn in (1, 2) for mine in [[c for c in calls if c["turn"] == turn]]
            for generated in [sum(len(segments(r)[turn - 1]["target_ids"]) for r in runs)]}
    log.info("%d loop(s), %s: %.1f ms per generated token, p50 %.0f ms, p99 %.0f ms, %d calls, reused %d / "
             "computed %d context tokens, peak RSS %.0f MB", loops, name, figures["ms_per_token"],
             figures["p50_ms"], figures["p99_ms"], len(calls), reused, computed, rss.peak_mb or 0)
    return figures, compute_args


def identical(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict[str, Any]:
    both = set(a) & set(b)
    return {"contexts_both_sent": len(both), "identical_drafts": sum(a[k] == b[k] for k in both) / max(1, len(both))}


def prefixes(stopped: dict[int, list[int]], full: dict[int, list[int]]) -> dict[str, Any]:
    """On the contexts both sent, the share where the stopped draft is the full draft's prefix."""
    both = set(stopped) & set(full)
    return {"contexts_both_sent": len(both),
            "prefix_of_full": sum(full[k][:len(stopped[k])] == stopped[k] for k in both) / max(1, len(both))}


RATIO_KEYS = ("ms_per_token", "tokens_per_s", "p50_ms", "p99_ms")


def compare(level: dict[str, Any], drafts: dict[str, dict[int, list[int]]], base: str) -> None:
    """Each other setting against ``base`` into ``level``: its figures' ratios to the base's (``X_vs_base``: above 1
    it costs more) and how often its drafts agree with the base's (identical, or for a stopped draft a prefix)."""
    if base not in drafts:
        return
    for other in drafts:
        if other != base:
            # the llama.cpp engine's drafts against its own with reuse, where that ran (the same engine's bits)
            same_engine = "llama_engine" if other.startswith("llama_engine_") and "llama_engine" in drafts else base
            stops = other.startswith(("stop_", "llama_engine_stop_", "no_reuse_stop_"))
            level[f"{other}_agreement"] = {**(prefixes if stops else identical)(drafts[other], drafts[same_engine]),
                                           "against": same_engine}
            level[f"{other}_vs_{base}"] = {k: level[other][k] / level[base][k] for k in RATIO_KEYS}


# ---------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(__doc__)
    add_out_argument(p, default="runs/bench_server_loop/server_loop.json")
    p.add_argument("--draft-dir", help="packed draft dir (default: the stand-in)")
    p.add_argument("--draft-label", help="what --draft-dir is, for the report (default: its path)")
    p.add_argument("--target", default="embedded:smollm2-135m-instruct", help="target model spec")
    p.add_argument("--standin-layers", type=int, default=6, help="layers of the target kept by the stand-in")
    p.add_argument("--tiny", action="store_true", help="tiny random models instead (a quick run)")
    p.add_argument("--work", default="runs/bench_server", help="cache dir for the models and the target's tokens")
    p.add_argument("--prompts-file", default=str(MT_BENCH), help="MT-bench JSONL (question_id, category, turns)")
    p.add_argument("--turn", type=int, choices=(1, 2), default=1, help="1: first questions; 2: second questions "
                   "after the target's own first answers")
    p.add_argument("--first-answer-tokens", type=int, default=256,
                   help="--turn 2, --conversation: the first answer's most tokens")
    p.add_argument("--conversation", action="store_true", help="both turns of each question in one loop, the "
                   "first answer generated through the loop (--turn is then not used)")
    p.add_argument("--loops", type=int, nargs="+", default=[1, 4], help="loops side by side, per level")
    p.add_argument("--prompts-per-loop", type=int, default=2, help="prompts each loop works through")
    p.add_argument("--new-tokens", type=int, default=96, help="target tokens generated per prompt")
    p.add_argument("--num-draft", type=int, default=DRAFT_TOKENS, help="tokens drafted per call")
    p.add_argument("--compute", default="auto", help="the first server's --compute (the others get its choice)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="compute threads of every server (default: the CPUs - 1, at least 1)")
    p.add_argument("--serve-args", default="", help="more `specdraft serve` arguments for every specdraft setting")
    p.add_argument("--settings", nargs="+", default=None, help="run only these settings (default: all there are)")
    p.add_argument("--llama-server", type=Path, default=default_llama_server(),
                   help="llama-server binary (default: where bench/build_llama_cpp.sh leaves it; skipped if absent)")
    p.add_argument("--gguf", help="the draft as GGUF for llama-server (default: `specdraft export` of --draft-dir)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be healthy")
    p.add_argument("--name", default="server_loop", help="the result's name: bench/results/NAME.<cpu class>.json "
                                                         "(--tiny adds _tiny)")
    p.add_argument("--stop-confidence", type=float, nargs="+", default=None,
                   help="also drafts that stop at each of these thresholds (`stop_T`, the prefix cache on)")
    p.add_argument("--guide-ratio", type=float, nargs="+", default=None,
                   help="also requests guided by prompt lookup's copy at each of these ratios (`guided_R`, "
                        "`llama_engine_guided_R`, the prefix cache on)")
    return p.parse_args(argv)


def choose_settings(args) -> dict[str, Setting]:
    settings = {**REUSE_SETTINGS, **stop_settings(args.stop_confidence or []),
                **guided_settings(args.guide_ratio or [])}
    if not args.llama_server.is_file():
        log.info("no llama-server at %s (bench/build_llama_cpp.sh builds it): its setting is left out",
                 args.llama_server)
        settings.pop("llama_server", None)
    if args.settings:
        unknown = set(args.settings) - set(settings)
        if unknown:
            raise SystemExit(f"--settings: {sorted(unknown)} not among {sorted(settings)}")
        settings = {k: v for k, v in settings.items() if k in args.settings}
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_to_console()
    draft_dir, what, target = ensure_models(args)
    settings = choose_settings(args)
    if "llama_server" in settings or any(s.llama_engine for s in settings.values()):
        args.gguf = ensure_gguf(args, draft_dir)
    most = max(args.loops) * args.prompts_per_loop
    questions, source = load_questions(args, most + 1)
    runs = target_runs(args, target, questions)
    warmup, runs = runs[-1], runs[:most]
    compute_args = ["--compute", args.compute]
    levels = []
    for n, loops in enumerate(args.loops):
        names = list(settings)
        order = names[n % len(names):] + names[:n % len(names)]  # each level another setting goes first
        level: dict[str, Any] = {"loops": loops, "prompts": loops * args.prompts_per_loop, "first": order[0]}
        for name in order:
            level[name], compute_args = run_level(args, draft_dir, runs[:loops * args.prompts_per_loop], warmup,
                                                  loops, settings[name], name, compute_args)
        compare(level, {name: level[name].pop("drafts") for name in names}, "reuse")
        levels.append(level)
    sent = [s for r in runs for s in segments(r)]
    figures = {"draft": what, "draft_dir": str(draft_dir), "target": target, "prompts": source,
               "turn": "conversation" if args.conversation else args.turn,
               "first_answer_tokens": args.first_answer_tokens if args.conversation or args.turn == 2 else None,
               "new_tokens": args.new_tokens, "num_draft": args.num_draft, "prompts_per_loop": args.prompts_per_loop,
               "threads": args.threads, "serve_args": args.serve_args,
               "mean_prompt_tokens": statistics.mean(len(s["prompt_ids"]) for s in sent),
               "mean_target_tokens": statistics.mean(len(s["target_ids"]) for s in sent),
               "server_args": {k: [*v.args, *shlex.split(args.serve_args)] if v.server == SPECDRAFT else []
                               for k, v in settings.items()},
               "servers": {k: v.server for k, v in settings.items()},
               "request_fields": {k: v.fields for k, v in settings.items()}, "compute": compute_args[1:],
               "engines": {k: "llama.cpp" if v.llama_engine or v.server == LLAMA else "torch"
                           for k, v in settings.items()},
               "gguf": str(args.gguf) if args.gguf else None, "levels": levels}
    save_result(args.name + ("_tiny" if args.tiny else ""), figures, args.out)
    print_table(figures)
    return 0


def print_table(figures: dict[str, Any]) -> None:
    print(f"\n{figures['draft']}; prompts: {figures['prompts']}; compute {' '.join(figures['compute'])}")
    print(f"{'loops':>6} {'setting':>12} {'ms/token':>9} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'calls':>6} "
          f"{'accepted':>9} {'drafted':>8} {'stopped':>8} {'reused':>8} {'computed':>9} {'RSS MB':>7}")
    for level in figures["levels"]:
        for setting in figures["servers"]:
            f = level[setting]
            print(f"{level['loops']:>6} {setting:>12} {f['ms_per_token']:9.1f} {f['tokens_per_s']:9.2f} "
                  f"{f['p50_ms']:8.0f} {f['p99_ms']:8.0f} {f['calls']:6d} {f['mean_accepted']:9.2f} "
                  f"{f['mean_drafted']:8.2f} {f['stopped_calls']:8.2f} {f['context_tokens_reused']:8.0f} "
                  f"{f['context_tokens_computed']:9.0f} {f['rss_mb_peak'] or 0:7.0f}")
        for name, ratio in level.items():
            if "_vs_" in name:
                agreement = level[name.split("_vs_")[0] + "_agreement"]
                share = agreement.get("identical_drafts", agreement.get("prefix_of_full"))
                print(f"{'':>6} {name:>12} {ratio['ms_per_token']:9.2f} {ratio['tokens_per_s']:9.2f} "
                      f"{ratio['p50_ms']:8.2f} {ratio['p99_ms']:8.2f}   agreeing drafts {share:.3f} of "
                      f"{agreement['contexts_both_sent']} with {agreement.get('against', 'reuse')}'s")


if __name__ == "__main__":
    sys.exit(main())
