"""Speculative decoding on the embedded default (SmolLM2-135M target, CPU): speed sweep + cost model.

    .venv/bin/python bench/bench_speculate.py --out runs/bench_speculate [--draft MODEL_DIR] \
        [--prompts FILE] [--num-prompts 4] [--max-new-tokens 64] [--threads 1] [--draft-cache keep|reprefill|both]

Without --draft it builds a *stand-in* draft (the target's first 4 layers, ``--standin-layers``), which
exercises the code path but is not a trained draft: its figures say nothing about the goal (>= 1.5x).

Two parts, both written under --out (a folder), and together to ``bench/results/speculate.<cpu class>.json``:

1. ``cost_model.json``: per-forward times of the target (1 token, and k+1 tokens on a KV cache: a verify
   pass) and of one draft decode step, measured in this process; from them, for every k, the mean number
   of accepted draft tokens per step a draft must reach for 1.5x plain greedy:
   ``speedup = (a + 1) * T(1) / (V(k + 1) + k * D)``  ->  ``a >= 1.5 * (V(k + 1) + k * D) / T(1) - 1``.
2. ``specdraft speculate`` itself (``speculate.json`` / ``.md`` / PNG): tokens/s of plain greedy and of
   the draft, the draft behind prompt lookup and the lookup drafter at every k, on the same prompts, in the
   same run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from harness import argument_parser, forward_seconds, save_result
from specdraft.core.io import read_json

PROMPTS = [
    ("code", "Write a Python function that checks whether a string is a palindrome, with a docstring."),
    ("math", "A train travels 120 km in 1.5 hours. What is its average speed in km/h? Explain step by step."),
    ("writing", "Write a short email to a colleague asking them to review the slides for Friday's meeting."),
    ("qa", "What are three ways to keep basil alive on a windowsill?"),
    ("extraction", "List the capital cities mentioned: 'We flew from Paris to Rome, then took a train to Vienna.'"),
    ("reasoning", "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Why?"),
]


def write_prompts(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, (cat, text) in enumerate(PROMPTS):
            f.write(json.dumps({"id": f"{cat}-{i}", "source": "bench", "category": cat, "prompt": text}) + "\n")
    return path


def cost_model(target, drafts: dict, ks: list[int], context: int = 96, repeats: int = 7, clock: str = "cpu") -> dict:
    """``drafts``: name -> (model, forward: "model" | "lean" | "compiled")."""
    t1 = forward_seconds(target, 1, context, repeats, clock)
    verify = {k: forward_seconds(target, k + 1, context, repeats, clock) for k in ks}
    draft_step = {name: forward_seconds(m, 1, context, repeats, clock, forward)
                  for name, (m, forward) in drafts.items()}
    rows = []
    for name, d in draft_step.items():
        for k in ks:
            step = verify[k] + k * d
            need = 1.5 * step / t1 - 1
            rows.append({"draft": name, "k": k, "verify_ms": verify[k] * 1e3, "draft_step_ms": d * 1e3,
                         "step_ms": step * 1e3, "accepted_per_step_needed_for_1.5x": need,
                         "feasible": need <= k, "max_speedup_all_accepted": (k + 1) * t1 / step})
    return {"clock": clock, "context_tokens": context, "target_step_ms": t1 * 1e3,
            "verify_ms": {str(k): v * 1e3 for k, v in verify.items()},
            "draft_step_ms": {n: v * 1e3 for n, v in draft_step.items()}, "rows": rows,
            "formula": "speedup = (a + 1) * T(1) / (V(k + 1) + k * D); a = accepted drafts per step"}


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_speculate"))
    ap.add_argument("--target", default=None, help="target spec (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft", default=None, help="draft model dir, URL or 'lookup' (default: build the stand-in)")
    ap.add_argument("--standin-layers", type=int, default=4)
    ap.add_argument("--prompts", type=Path, default=None, help="prompts file (default: 6 built-in prompts)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, action="append", default=None, help="k values (default 2 4 8 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    ap.add_argument("--draft-cache", choices=["keep", "reprefill", "both"], default="keep")
    ap.add_argument("--draft-compute", choices=["float32", "bfloat16", "int4"], default="int4")
    ap.add_argument("--draft-stop", choices=["calibrated", "probability", "both"], default="calibrated",
                    help="where a step's draft stops short of k (specdraft speculate --draft-stop; 'both': the "
                         "probability rule too, side by side, as '<name>-prob')")
    ap.add_argument("--draft-confidence", type=float, default=None,
                    help="the stop rule's threshold (default: specdraft speculate's for the rule; 0: always k)")
    ap.add_argument("--draft-lean", choices=["on", "off", "both"], default="on",
                    help="draft decode through specdraft.lean, transformers' forward, or both side by side")
    ap.add_argument("--draft-compile", choices=["on", "off", "both"], default="on",
                    help="lean draft steps through torch.compile, eagerly, or both side by side")
    ap.add_argument("--cost-model-computes", default="float32,int4",
                    help="draft compute formats timed in the cost model (comma separated)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                    help="clock behind the speedups (cpu: this process's CPU time; steady at 1 thread on a "
                         "shared machine; both are recorded)")
    ap.add_argument("--hybrid-min-ngram", type=int, default=2,
                    help="also run the draft behind prompt lookup (lookup where the last N+ tokens recur); 0: off")
    ap.add_argument("--also-draft", action="append", default=[], metavar="NAME=DIR",
                    help="another draft model dir timed in the same speculation run (repeatable)")
    ap.add_argument("--skip-cost-model", action="store_true")
    ap.add_argument("--skip-speculate", action="store_true")
    args = ap.parse_args(argv)

    from specdraft.model.loader import load_draft
    from specdraft.model.specs import DEFAULT_TARGET, load_model
    from specdraft.model.truncate import save_init
    from specdraft.stages.speculate import SpeculateConfig, run_speculate

    torch.set_num_threads(args.threads)
    target_spec = args.target or DEFAULT_TARGET
    ks = sorted(set(args.k or [2, 4, 8, 16]))
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    draft = args.draft
    note = ""
    if draft is None:
        draft_dir = out / f"standin-{args.standin_layers}layers"
        if not (draft_dir / "config.json").is_file():
            save_init(f"truncate:{target_spec}:{args.standin_layers}", draft_dir)
        draft = str(draft_dir)
        note = (f"Draft = STAND-IN: the target's first {args.standin_layers} layers (+ final norm and tied head), "
                "untrained. These figures exercise the code path; they are not the trained draft's.")
    prompts = args.prompts or write_prompts(out / "prompts.jsonl")
    figures: dict[str, Any] = {}

    if not args.skip_cost_model and Path(draft).is_dir():
        target = load_model(target_spec)
        drafts = {}
        for compute in [c for c in args.cost_model_computes.split(",") if c]:
            model, _ = load_draft(draft, compute)
            drafts[f"draft/{compute}"] = (model, "compiled")  # as the speculative draft runs it by default
            drafts[f"draft/{compute}/eager"] = (model, "lean")  # specdraft.lean without torch.compile
            drafts[f"draft/{compute}/hf"] = (model, "model")  # through transformers' forward
        cm = cost_model(target, drafts, ks, clock=args.clock)
        cm["threads"] = torch.get_num_threads()
        cm["note"] = note
        (out / "cost_model.json").write_text(json.dumps(cm, indent=2) + "\n")
        figures["cost_model"] = cm
        print(f"target step {cm['target_step_ms']:.1f} ms; verify " +
              ", ".join(f"k={k}: {v:.1f} ms" for k, v in cm["verify_ms"].items()) + "; draft step " +
              ", ".join(f"{n}: {v:.1f} ms" for n, v in cm["draft_step_ms"].items()))
        print("accepted drafts per step needed for 1.5x (of k):")
        for r in cm["rows"]:
            print(f"  {r['draft']:<14} k={r['k']:<2}  need {r['accepted_per_step_needed_for_1.5x']:5.2f}"
                  f"{'' if r['feasible'] else '  (infeasible: > k)'};  ceiling {r['max_speedup_all_accepted']:.2f}x")
        del target, drafts

    rc = 0
    if not args.skip_speculate:
        cfg = SpeculateConfig(target=target_spec, draft=draft, prompts=prompts, out=out,
                              max_new_tokens=args.max_new_tokens, k=ks, num_prompts=args.num_prompts,
                              draft_cache=args.draft_cache, draft_compute=args.draft_compute, threads=args.threads,
                              draft_lean=args.draft_lean, draft_compile=args.draft_compile,
                              draft_stop=args.draft_stop,
                              **({} if args.draft_confidence is None else {"draft_confidence": args.draft_confidence}),
                              note=note or None, clock=args.clock,
                              hybrid_min_ngram=args.hybrid_min_ngram or None, also_draft=args.also_draft)
        rc = run_speculate(cfg)
        figures["speculate"] = read_json(out / "speculate.json")
    if figures:
        save_result("speculate", figures)
    return rc


if __name__ == "__main__":
    sys.exit(main())
