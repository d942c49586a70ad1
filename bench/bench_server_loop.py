"""The draft server in a speculation loop, with and without reusing what it computed (its prefix cache), or with
and without ending drafts early by their own confidence (--stop-confidence).

  .venv/bin/python bench/bench_server_loop.py                      # the stand-in draft, SmolLM2-135M-Instruct target
  .venv/bin/python bench/bench_server_loop.py --tiny --new-tokens 48   # tiny random models: a quick check
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/demo/model --name server_loop_demo
  .venv/bin/python bench/bench_server_loop.py --draft-dir runs/bench_server/target-packed --stop-confidence 0.4 \
      --name server_loop_stop                                       # drafts that stop, against full drafts

The loop as a speculative decoder runs it: each call sends `POST /draft` the prompt and every token generated so
far; the matching prefix of the 16 drafted tokens is accepted, plus the target's next token, and the next call sends
the longer context. The target is greedy-decoded ahead of time (--new-tokens per prompt, stopping at its EOS), so
the replay costs the server's time only, and both settings see the target's exact tokens.

Prompts: the first turns of --prompts-file (default ../shared/data/dev/mt_bench.jsonl, a public set nobody here
trains on), else the package's held-out prompts, in the target's chat template. The draft: --draft-dir, or the
stand-in bench_server.py builds (the target's first --standin-layers layers, packed QD04); with --tiny, a tiny
random Qwen3 as the target and itself packed as the draft.

For each --loops count C (default 1 and 4: C loops side by side, each working through --prompts-per-loop prompts
of its own) and each setting -- reuse (the server's default prefix cache) and no reuse (`--prefix-cache-mb 0`,
every context prefilled whole) -- a fresh `specdraft serve`, a warm-up on a prompt the levels do not use, then the
loops. The settings take turns going first from one level to the next. The compute format: the first server's
`--compute auto` choice, given explicitly to every other server (one measurement at load per run).

With --stop-confidence T [T ...] the settings are instead, reuse on in each: `full` (requests as today, every draft
--num-draft tokens) and `stop_T` for each T (every request carries `"stop_confidence": T`, so a draft ends after its
first token whose confidence is below T, and the server spends no decode steps on the rest). Each stopped setting
reports its ratios to `full`, the tokens drafted per call and the share of calls stopped early, and the share of the
contexts both sent where its draft is the full draft's prefix (bit for bit, as the server promises).

Per level and setting: server time per generated token (the calls' latencies summed over the tokens the loops
generated: what a loop waits per token) and generated tokens per second (over the level's wall time), p50 / p99 of a
call, calls and mean accepted length, context tokens reused and computed (the server's /metrics), the server's peak
RSS; the reuse / no-reuse ratios; and the share of identical drafts on the contexts both settings sent (with reuse
the server prefills in blocks, without it whole: the last bits of the logits may differ, and a near-tie flip).

Writes ``bench/results/NAME.<cpu class>.json`` (--name, default server_loop) and --out.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench_server import build_standin
from harness import RssSampler, add_out_argument, argument_parser, log_to_console, percentile, save_result
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.data.corpus import heldout_path
from specdraft.drafting.metrics import accepted_length
from specdraft.server.process import ServerProcess

log = logging.getLogger("specdraft.bench")

REPO = Path(__file__).resolve().parents[1]
MT_BENCH = REPO.parent / "shared" / "data" / "dev" / "mt_bench.jsonl"
# setting -> (the server's extra arguments, fields added to every request)
REUSE_SETTINGS = {"reuse": ([], {}), "no_reuse": (["--prefix-cache-mb", "0"], {})}


def stop_settings(thresholds: list[float]) -> dict[str, tuple[list[str], dict[str, Any]]]:
    """Full drafts and, for each threshold, drafts that stop: all with the server's default prefix cache."""
    return {"full": ([], {}), **{f"stop_{t:g}": ([], {"stop_confidence": t}) for t in thresholds}}


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
        return Path(args.draft_dir), f"draft {args.draft_dir}", args.target
    else:
        float_dir = build_standin(args.standin_layers, work / f"standin-L{args.standin_layers}", args.target)
        what = f"stand-in: first {args.standin_layers} layers of {args.target}, packed QD04"
    packed = float_dir.with_name(float_dir.name + "-packed")
    if not (packed / "draft.qd4").is_file():
        if cli(["pack", "--checkpoint", str(float_dir), "--out", str(packed), "--overwrite"]):
            raise SystemExit("pack failed")
    return packed, what, str(target) if args.tiny else args.target


