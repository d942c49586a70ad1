"""What 4-bit packing costs a trained draft in acceptance, by how its codes are chosen (plain rounding vs GPTQ).

    .venv/bin/python bench/bench_gptq.py --checkpoint runF3 --validation val80/validation.jsonl \
        --calibration tr3/traces.jsonl --variants float minmax gptq:128:0.1:act gptq:128:0.01 --out gptq.json

Each variant loads the float checkpoint, replaces its 2-D weights by what the pack would store (G = 64, or the
finer grid a weight already sits on exactly, as `specdraft pack` does unless --no-lossless-grids; norms stay
float32), and scores the simulated acceptance (one teacher-forced pass per validation prompt; exact for
greedy drafts, see specdraft.drafting.simulated.simulated_acceptance) on every validation point, pooled. Variants:
  float                        the checkpoint as trained
  minmax                       plain rounding (specdraft pack's default fit)
  gptq:SEQS:DAMP[:act]         specdraft.quant.gptq.gptq_calibrate on SEQS calibration traces with damping DAMP,
                               left to right or (":act") by decreasing input energy
  gptq-linears:SEQS:DAMP[:act] the same, but the tied embedding/head kept in float (what the linears cost)
  minmax-embedding             only the embedding rounded (what the embedding costs)
`specdraft pack --fit gptq` then `specdraft eval --compute int4` measure the shipped file itself. The result goes
to ``bench/results/gptq.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from harness import add_out_argument, argument_parser, save_result, stopwatch
from specdraft.core.io import sha256_file
from specdraft.core.records import Example, ValidationPoint, load_validation
from specdraft.drafting.simulated import simulated_acceptance
from specdraft.model.specs import load_model
from specdraft.quant import q4g, qd4
from specdraft.quant.gptq import calibration_sequences, gptq_calibrate

GROUP_SIZE = q4g.DEFAULT_GROUP_SIZE


def validation_examples(path: str) -> list[Example]:
    """One teacher-forced sequence per prompt: its offset-0 context, then the target ids of its points in order."""
    by_prompt: dict[str, list[ValidationPoint]] = collections.defaultdict(list)
    for point in load_validation(path):
        by_prompt[point.id].append(point)
    examples = []
    for pid, points in by_prompt.items():
        points.sort(key=lambda p: p.offset)
        context = points[0].context_ids
        continuation = [t for p in points for t in p.target_ids]
        examples.append(Example(pid, context + continuation, len(context)))
    return examples


@torch.no_grad()
def apply_variant(model, variant: str, calibration: str | None, lossless_grids: bool = True) -> dict:
    name, *params = variant.split(":")
    stored = qd4.stored_tensors(model)
    embedding = qd4.embedding_name(model)
    if name == "float":
        return {}
    # lossless_group_size keeps non-2-D tensors (norms) at GROUP_SIZE, so they never appear here
    group_sizes = q4g.lossless_group_sizes(stored, GROUP_SIZE) if lossless_grids else {}
    if name in ("minmax", "minmax-embedding"):
        for n, t in stored.items():
            if t.dim() == 2 and (name == "minmax" or n == embedding):
                t.copy_(q4g.dequantize(q4g.quantize(t, group_sizes.get(n, GROUP_SIZE))))
        return {"finer_grid_tensors": len(group_sizes)}
    if name in ("gptq", "gptq-linears"):
        if calibration is None:
            raise SystemExit(f"{variant}: needs --calibration")
        seqs, damp = int(params[0]), float(params[1])
        act = len(params) > 2 and params[2] == "act"
        sequences = calibration_sequences(calibration, seqs, 512)
        gptq_calibrate(model, sequences, GROUP_SIZE, damp, act, embedding_gptq=name == "gptq",
                       group_sizes=group_sizes)
        return {"sequences": len(sequences), "tokens": sum(map(len, sequences)), "damp": damp, "act_order": act,
                "finer_grid_tensors": len(group_sizes)}
    raise SystemExit(f"unknown variant {variant!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="float draft checkpoint (a training output dir)")
    parser.add_argument("--validation", required=True, help="validation.jsonl (specdraft validation)")
    parser.add_argument("--calibration", default=None, help="traces JSONL for the gptq variants")
    parser.add_argument("--variants", nargs="+", default=["float", "minmax", "gptq:128:0.1:act"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lossless-grids", action=argparse.BooleanOptionalAction, default=True,
                        help="store weights that sit exactly on a finer grid on it, as specdraft pack does")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    examples = validation_examples(args.validation)
    rows = []
    for variant in args.variants:
        model = load_model(args.checkpoint, dtype=torch.float32).eval()
        with stopwatch() as quantising:
            params = apply_variant(model, variant, args.calibration, args.lossless_grids)
        stats = simulated_acceptance(model, examples, k=16)
        rows.append({"variant": variant, **params, "points": stats.points,
                     "mean_accepted_pooled": stats.mean_accepted_pooled,
                     "quantise_seconds": round(quantising.wall, 1)})
        print(f"{variant:28s} pooled {stats.mean_accepted_pooled:.3f} over {stats.points} points "
              f"(quantise {quantising.wall:.0f}s)", flush=True)
        del model
    base = next((r["mean_accepted_pooled"] for r in rows if r["variant"] == "float"), None)
    for r in rows:
        r["relative_to_float"] = None if not base else r["mean_accepted_pooled"] / base - 1
    save_result("gptq", {
        "checkpoint": args.checkpoint, "group_size": GROUP_SIZE,
        "validation": {"path": args.validation, "sha256": sha256_file(args.validation), "prompts": len(examples)},
        "calibration": args.calibration and {"path": args.calibration, "sha256": sha256_file(args.calibration)},
        "threads": args.threads, "lossless_grids": args.lossless_grids, "variants": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
