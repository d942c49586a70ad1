"""Throughput of `specdraft traces` (hf backend) against transformers' generate(), side by side.

Both decode the same templated prompts greedily in float32 in one process, one batch size after the other
(interleaved, so both see the same machine load). Ours: ``specdraft.decode.iter_greedy`` as the traces
stage runs it (longest prompts first, continuous batching over a static KV cache). generate(): the
prompts in file order, ``batch_size`` at a time, left-padded, ``do_sample=False``. The tokens are
compared row by row with the first run (generate pads after EOS, so rows are compared up to and
including the EOS). Wall time and process CPU time are both reported: on a shared machine, tokens per
CPU-second (with --threads 1) is the steadier figure.
Batch-1 latency per token is measured for both (EOS ignored, so every run has the same length). The result goes
to ``bench/results/traces.<cpu class>.json`` and to --out.

    .venv/bin/python bench/bench_traces.py      # the defaults (about 10 minutes, 1 thread)
    .venv/bin/python bench/bench_traces.py --num-prompts 200 --batch-sizes 16,32,64 --generate-batch-sizes 8,16,32 \
        --latency-tokens 64                    # the longer run with long prompts (~45 minutes)
    .venv/bin/python bench/bench_traces.py --num-prompts 24 --batch-sizes 16 --generate-batch-sizes 8 \
        --max-new-tokens 32

Prompts: ``--prompts prompts.jsonl`` (first N), else a seeded mix of the training files in
../shared/data/train (UltraChat, ShareGPT first turns, Code Alpaca, GSM8K, InstructionWild, GPTeacher
roleplay, Alpaca), at most --max-prompt-tokens tokens once templated. ``--write-prompts F`` saves that mix
as a prompts.jsonl (for `specdraft traces`) and exits.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from harness import RssSampler, add_out_argument, argument_parser, command, save_result, stopwatch

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRAIN = ROOT.parent / "shared" / "data" / "train"


# ---------------------------------------------------------------------------------------------- prompts

def _first_human(conv: list[dict]) -> str | None:
    for turn in conv:
        if turn.get("from") in ("human", "user"):
            return turn.get("value")
    return None


def _alpaca(rec: dict) -> str:
    inp = (rec.get("input") or "").strip()
    return rec["instruction"] + ("\n\n" + inp if inp else "")


# file -> (format, record -> prompt text)
SOURCES: dict[str, tuple[str, Callable[[dict], str | None]]] = {
    "ultrachat200k_sample100_prompts.jsonl": ("jsonl", lambda r: r.get("prompt")),
    "sharegpt_sample_1k.jsonl": ("jsonl", lambda r: _first_human(r.get("conversations", []))),
    "code_alpaca_2k.json": ("json", _alpaca),
    "gsm8k_train.jsonl": ("jsonl", lambda r: r.get("question")),
    "instructionwild_v2_user_1-3.jsonl": ("jsonl", lambda r: r.get("instruction")),
    "gpteacher_roleplay_instruct.json": ("json", _alpaca),
    "llamafactory_alpaca_en_demo.json": ("json", _alpaca),
}


def mixed_prompts(n: int, seed: int = 0, train_dir: Path = SHARED_TRAIN) -> list[dict[str, str]]:
    """n prompts ({id, source, prompt}), drawn round-robin from the shared training files (seeded)."""
    rng = random.Random(seed)
    pools: list[tuple[str, list[str]]] = []
    for name, (fmt, read) in SOURCES.items():
        path = train_dir / name
        if not path.is_file():
            continue
        with open(path, encoding="utf-8") as f:
            recs = [json.loads(line) for line in f if line.strip()] if fmt == "jsonl" else json.load(f)
        texts = [t for t in (read(r) for r in recs) if isinstance(t, str) and t.strip()]
        rng.shuffle(texts)
        pools.append((name.split(".")[0], texts))
    if not pools:
        raise SystemExit(f"no training files under {train_dir}; pass --prompts prompts.jsonl")
    out: list[dict[str, str]] = []
    cursor = 0
    while len(out) < n and any(pool for _, pool in pools):
        source, pool = pools[cursor % len(pools)]
        cursor += 1
        if pool:
            out.append({"id": f"{source}-{len(out)}", "source": source, "prompt": pool.pop()})
    return out


# ------------------------------------------------------------------------------------------- measuring

def cut_at_eos(tokens: Sequence[int], eos: set[int], limit: int) -> list[int]:
    out: list[int] = []
    for t in tokens[:limit]:
        out.append(int(t))
        if t in eos:
            break
    return out


def run_ours(model, prompts, max_new, batch_size, kv_cache="auto") -> dict[int, list[int]]:
    from specdraft.model.decode import iter_greedy
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # as the traces stage does
    return {i: g.tokens for i, g in iter_greedy(model, prompts, max_new, batch_size=batch_size, order=order,
                                                kv_cache=kv_cache)}


@torch.inference_mode()
def run_generate(model, prompts, max_new, batch_size, pad_id, eos, sort=False) -> dict[int, list[int]]:
    rows: dict[int, list[int]] = {}
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i])) if sort else list(range(len(prompts)))
    for s in range(0, len(prompts), batch_size):
        idx = order[s:s + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad_id)
        for r, i in enumerate(idx):
            rows[i] = cut_at_eos(out[r, width:].tolist(), eos, max_new)
    return rows


def compare(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict[str, Any]:
    diffs = []
    for i in sorted(a):
        if a[i] != b[i]:
            first = next((k for k, (x, y) in enumerate(zip(a[i], b[i])) if x != y), min(len(a[i]), len(b[i])))
            diffs.append({"row": i, "first_difference_at": first})
    return {"rows": len(a), "identical_rows": len(a) - len(diffs), "differences": diffs[:20]}


@torch.inference_mode()
def batch1_latency(model, prompt, tokens, pad_id) -> dict[str, Any]:
    """ms per decoded token at batch 1 (prefill excluded), EOS ignored; ours static, ours dynamic, generate."""
    from specdraft.model.decode import greedy_decode

    def ours(kv, n):
        return lambda: greedy_decode(model, [prompt], n, stop_at_eos=False, kv_cache=kv)

    def gen(n):
        ids = torch.tensor([prompt])
        return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=pad_id)

    result = {}
    for name, make in [("specdraft (static cache)", lambda n: ours("static", n)),
                       ("specdraft (DynamicCache)", lambda n: ours("dynamic", n)),
                       ("generate()", gen)]:
        make(4)()  # warm
        with stopwatch() as prefill:
            make(1)()
        with stopwatch() as total:
            make(tokens)()
        per_token = (total.wall - prefill.wall) / (tokens - 1)
        per_token_cpu = (total.cpu - prefill.cpu) / (tokens - 1)
        result[name] = {"prompt_tokens": len(prompt), "new_tokens": tokens, "prefill_ms": round(prefill.wall * 1e3, 1),
                        "ms_per_token": round(per_token * 1e3, 2), "tokens_per_s": round(1 / per_token, 2),
                        "cpu_ms_per_token": round(per_token_cpu * 1e3, 2)}
    return result


# -------------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--target", default=None, help="model spec (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=Path, default=None, help="prompts.jsonl to take the first N prompts from")
    p.add_argument("--num-prompts", type=int, default=80)
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="mix only: skip longer templated prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="64,128", help="ours: comma-separated batch sizes (a batch larger "
                                                        "than the prompt count decodes them all at once)")
    p.add_argument("--generate-batch-sizes", default="16,32,64", help="generate(): comma-separated batch sizes")
    p.add_argument("--latency-tokens", type=int, default=32, help="batch-1 latency run length (0: skip)")
    p.add_argument("--ablation", action="store_true",
                   help="also run our engine with DynamicCache (length-sorted static batches, no refill)")
    p.add_argument("--generate-sorted", action="store_true",
                   help="also run generate() on length-sorted batches (a stronger baseline than file order)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default). 1 by default, for figures that hold on a shared "
                        "machine: on the idle 2-vCPU box 2 threads were ~1.5x faster at batch 16, but 2-4x "
                        "slower while other processes competed for the cores")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "bench_traces.json")
    p.add_argument("--write-prompts", type=Path, default=None, help="write the prompt mix as prompts.jsonl, exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"command: {command()}", flush=True)
    from specdraft.core.records import read_prompts
    from specdraft.model.chat import encode_prompts
    from specdraft.model.forward import eos_token_ids, pad_token_id
    from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_model, load_tokenizer

    target = args.target or DEFAULT_TARGET
    tok = load_tokenizer(target)
    if args.prompts:
        records = [{"id": r.id, "source": r.source, "prompt": r.text} for r in read_prompts(args.prompts)]
    else:
        records = mixed_prompts(args.num_prompts * 2, args.seed)
    ids_all = encode_prompts(tok, [r["prompt"] for r in records])
    keep = [k for k, ids in enumerate(ids_all) if args.prompts or len(ids) <= args.max_prompt_tokens]
    keep = keep[:args.num_prompts]
    records, prompts = [records[k] for k in keep], [ids_all[k] for k in keep]
    if args.write_prompts:
        args.write_prompts.parent.mkdir(parents=True, exist_ok=True)
        with open(args.write_prompts, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=True) + "\n")
        print(f"wrote {len(records)} prompts to {args.write_prompts}")
        return 0
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model = load_model(target)
    eos, pad = eos_token_ids(model), pad_token_id(model)
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} prompts, prompt tokens: min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
          f"max {lengths[-1]}, total {sum(lengths)}; max_new_tokens {args.max_new_tokens}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    run_ours(model, prompts[:4], 4, 4)  # warm both paths
    run_generate(model, prompts[:2], 4, 2, pad, eos)
    runs: list[dict[str, Any]] = []
    ours_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    gen_sizes = [int(b) for b in args.generate_batch_sizes.split(",") if b]
    plan: list[tuple[str, int, Callable[[], dict[int, list[int]]]]] = []
    for b in sorted(set(ours_sizes) | set(gen_sizes)):  # interleaved: both see the same machine load
        if b in ours_sizes:
            plan.append(("specdraft", b, lambda b=b: run_ours(model, prompts, args.max_new_tokens, b)))
            if args.ablation:
                plan.append(("specdraft-dynamic", b,
                             lambda b=b: run_ours(model, prompts, args.max_new_tokens, b, kv_cache="dynamic")))
        if b in gen_sizes:
            plan.append(("generate", b, lambda b=b: run_generate(model, prompts, args.max_new_tokens, b, pad, eos)))
            if args.generate_sorted:
                plan.append(("generate-sorted", b, lambda b=b: run_generate(model, prompts, args.max_new_tokens, b,
                                                                            pad, eos, sort=True)))
    reference: dict[int, list[int]] | None = None
    for name, b, fn in plan:
        with RssSampler(every=0.01) as mem, stopwatch() as lap:
            rows = fn()
        secs, cpu = lap.wall, lap.cpu
        ntok = sum(len(r) for r in rows.values())
        growth_mb = round(mem.peak_mb - mem.samples[0][1], 1)
        run = {"method": name, "batch_size": b, "seconds": round(secs, 2), "cpu_seconds": round(cpu, 2),
               "new_tokens": ntok, "tokens_per_s": round(ntok / secs, 2), "tokens_per_cpu_s": round(ntok / cpu, 2),
               "rss_growth_mb": growth_mb, "eos_rows": sum(1 for r in rows.values() if r and r[-1] in eos)}
        if reference is None:
            reference = rows
        else:
            run["vs_first"] = compare(reference, rows)
        runs.append(run)
        same = run.get("vs_first")
        print(f"  {name:18s} batch {b:3d}: {ntok} tokens in {secs:7.1f} s = {ntok / secs:6.1f} tok/s, "
              f"{cpu:7.1f} CPU s = {ntok / cpu:6.1f} tok/CPU-s (RSS +{growth_mb} MiB)"
              + (f", rows identical to the first run {same['identical_rows']}/{same['rows']}" if same else ""),
              flush=True)

    def best(method, key):
        cand = [r for r in runs if r["method"] == method]
        return max(cand, key=lambda r: r[key]) if cand else None

    ours_best, gen_best = best("specdraft", "tokens_per_s"), best("generate", "tokens_per_s")
    speedup = round(ours_best["tokens_per_s"] / gen_best["tokens_per_s"], 2)
    ours_cpu, gen_cpu = best("specdraft", "tokens_per_cpu_s"), best("generate", "tokens_per_cpu_s")
    speedup_cpu = round(ours_cpu["tokens_per_cpu_s"] / gen_cpu["tokens_per_cpu_s"], 2)
    sorted_best = best("generate-sorted", "tokens_per_cpu_s")
    speedup_sorted = (round(ours_cpu["tokens_per_cpu_s"] / sorted_best["tokens_per_cpu_s"], 2)
                      if sorted_best else None)
    latency = {}
    if args.latency_tokens > 1:
        latency = batch1_latency(model, prompts[len(prompts) // 2], args.latency_tokens, pad)

    print("\n| method | batch | new tokens | wall s | tokens/s | CPU s | tokens/CPU-s | RSS growth MiB "
          "| rows identical to the first run |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        same = r.get("vs_first")
        same_text = f"{same['identical_rows']}/{same['rows']}" if same else "(reference)"
        print(f"| {r['method']} | {r['batch_size']} | {r['new_tokens']} | {r['seconds']} | {r['tokens_per_s']} | "
              f"{r['cpu_seconds']} | {r['tokens_per_cpu_s']} | {r['rss_growth_mb']} | {same_text} |")
    print(f"\nbest by wall time: specdraft {ours_best['tokens_per_s']} tok/s (batch {ours_best['batch_size']}) vs "
          f"generate() {gen_best['tokens_per_s']} tok/s (batch {gen_best['batch_size']}): {speedup}x")
    print(f"best by CPU time:  specdraft {ours_cpu['tokens_per_cpu_s']} tok/CPU-s (batch {ours_cpu['batch_size']}) "
          f"vs generate() {gen_cpu['tokens_per_cpu_s']} tok/CPU-s (batch {gen_cpu['batch_size']}): {speedup_cpu}x")
    if sorted_best:
        print(f"best by CPU time vs generate() on length-sorted batches: {sorted_best['tokens_per_cpu_s']} "
              f"tok/CPU-s (batch {sorted_best['batch_size']}): {speedup_sorted}x")
    if latency:
        print("\n| batch-1 decoding | prefill ms | ms/token | tokens/s | CPU ms/token |\n|---|---:|---:|---:|---:|")
        for name, r in latency.items():
            print(f"| {name} | {r['prefill_ms']} | {r['ms_per_token']} | {r['tokens_per_s']} | "
                  f"{r['cpu_ms_per_token']} |")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the process (ru_maxrss): {peak:.0f} MiB")
    report = {"target": describe_source(target), "num_prompts": len(prompts),
              "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1],
                                "total": sum(lengths)},
              "sources": sorted({r["source"] for r in records}), "max_new_tokens": args.max_new_tokens,
              "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "runs": runs,
              "best": {"specdraft": ours_best, "generate": gen_best, "speedup": speedup,
                       "by_cpu_time": {"specdraft": ours_cpu, "generate": gen_cpu, "speedup": speedup_cpu},
                       "vs_generate_sorted_by_cpu_time": {"generate-sorted": sorted_best, "speedup": speedup_sorted}},
              "batch1_latency": latency, "peak_rss_mb": round(peak, 1)}
    save_result("traces", report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
