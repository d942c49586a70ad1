"""`specdraft traces` backends side by side: hf (specdraft's decode loop, the float32 model transformers dequantises
from the embedded target's GGUF file) against llama.cpp (that GGUF file as llama.cpp computes it, several sequences
per ``llama_decode``), on the same prompts, and how often their greedy tokens agree.

    .venv/bin/python bench/bench_trace_backends.py               # the defaults: 1 thread (about 10 minutes)
    .venv/bin/python bench/bench_trace_backends.py --threads 1,2 # and a 2-thread block (idle cores only)
    .venv/bin/python bench/bench_trace_backends.py --threads 1 --repeats 3 --sequences 4,16,64
    .venv/bin/python bench/bench_trace_backends.py --converted ''      # the GGUF file as it is only

Prompts: the first --num-prompts of a seeded shuffle of the packaged corpus's training prompts, chat-templated as
the traces stage does. Every configuration (hf at --hf-batch-size, the traces stage's default; llama.cpp at each of
--sequences) decodes all of them greedily to --max-new-tokens, the same engine threads for both (torch threads for
hf, llama.cpp threads), --repeats times, the configurations interleaved so that each sees the same machine load;
the model loads are outside the clocks. What limits llama.cpp here, measured: the file's own weights converted
to float32 (as transformers dequantises them for hf), rounded to bfloat16, and requantised to Q8_0 and Q4_0
(--converted, by llama-cpp-python's ``llama_model_quantize``, into --work), each decoded at the largest of
--sequences: types llama.cpp has batched matrix kernels for on x86, which the file's Q4_1 lacks; each also against
the file's own tokens (``vs_file``). Past one thread, hf also runs as ``traces --shard i/n``
would on those cores: as many one-thread processes at once, each on its share of the prompts. Reported per
configuration: completion tokens per CPU-second (process CPU time, every thread's) and per wall second, the median
of the repeats. Agreement: each llama.cpp run's tokens against the hf run's, prompt by prompt (identical rows, the
first position where they part, the share of hf's tokens before it); every llama.cpp run against the first on the
same weights (one engine, any sequence count: identical); hf in processes against hf. The result goes to
``bench/results/trace_backends.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

from harness import Lap, add_out_argument, argument_parser, command, median, percentile, save_result, stopwatch
from specdraft.core.io import sha256_file
from specdraft.data.corpus import corpus_dir
from specdraft.model.chat import encode_prompts
from specdraft.model.specs import DEFAULT_TARGET, describe_source, load_tokenizer
from specdraft.model.trace_backend import HFBackend, TraceBackend
from specdraft.model.trace_llamacpp import LlamaCppBackend, target_gguf
from specdraft.stages.traces import TracesConfig


def corpus_prompts(n: int, seed: int) -> list[str]:
    texts = [json.loads(line)["prompt"] for path in sorted((corpus_dir() / "train").glob("*.jsonl"))
             for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def decode(make: Callable[[], TraceBackend], prompts: list[list[int]], max_new: int) -> tuple[dict, Any]:
    """Every prompt's tokens through a fresh backend (built and closed outside the clocks), and the lap."""
    with make() as backend:
        with stopwatch() as lap:
            rows = {i: g.tokens for i, g in backend.generate(prompts, max_new)}
    return rows, lap


def _shard_worker(conn, prompts: list[list[int]], max_new: int, batch_size: int) -> None:
    """One hf process at one thread: loads and warms, says so, decodes its prompts when told; sends back its rows
    and the CPU seconds the decode took."""
    with HFBackend(DEFAULT_TARGET, "cpu", batch_size, threads=1) as backend:
        list(backend.generate(prompts[:2], 4))
        conn.send("ready")
        conn.recv()
        cpu = time.process_time()
        rows = {i: g.tokens for i, g in backend.generate(prompts, max_new)}
        conn.send((rows, time.process_time() - cpu))


def decode_sharded(processes: int, batch_size: int, prompts: list[list[int]], max_new: int) -> tuple[dict, Lap]:
    """hf as ``traces --shard i/n`` runs it: ``processes`` one-thread processes at once, process i decoding prompts
    i, i + n, ...; the loads outside the clock, CPU time the processes' own over the decode."""
    spawn = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    for i in range(processes):
        parent, child = spawn.Pipe()
        workers.append(spawn.Process(target=_shard_worker, args=(child, prompts[i::processes], max_new, batch_size)))
        workers[-1].start()
        pipes.append(parent)
    for pipe in pipes:
        if pipe.recv() != "ready":
            raise RuntimeError("a shard process did not start")
    start = time.perf_counter()
    for pipe in pipes:
        pipe.send("go")
    results = [pipe.recv() for pipe in pipes]
    lap = Lap(wall=time.perf_counter() - start, cpu=sum(cpu for _, cpu in results))
    for worker in workers:
        worker.join()
    rows = {i + processes * k: tokens for i, (shard, _) in enumerate(results) for k, tokens in shard.items()}
    return rows, lap


