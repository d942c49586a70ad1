"""Cost per training token: teacher-forced labels (`specdraft label`) vs greedy traces (`specdraft traces`).

Both run the target in float32 in one process on the same prompts (those of a prompts.jsonl that carry a
reference answer), alternating traces and labels for ``--repeats`` rounds so both see the same machine load.
Traces: ``specdraft.decode.iter_greedy`` as the traces stage runs it (continuous batching, longest first).
Labels: ``specdraft.label.label_batch`` over length-grouped batches, as the label stage runs it. A training
token is a completion token (traces) or a labelled answer token (labels). Medians over the rounds of wall
and process-CPU seconds per training token, and their ratio, are printed as a markdown table and written to
``bench/results/label.<cpu class>.json`` and --out.

    .venv/bin/python bench/bench_label.py --prompts runs/x/prompts/prompts.jsonl      # about 10 min
    .venv/bin/python bench/bench_label.py --prompts P --num-prompts 16 --repeats 1   # a quick look
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from harness import add_out_argument, argument_parser, median, save_result, stopwatch


def parse_args(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--prompts", type=Path, required=True, help="prompts.jsonl with `response` fields")
    p.add_argument("--target", default="embedded:smollm2-135m-instruct")
    p.add_argument("--num-prompts", type=int, default=64, help="first N prompts that have a reference answer")
    p.add_argument("--max-new-tokens", type=int, default=128, help="traces: tokens per prompt at most")
    p.add_argument("--batch-size", type=int, default=64, help="traces: rows decoded together")
    p.add_argument("--max-seq-len", type=int, default=1024, help="labels: prompt + answer tokens at most")
    p.add_argument("--batch-tokens", type=int, default=8192, help="labels: padded tokens per forward")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    add_out_argument(p, "bench_label.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from specdraft.core.records import read_answers
    from specdraft.model.chat import encode_prompts
    from specdraft.model.decode import iter_greedy
    from specdraft.model.specs import load_model, load_tokenizer
    from specdraft.stages.label import answer_ids, label_batch, token_batches

    rows, _ = read_answers(args.prompts, args.num_prompts)
    tok = load_tokenizer(args.target)
    model = load_model(args.target)
    prompt_ids = encode_prompts(tok, [r["prompt"] for r in rows])
    seqs, plens = [], []
    for p, r in zip(prompt_ids, rows):
        a = answer_ids(tok, p, r["response"], args.max_seq_len)
        if a:
            seqs.append(p + a)
            plens.append(len(p))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))

    def run_traces() -> int:
        return sum(len(g.tokens) for _, g in iter_greedy(model, prompt_ids, args.max_new_tokens,
                                                        batch_size=args.batch_size, order=order))

    def run_labels() -> int:
        n = 0
        for batch in token_batches([len(s) for s in seqs], args.batch_tokens):
            n += sum(map(len, label_batch(model, [seqs[i] for i in batch], [plens[i] for i in batch], pad)))
        return n

    per: dict[str, list[tuple[float, float, int]]] = {"traces": [], "labels": []}
    with torch.inference_mode():
        for r in range(args.repeats):
            for name, fn in (("traces", run_traces), ("labels", run_labels)):
                with stopwatch() as lap:
                    n = fn()
                per[name].append((lap.wall, lap.cpu, n))
                print(f"round {r}: {name}: {n} tokens, {lap.wall:.1f} s wall, {lap.cpu:.1f} s CPU, "
                      f"{n / lap.wall:.1f} tok/s", flush=True)

    def med(name: str, i: int) -> float:
        return median([x[i] / x[2] for x in per[name]])

    result = {
        "prompts": len(prompt_ids), "answers": len(seqs), "threads": args.threads, "rounds": per,
        "traces_wall_ms_per_token": 1000 * med("traces", 0), "labels_wall_ms_per_token": 1000 * med("labels", 0),
        "traces_cpu_ms_per_token": 1000 * med("traces", 1), "labels_cpu_ms_per_token": 1000 * med("labels", 1),
    }
    result["wall_ratio"] = result["traces_wall_ms_per_token"] / result["labels_wall_ms_per_token"]
    result["cpu_ratio"] = result["traces_cpu_ms_per_token"] / result["labels_cpu_ms_per_token"]
    save_result("label", result, args.out)
    print(f"\n| source | training tokens per round | wall ms / token (median) | CPU ms / token (median) |\n"
          f"|---|---:|---:|---:|\n"
          f"| traces (greedy decode, batch {args.batch_size}) | {per['traces'][0][2]} | "
          f"{result['traces_wall_ms_per_token']:.2f} | {result['traces_cpu_ms_per_token']:.2f} |\n"
          f"| labels (teacher-forced, {args.batch_tokens} tokens/forward) | {per['labels'][0][2]} | "
          f"{result['labels_wall_ms_per_token']:.2f} | {result['labels_cpu_ms_per_token']:.2f} |\n\n"
          f"labels are {result['wall_ratio']:.2f}x cheaper per token (wall), {result['cpu_ratio']:.2f}x (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
