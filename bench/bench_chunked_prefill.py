"""Chunked against whole prefill on a real pack: does a long context prefilled a piece at a time (the server's
long lane) get the draft it gets prefilled whole?

  .venv/bin/python bench/bench_chunked_prefill.py --model-dir runs/demo/model --contexts 60 --out chunked.json

Contexts are real text: prompts of the packaged corpus, chat-formatted and joined until each reaches a length
drawn from [--min-tokens, --max-tokens]. For every context and chunk size the 16 draft tokens are compared with the
whole prefill's; where they differ, the report gives the first differing position and the whole prefill's margin
between its top two logits there (a near-tie that another matrix shape rounds the other way, or not). The result
goes to ``bench/results/chunked_prefill.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import json
import logging
import random

import torch
from transformers import AutoTokenizer

from harness import add_out_argument, argument_parser, log_to_console, median, save_result, stopwatch
from specdraft.data.corpus import corpus_dir
from specdraft.model.chat import encode_prompts
from specdraft.server.engine import load_engine

log = logging.getLogger("specdraft.bench.chunked")


def long_contexts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    prompts = [json.loads(line)["prompt"] for path in sorted((corpus_dir() / "train").glob("*.jsonl"))
               for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rng = random.Random(seed)
    rng.shuffle(prompts)
    encoded = encode_prompts(tokenizer, prompts)
    out, i = [], 0
    for _ in range(n):
        want, ids = rng.randint(lo, hi), []
        while len(ids) < want:
            ids += encoded[i % len(encoded)]
            i += 1
        out.append(ids[:want])
    return out


def chunked_draft(engine, context: list[int], chunk: int, num_draft: int) -> list[int]:
    lane = engine.lane(slots=1, capacity=len(context) + num_draft, num_draft=num_draft)
    start, tokens = 0, {}
    while start < len(context):
        tokens = lane.prefill_chunk(0, context, start, chunk)
        start += chunk
    while 0 not in tokens:
        tokens = lane.step()
    return tokens[0]


def whole_draft(engine, context: list[int], num_draft: int) -> list[int]:
    lane = engine.lane(slots=1, capacity=len(context) + num_draft, num_draft=num_draft)
    tokens = lane.admit([0], [context])
    while 0 not in tokens:
        tokens = lane.step()
    return tokens[0]


@torch.inference_mode()
def top2_margin(model, ids: list[int]) -> float:
    logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--contexts", type=int, default=60)
    ap.add_argument("--min-tokens", type=int, default=513, help="the server's long lane starts above 512 tokens")
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--num-draft", type=int, default=16)
    ap.add_argument("--compute", default="int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_out_argument(ap)
    args = ap.parse_args()
    log_to_console()
    torch.set_num_threads(args.threads)

    engine = load_engine(args.model_dir, None, args.compute)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    contexts = long_contexts(tokenizer, args.contexts, args.min_tokens, args.max_tokens, args.seed)
    per_chunk = {c: {"identical": 0, "differences": []} for c in args.chunks}
    with stopwatch() as lap:
        for i, ctx in enumerate(contexts):
            whole = whole_draft(engine, ctx, args.num_draft)
            for c in args.chunks:
                got = chunked_draft(engine, ctx, c, args.num_draft)
                if got == whole:
                    per_chunk[c]["identical"] += 1
                    continue
                at = next(j for j, (a, b) in enumerate(zip(got, whole)) if a != b)
                per_chunk[c]["differences"].append({"context": i, "tokens": len(ctx), "first_difference": at,
                                                    "whole_top2_margin": top2_margin(engine.model, ctx + whole[:at])})
            log.info("%d/%d (%d tokens): %s", i + 1, len(contexts), len(ctx),
                     {c: v["identical"] for c, v in per_chunk.items()})
    report = {
        "contexts": len(contexts),
        "context_tokens": {"min": min(map(len, contexts)), "median": median(list(map(len, contexts))),
                           "max": max(map(len, contexts))},
        "per_chunk": {str(c): {"identical": v["identical"], "of": len(contexts),
                               "differences": v["differences"]} for c, v in per_chunk.items()},
        "seconds": round(lap.wall, 1),
    }
    save_result("chunked_prefill", report, args.out)
    for c, v in report["per_chunk"].items():
        margins = [d["whole_top2_margin"] for d in v["differences"]]
        print(f"chunk {c}: {v['identical']}/{v['of']} identical"
              + (f"; differing drafts: top-2 margin at the first difference median {median(margins):.3f}"
                 f", max {max(margins):.3f}" if margins else ""))


if __name__ == "__main__":
    main()