def load_prompts(args, count: int) -> tuple[list[str], str]:
    path = Path(args.prompts_file)
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r["turns"][0] for r in rows][:count], f"{path.name} (first turns)"
    rows = [json.loads(line) for line in heldout_path().read_text().splitlines() if line.strip()]
    return [r["prompt"] for r in rows][:count], "the package's held-out prompts"


def target_runs(args, target: str, texts: list[str]) -> list[dict[str, list[int]]]:
    """[{prompt_ids, target_ids}]: each prompt in the chat template and the target's greedy continuation (cached)."""
    import torch

    from specdraft.model.decode import greedy_decode
    from specdraft.model.specs import load_model, load_tokenizer

    key = f"{target}|{args.new_tokens}|{json.dumps(texts)}"
    cache = Path(args.work) / "loop_targets.json"
    stored = json.loads(cache.read_text()) if cache.is_file() else {}
    if key in stored:
        return stored[key]
    tok = load_tokenizer(target)
    model = load_model(target, torch.float32)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for t in texts]
    log.info("greedy-decoding %d prompts x %d tokens with the target", len(prompts), args.new_tokens)
    gens = greedy_decode(model, prompts, args.new_tokens, batch_size=8)
    stored[key] = [{"prompt_ids": p, "target_ids": g.tokens} for p, g in zip(prompts, gens)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(stored))
    return stored[key]


# ---------------------------------------------------------------------------------------------- the loop

