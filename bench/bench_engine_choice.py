"""What `specdraft serve --engine auto` picks on this CPU given the draft's GGUF export, and whether the pick holds.

  .venv/bin/python bench/bench_engine_choice.py --model-dir runs/demo/model --gguf runs/demo/export/draft.gguf

Both engines are loaded once as the server loads them (torch with ``--compute auto``, llama.cpp on the export, at
``--threads``), then ``server.engine_choice.choose_engine`` runs ``--repeats`` times with the server's own replay
(``LOOP_REPLAY``). The result holds each run's pick and figures, and per engine the median seconds of the replay's
first call, its later calls and the loop it stands for. Compare the loop ratio with `bench/bench_server_loop.py`'s
measured one (torch with reuse against the llama.cpp engine). Result: ``bench/results/engine_choice.<cpu class>.json``.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from harness import argument_parser, log_to_console, median, save_result
from specdraft.core.wire import DRAFT_TOKENS
from specdraft.server.engine import load_engine, load_llamacpp_engine
from specdraft.server.engine_choice import choose_engine

log = logging.getLogger("specdraft.bench")


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--model-dir", required=True, help="the packed draft (config.json + draft.qd4)")
    ap.add_argument("--gguf", required=True, help="its GGUF export (`specdraft export MODEL_DIR --format gguf`)")
    ap.add_argument("--threads", type=int, default=1, help="both engines' threads (the server's default on 2 cores)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    log_to_console()
    torch.set_num_threads(args.threads)
    engines = {"torch": load_engine(args.model_dir, None, "auto"),
               "llama.cpp": load_llamacpp_engine(args.model_dir, args.gguf, threads=args.threads)}
    try:
        runs = [choose_engine(engines, DRAFT_TOKENS) for _ in range(args.repeats)]
    finally:
        engines["llama.cpp"].close()
    medians = {name: {key: round(median([r["candidates"][name][key] for r in runs]), 6)
                      for key in ("first_call_s", "later_call_s", "loop_s")} for name in engines}
    figures = {"model_dir": args.model_dir, "gguf": args.gguf, "threads": args.threads, "repeats": args.repeats,
               "torch_compute": engines["torch"].compute_choice.get("compute"),
               "replay": runs[0]["replay"], "picks": dict(Counter(r["engine"] for r in runs)), "median": medians,
               "torch_loop_vs_llama_cpp": round(medians["torch"]["loop_s"] / medians["llama.cpp"]["loop_s"], 3),
               "runs": runs}
    save_result("engine_choice", figures)


if __name__ == "__main__":
    main()