CONVERSIONS = {"float32": "LLAMA_FTYPE_ALL_F32", "bfloat16": "LLAMA_FTYPE_MOSTLY_BF16",
               "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def converted_gguf(gguf: Path, dtype: str, work: Path) -> Path:
    """``gguf``'s weights as ``dtype`` (every tensor dequantised, then stored as ``dtype``), written once into
    ``work`` by llama.cpp's own quantiser and reused while the source's sha256 is the same."""
    import llama_cpp

    out = work / f"{gguf.stem}.{sha256_file(gguf)[:12]}.{dtype}.gguf"
    if not out.is_file():
        work.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, CONVERSIONS[dtype])
        params.allow_requantize = True
        part = out.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(part).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize: cannot convert {gguf} to {dtype}")
        part.rename(out)
    return out


def agreement(reference: dict[int, list[int]], rows: dict[int, list[int]]) -> dict[str, Any]:
    """Prompt by prompt: identical rows, where the tokens first part, and the share of the reference's tokens
    before that."""
    first = [next((k for k, (a, b) in enumerate(zip(reference[i], rows[i])) if a != b),
                  min(len(reference[i]), len(rows[i]))) for i in sorted(reference)]
    identical = sum(reference[i] == rows[i] for i in reference)
    return {"prompts": len(reference), "identical_prompts": identical,
            "identical_share": round(identical / len(reference), 3),
            "tokens_before_first_difference_share": round(sum(first) / sum(map(len, reference.values())), 3),
            "first_difference": {"min": min(first), "p25": percentile(first, 25), "median": percentile(first, 50),
                                 "p75": percentile(first, 75),
                                 "first_token_differs": sum(1 for k in first if k == 0)}}


def summarise(name: str, setting: dict[str, Any], laps: list, rows: dict[int, list[int]]) -> dict[str, Any]:
    tokens = sum(map(len, rows.values()))
    return {"backend": name, **setting, "new_tokens": tokens, "wall_s": [round(lap.wall, 2) for lap in laps],
            "cpu_s": [round(lap.cpu, 2) for lap in laps],
            "tokens_per_cpu_s": round(tokens / median([lap.cpu for lap in laps]), 2),
            "tokens_per_s": round(tokens / median([lap.wall for lap in laps]), 2)}


def at_threads(threads: int, args, prompts: list[list[int]], gguf, converted: dict[str, Path]) -> dict[str, Any]:
    """Every configuration at ``threads`` engine threads (and, past one thread, hf in as many one-thread
    processes), the repeats interleaved."""
    Run = Callable[[list[list[int]], int], tuple[dict, Any]]

    def backend(make: Callable[[], TraceBackend]) -> Run:
        return lambda p, n: decode(make, p, n)

    plan: list[tuple[str, dict[str, Any], Run]] = [
        ("hf", {"batch_size": args.hf_batch_size},
         backend(lambda: HFBackend(DEFAULT_TARGET, "cpu", args.hf_batch_size, threads=threads)))]
    plan += [("llama.cpp", {"sequences": s}, backend(lambda s=s: LlamaCppBackend(gguf, sequences=s, threads=threads)))
             for s in args.sequences]
    most = max(args.sequences)
    plan += [("llama.cpp", {"sequences": most, "weights": dtype},
              backend(lambda path=path: LlamaCppBackend(path, sequences=most, threads=threads)))
             for dtype, path in converted.items()]
    if threads > 1:
        plan.append(("hf", {"batch_size": args.hf_batch_size, "processes": threads},
                     lambda p, n: decode_sharded(threads, args.hf_batch_size, p, n)))
    for _, setting, run in plan:  # warm each engine (allocations, thread pools) before any clock
        if "processes" not in setting:  # its processes warm themselves
            run(prompts[:2], 4)
    laps: list[list] = [[] for _ in plan]
    rows: list[dict] = [{} for _ in plan]
    for repeat in range(args.repeats):
        for k, (name, setting, run) in enumerate(plan):
            got, lap = run(prompts, args.max_new_tokens)
            if repeat and got != rows[k]:
                raise RuntimeError(f"{name} {setting}: repeat {repeat} decoded other tokens than the first")
            rows[k] = got
            laps[k].append(lap)
            print(f"  threads {threads}, {name} {setting}, repeat {repeat}: {sum(map(len, got.values()))} tokens "
                  f"in {lap.wall:.1f} s wall, {lap.cpu:.1f} CPU s", flush=True)
    runs = [summarise(name, setting, laps[k], rows[k]) for k, (name, setting, _) in enumerate(plan)]
    file_run = next(j for j, r in enumerate(runs) if r["backend"] == "llama.cpp" and "weights" not in r)
    for k, run in enumerate(runs[1:], 1):
        if run["backend"] == "hf":  # in processes: the same model, other prompts sharing its batches
            run["identical_to_hf"] = rows[k] == rows[0]
            continue
        run["vs_hf"] = agreement(rows[0], rows[k])
        first = next(j for j, r in enumerate(runs)
                     if r["backend"] == "llama.cpp" and r.get("weights") == run.get("weights"))
        run["identical_to_first_llama_cpp_run"] = rows[k] == rows[first]
        if "weights" in run:  # a converted file against the file as llama.cpp computes it
            run["vs_file"] = agreement(rows[file_run], rows[k])
    best = max((r for r in runs[1:] if r["backend"] == "llama.cpp" and "weights" not in r),
               key=lambda r: r["tokens_per_cpu_s"])
    return {"threads": threads, "runs": runs,
            "best_llama_cpp_by_cpu_time": {"sequences": best["sequences"], "tokens_per_cpu_s": best["tokens_per_cpu_s"],
                                           "vs_hf": round(best["tokens_per_cpu_s"] / runs[0]["tokens_per_cpu_s"], 2)}}