def speculate(url: str, run: dict[str, list[int]], num_draft: int, calls: list[dict[str, Any]],
              fields: dict[str, Any] | None = None) -> int:
    """One prompt's loop to the end of the target's tokens (``fields`` added to every request); appends each call;
    returns the tokens generated."""
    prompt, target = run["prompt_ids"], run["target_ids"]
    generated = 0
    with httpx.Client(base_url=url, timeout=120, trust_env=False) as client:
        while generated < len(target):
            context = prompt + target[:generated]
            started = time.perf_counter()
            r = client.post("/draft", json={"token_ids": context, "num_tokens": num_draft, **(fields or {})})
            seconds = time.perf_counter() - started
            r.raise_for_status()
            answer = r.json()
            draft = answer["draft_ids"]
            accepted = accepted_length(draft, target[generated:generated + num_draft])
            calls.append({"context": len(context), "seconds": seconds, "accepted": accepted,
                          "key": hash(tuple(context)), "draft": draft,
                          "stopped": answer.get("stop_reason") == "confidence"})
            generated += accepted + 1
    return len(target)


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def run_level(args, draft_dir: Path, runs: list[dict], warmup: dict, loops: int, setting: str,
              settings: dict[str, tuple[list[str], dict[str, Any]]],
              compute_args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """One fresh server, ``loops`` loops through ``runs``; its figures, and the compute arguments it ran with."""
    log_path = Path(args.work) / f"server-loop-{loops}-{setting}.log"
    server_args, fields = settings[setting]
    extra = ["--threads", str(args.threads), *compute_args, *server_args] if args.threads else \
        [*compute_args, *server_args]
    with ServerProcess(draft_dir, log_path, extra) as server:
        ok, what = server.wait_ready(args.start_timeout)
        if not ok:
            raise SystemExit(f"server did not start: {what}")
        url = server.url
        choice = httpx.get(url + "/health", trust_env=False).json()["compute_choice"]
        compute_args = ["--compute", choice["compute"], "--int4-prefill", choice["prefill"]] \
            if choice["compute"] == "int4" else ["--compute", choice["compute"]]
        speculate(url, warmup, args.num_draft, [], fields)
        before = counters(url)
        calls: list[dict[str, Any]] = []
        with RssSampler(server.proc.pid, every=0.5) as rss, ThreadPoolExecutor(loops) as pool:
            started = time.perf_counter()
            tokens = sum(pool.map(lambda i: sum(speculate(url, run, args.num_draft, calls, fields)
                                                for run in runs[i::loops]), range(loops)))
            wall = time.perf_counter() - started
        after = counters(url)
    seconds = [c["seconds"] for c in calls]
    reused = after["specdraft_context_tokens_reused_total"] - before["specdraft_context_tokens_reused_total"]
    computed = after["specdraft_context_tokens_total"] - before["specdraft_context_tokens_total"]
    figures = {"calls": len(calls), "generated_tokens": tokens, "wall_s": wall,
               "ms_per_token": 1000 * sum(seconds) / tokens, "tokens_per_s": tokens / wall,
               "p50_ms": 1000 * percentile(seconds, 50), "p99_ms": 1000 * percentile(seconds, 99),
               "mean_accepted": statistics.mean(c["accepted"] for c in calls),
               "mean_drafted": statistics.mean(len(c["draft"]) for c in calls),
               "stopped_calls": sum(c["stopped"] for c in calls) / len(calls),
               "mean_context_tokens": statistics.mean(c["context"] for c in calls),
               "context_tokens_reused": reused, "context_tokens_computed": computed,
               "rss_mb_peak": rss.peak_mb, "rss_mb_end": rss.samples[-1][1] if rss.samples else None,
               "compute": compute_args[1:], "drafts": {c["key"]: c["draft"] for c in calls}}
    log.info("%d loop(s), %s: %.1f ms per generated token, p50 %.0f ms, p99 %.0f ms, %d calls, reused %d / "
             "computed %d context tokens, peak RSS %.0f MB", loops, setting, figures["ms_per_token"],
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


# ---------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argument_parser(__doc__)
    add_out_argument(p, default="runs/bench_server_loop/server_loop.json")
    p.add_argument("--draft-dir", help="packed draft dir (default: the stand-in)")
    p.add_argument("--target", default="embedded:smollm2-135m-instruct", help="target model spec")
    p.add_argument("--standin-layers", type=int, default=6, help="layers of the target kept by the stand-in")
    p.add_argument("--tiny", action="store_true", help="tiny random models instead (a quick run)")
    p.add_argument("--work", default="runs/bench_server", help="cache dir for the models and the target's tokens")
    p.add_argument("--prompts-file", default=str(MT_BENCH), help="MT-bench-style JSONL (turns[0] is the prompt)")
    p.add_argument("--loops", type=int, nargs="+", default=[1, 4], help="loops side by side, per level")
    p.add_argument("--prompts-per-loop", type=int, default=2, help="prompts each loop works through")
    p.add_argument("--new-tokens", type=int, default=96, help="target tokens generated per prompt")
    p.add_argument("--num-draft", type=int, default=DRAFT_TOKENS, help="tokens drafted per call")
    p.add_argument("--compute", default="auto", help="the first server's --compute (the others get its choice)")
    p.add_argument("--threads", type=int, default=None, help="the server's --threads (default: its own)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be healthy")
    p.add_argument("--name", default="server_loop", help="the result's name: bench/results/NAME.<cpu class>.json "
                                                         "(--tiny adds _tiny)")
    p.add_argument("--stop-confidence", type=float, nargs="+", default=None,
                   help="compare full drafts with drafts that stop at each of these thresholds (reuse on in all) "
                        "instead of reuse with no reuse")
    args = p.parse_args(argv)
    log_to_console()

    draft_dir, what, target = ensure_models(args)
    most = max(args.loops) * args.prompts_per_loop
    texts, source = load_prompts(args, most + 1)
    runs = target_runs(args, target, texts)
    warmup, runs = runs[-1], runs[:most]
    settings = REUSE_SETTINGS if args.stop_confidence is None else stop_settings(args.stop_confidence)
    compute_args = ["--compute", args.compute]
    levels = []
    for n, loops in enumerate(args.loops):
        names = list(settings)
        order = names[n % len(names):] + names[:n % len(names)]  # each level another setting goes first
        level: dict[str, Any] = {"loops": loops, "prompts": loops * args.prompts_per_loop, "first": order[0]}
        for setting in order:
            level[setting], compute_args = run_level(args, draft_dir, runs[:loops * args.prompts_per_loop], warmup,
                                                     loops, setting, settings, compute_args)
        drafts = {setting: level[setting].pop("drafts") for setting in settings}
        if args.stop_confidence is None:
            level["agreement"] = identical(drafts["reuse"], drafts["no_reuse"])
            level["reuse_vs_no_reuse"] = {k: level["reuse"][k] / level["no_reuse"][k] for k in RATIO_KEYS}
        else:
            for setting in names[1:]:
                level[f"{setting}_agreement"] = prefixes(drafts[setting], drafts["full"])
                level[f"{setting}_vs_full"] = {k: level[setting][k] / level["full"][k] for k in RATIO_KEYS}
        levels.append(level)
    figures = {"draft": what, "draft_dir": str(draft_dir), "target": target, "prompts": source,
               "new_tokens": args.new_tokens, "num_draft": args.num_draft, "prompts_per_loop": args.prompts_per_loop,
               "mean_prompt_tokens": statistics.mean(len(r["prompt_ids"]) for r in runs),
               "mean_target_tokens": statistics.mean(len(r["target_ids"]) for r in runs),
               "server_args": {k: v[0] for k, v in settings.items()},
               "request_fields": {k: v[1] for k, v in settings.items()}, "compute": compute_args[1:],
               "levels": levels}
    save_result(args.name + ("_tiny" if args.tiny else ""), figures, args.out)
    print_table(figures)
    return 0


def print_table(figures: dict[str, Any]) -> None:
    print(f"\n{figures['draft']}; prompts: {figures['prompts']}; compute {' '.join(figures['compute'])}")
    print(f"{'loops':>6} {'setting':>10} {'ms/token':>9} {'tokens/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'calls':>6} "
          f"{'accepted':>9} {'drafted':>8} {'stopped':>8} {'reused':>8} {'computed':>9} {'RSS MB':>7}")
    for level in figures["levels"]:
        for setting in figures["server_args"]:
            f = level[setting]
            print(f"{level['loops']:>6} {setting:>10} {f['ms_per_token']:9.1f} {f['tokens_per_s']:9.2f} "
                  f"{f['p50_ms']:8.0f} {f['p99_ms']:8.0f} {f['calls']:6d} {f['mean_accepted']:9.2f} "
                  f"{f['mean_drafted']:8.2f} {f['stopped_calls']:8.2f} {f['context_tokens_reused']:8.0f} "
                  f"{f['context_tokens_computed']:9.0f} {f['rss_mb_peak'] or 0:7.0f}")
        for name, ratio in level.items():
            if name.endswith(("_vs_no_reuse", "_vs_full")):
                agreement = level.get("agreement") or level[name.replace("_vs_full", "_agreement")]
                share = agreement.get("identical_drafts", agreement.get("prefix_of_full"))
                print(f"{'':>6} {name:>10} {ratio['ms_per_token']:9.2f} {ratio['tokens_per_s']:9.2f} "
                      f"{ratio['p50_ms']:8.2f} {ratio['p99_ms']:8.2f}   agreeing drafts {share:.3f} of "
                      f"{agreement['contexts_both_sent']}")


if __name__ == "__main__":
    sys.exit(main())
