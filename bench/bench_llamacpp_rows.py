"""What one ``llama_decode`` of the draft costs by how many tokens it carries: the draft server's llama.cpp step.

  .venv/bin/python bench/bench_llamacpp_rows.py --gguf runs/demo/export/draft.gguf

The llama.cpp engine (``model.llamacpp_slots``) feeds every live row one token per ``llama_decode``, and a prefill one
token per pass too (bit for bit the same keys and values however passes are grouped). Whether several loops sharing a
step, or a short prefill folded into one, could be cheaper than passes of their own depends on what a pass of n
one-token sequences costs against n passes of one: measured here, in one context of as many sequences as the largest
``--sizes``, at ``--context`` positions each (every timed pass is taken back after), as the server's lanes make it
(``sequences_context``, ``--threads``). For contrast, a pass of n tokens of one sequence (what llama-server's prompt
pass and a chunked prefill run). Rounds interleave the sizes; the figure per size is the median over rounds of each
round's median pass.
Result: ``bench/results/llamacpp_rows.<cpu class>.json``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from harness import argument_parser, log_to_console, median, save_result
from specdraft.model.llamacpp import llama_cpp_module, load_gguf_model, sequences_context

log = logging.getLogger("specdraft.bench")


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--gguf", required=True, help="the draft's GGUF export (`specdraft export DIR --format gguf`)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="tokens per pass")
    ap.add_argument("--context", type=int, default=80, help="positions each sequence holds before the timed passes")
    ap.add_argument("--passes", type=int, default=20, help="timed passes per size and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads (the server's default on 2 cores)")
    args = ap.parse_args()
    if 1 not in args.sizes:
        ap.error("--sizes must include 1: every pass is set against one-token passes")
    log_to_console()
    lib = llama_cpp_module()
    model = load_gguf_model(args.gguf)
    sequences = max(args.sizes)
    ctx, _ = sequences_context(model, sequences, args.context + max(args.sizes), max(args.sizes), args.threads,
                               "bench")
    memory = lib.llama_get_memory(ctx)
    batch = lib.llama_batch_init(sequences, 0, 1)
    positions = [0] * sequences

    def decode(tokens: list[tuple[int, int]], keep: bool = False) -> float:
        """One pass of (sequence, token) pairs at each sequence's next positions; its seconds. Unless ``keep``, the
        pass is taken back after, so every timed pass runs at ``--context`` positions."""
        start = {seq: positions[seq] for seq, _ in tokens}
        for n, (seq, token) in enumerate(tokens):
            batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, positions[seq], 1, True
            batch.seq_id[n][0] = seq
            positions[seq] += 1
        batch.n_tokens = len(tokens)
        started = time.perf_counter()
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        seconds = time.perf_counter() - started
        if not keep:
            for seq, position in start.items():
                lib.llama_memory_seq_rm(memory, seq, position, -1)
                positions[seq] = position
        return seconds

    try:
        for seq in range(sequences):  # each sequence a context of its own, one token per pass as the server fills
            for p in range(args.context):
                decode([(seq, 100 + (7 * p + seq) % 5000)], keep=True)
        rounds: dict[str, dict[int, list[float]]] = {"sequences": {}, "one_sequence": {}}
        for _ in range(args.rounds):
            for n in args.sizes:
                rounds["sequences"].setdefault(n, []).append(median(
                    [decode([(s, 200 + i) for s in range(n)]) for i in range(args.passes)]))
                rounds["one_sequence"].setdefault(n, []).append(median(
                    [decode([(0, 300 + i * n + j) for j in range(n)]) for i in range(args.passes)]))
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    pass_ms = {kind: {str(n): round(1000 * median(v), 3) for n, v in by_size.items()}
               for kind, by_size in rounds.items()}
    one = pass_ms["sequences"]["1"]
    figures: dict[str, Any] = {
        "gguf": args.gguf, "threads": args.threads, "context": args.context, "passes": args.passes,
        "rounds": args.rounds, "pass_ms": pass_ms,
        # a pass's cost against as many one-token passes: 1.0 where sharing a pass saves nothing
        "against_single_passes": {kind: {n: round(ms / (int(n) * one), 3) for n, ms in by_size.items()}
                                  for kind, by_size in pass_ms.items()}}
    log.info("%s", figures["against_single_passes"])
    save_result("llamacpp_rows", figures)


if __name__ == "__main__":
    main()
