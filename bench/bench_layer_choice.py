"""Which layers a draft cut from the target keeps (issue 33, item 4): greedy elimination from the target's full
stack, each round dropping the layer whose absence raises the cross-entropy of the target's greedy tokens least
(``specdraft.model.layer_choice``), scored teacher-forced on traces; the demo's earlier cut (0-15 + 22-29) scored the
same way beside it. Prints each round and writes the rounds, the chosen ``truncate:`` init and both scores.

    python bench/bench_layer_choice.py --traces TRACES.jsonl --first-row 1000 --examples 16 --keep 24 \
        --out layer_choice.json

The first --examples rows of at most --max-len tokens from row --first-row on are scored, so that a run training on
the file's first rows scores rows it does not train on.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from specdraft.core.io import atomic_write_json
from specdraft.core.records import read_traces
from specdraft.model.layer_choice import choose_layers, score_layers
from specdraft.model.specs import DEFAULT_TARGET, resolve_model

EARLIER_CUT = [*range(16), *range(22, 30)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--keep", type=int, default=24)
    ap.add_argument("--first-row", type=int, default=0, help="the first row of the traces file to score")
    ap.add_argument("--examples", type=int, default=16, help="traces scored")
    ap.add_argument("--max-len", type=int, default=300, help="skip traces longer than this (tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.target), dtype=torch.float32).eval()
    rows = [e for e in read_traces(args.traces, 1024)[args.first_row:] if len(e.input_ids) <= args.max_len]
    examples = rows[:args.examples]
    print(f"{len(examples)} traces, {sum(len(e.completion) for e in examples)} completion tokens", flush=True)

    started = time.perf_counter()
    full = score_layers(model, range(model.config.num_hidden_layers), examples)
    earlier = score_layers(model, EARLIER_CUT, examples) if model.config.num_hidden_layers == 30 else None
    rounds = choose_layers(model, examples, args.keep, progress=lambda r: print(
        f"{len(r.score.layers)} layers: drop {r.dropped} (runner-up {r.runner_up}): CE {r.score.cross_entropy:.3f}, "
        f"agreement {r.score.agreement:.3f}, accepted {r.score.accepted:.2f}", flush=True))
    chosen = rounds[-1].score if rounds else full
    result = {
        "target": args.target, "traces": args.traces, "examples": [e.id for e in examples], "keep": args.keep,
        "seconds": round(time.perf_counter() - started, 1), "full": full.to_json(),
        "earlier_cut": earlier.to_json() if earlier else None,
        "rounds": [{"dropped": r.dropped, "runner_up": r.runner_up, **r.score.to_json()} for r in rounds],
        "chosen": chosen.to_json(),
        "init": f"truncate:{args.target}:" + ",".join(map(str, chosen.layers)),
    }
    atomic_write_json(args.out, result)
    if earlier:
        print(f"earlier cut {EARLIER_CUT}: CE {earlier.cross_entropy:.3f}, accepted {earlier.accepted:.2f}")
    print(f"chosen {chosen.layers}: CE {chosen.cross_entropy:.3f}, accepted {chosen.accepted:.2f}")
    print(result["init"])


if __name__ == "__main__":
    main()
