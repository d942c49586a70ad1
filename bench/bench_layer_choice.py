"""Which layers a draft cut from the target keeps (issue 33, item 4): `specdraft choose-layers` (greedy elimination,
``specdraft.model.layer_choice``) on the embedded target, and the demo's earlier cut (0-15 + 22-29) scored the same
way on the same traces beside it.

    python bench/bench_layer_choice.py --traces TRACES.jsonl --first-row 1000 --examples 16 --keep 24 \\
        --out layer_choice.json

The first --examples rows of at most 300 tokens from row --first-row on are scored, so that a run training on the
file's first rows scores rows it does not train on. --out is the choose-layers stage's own result (it resumes from
it), with the earlier cut's scores added; ``bench/results/layer_choice.<cpu class>.json`` gets the same figures.
"""

from __future__ import annotations

from harness import argument_parser, save_result
from specdraft.core.io import atomic_write_json
from specdraft.model.layer_choice import score_layers
from specdraft.model.specs import DEFAULT_TARGET, load_model
from specdraft.stages.choose_layers import ChooseLayersConfig, run_choose_layers, select_examples

EARLIER_CUT = [*range(16), *range(22, 30)]


def main() -> None:
    ap = argument_parser(__doc__)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--keep", type=int, default=24)
    ap.add_argument("--first-row", type=int, default=0)
    ap.add_argument("--examples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    cfg = ChooseLayersConfig(traces=args.traces, keep=args.keep, out=args.out, target=DEFAULT_TARGET,
                             first_row=args.first_row, examples=args.examples, threads=args.threads)
    result = run_choose_layers(cfg)
    earlier = score_layers(load_model(DEFAULT_TARGET), EARLIER_CUT, select_examples(cfg))
    result["earlier_cut"] = earlier.to_json()
    atomic_write_json(args.out, result)
    save_result("layer_choice", result)
    print(f"earlier cut: cross-entropy {earlier.cross_entropy:.3f}, agreement {earlier.agreement:.3f}, accepted "
          f"{earlier.accepted:.2f}")
    print(f"chosen {result['layers']}: cross-entropy {result['chosen']['cross_entropy']:.3f}, agreement "
          f"{result['chosen']['agreement']:.3f}, accepted {result['chosen']['accepted']:.2f}")
    print(result["init"])


if __name__ == "__main__":
    main()