def print_table(block: dict[str, Any]) -> None:
    print(f"\nthreads {block['threads']}\n| backend | batch / sequences | new tokens | tokens/CPU-s | tokens/s "
          "| identical prompts vs hf | hf tokens before the first difference |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in block["runs"]:
        vs = r.get("vs_hf")
        name = r["backend"] + (f" on {r['weights']}" if "weights" in r else "") + (
            f" in {r['processes']} one-thread processes" if "processes" in r else "")
        same = ("identical | |" if r.get("identical_to_hf") else "differs | |") if "processes" in r else (
            f"{vs['identical_prompts']}/{vs['prompts']} | {vs['tokens_before_first_difference_share']} |"
            if vs else "(reference) | |")
        print(f"| {name} | {r.get('batch_size', r.get('sequences'))} | {r['new_tokens']} | "
              f"{r['tokens_per_cpu_s']} | {r['tokens_per_s']} | {same}")


def main(argv=None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=TracesConfig.model_fields["batch_size"].default,
                   help="hf: rows decoded together (default: the traces stage's)")
    p.add_argument("--sequences", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32],
                   help="llama.cpp: comma-separated sequence counts")
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="comma-separated engine thread counts, each a block of its own")
    p.add_argument("--converted", type=lambda s: [x for x in s.split(",") if x], default=["float32", "bfloat16"],
                   help="comma-separated: the GGUF's weights also as these types in llama.cpp (float32, bfloat16, "
                        "q8_0, q4_0; '' for none)")
    p.add_argument("--work", type=Path, default=Path("runs/bench_trace_backends"),
                   help="where the converted GGUF files are written (and reused)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p, "bench_trace_backends.json")
    args = p.parse_args(argv)
    print(f"command: {command()}", flush=True)
    tokenizer, gguf = load_tokenizer(DEFAULT_TARGET), target_gguf(DEFAULT_TARGET)
    prompts = encode_prompts(tokenizer, corpus_prompts(args.num_prompts, args.seed))
    lengths = sorted(map(len, prompts))
    print(f"{len(prompts)} prompts, prompt tokens min {lengths[0]} median {lengths[len(lengths) // 2]} max "
          f"{lengths[-1]}; max_new_tokens {args.max_new_tokens}; {args.repeats} repeats", flush=True)
    load_before = os.getloadavg()
    unknown = sorted(set(args.converted) - set(CONVERSIONS))
    if unknown:
        p.error(f"--converted: {unknown} (known: {', '.join(CONVERSIONS)})")
    converted = {dtype: converted_gguf(gguf, dtype, args.work) for dtype in args.converted}
    blocks = [at_threads(t, args, prompts, gguf, converted) for t in args.threads]
    for block in blocks:
        print_table(block)
    with LlamaCppBackend(gguf, sequences=1) as backend:
        engine = {k: v for k, v in backend.info().items() if k in ("llama_cpp_python", "gguf", "gguf_sha256",
                                                                     "computes", "batch_tokens", "flash_attn")}
    save_result("trace_backends", {
        "target": describe_source(DEFAULT_TARGET), "llama_cpp": engine, "num_prompts": len(prompts),
        "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1],
                          "total": sum(lengths)},
        "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()}, "by_threads": blocks}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
