"""Where should a step's draft stop? Stop rules replayed on real drafts, with costs measured in the same run.

    .venv/bin/python bench/bench_draft_stop.py --draft MODEL_DIR [--draft MODEL_DIR ...] \
        --validation validation.jsonl [--every 3] [--threads 1] --out stop.json

For every evaluation point (every ``--every``-th of the file) each draft drafts 16 tokens greedily (int4, kept
cache, lean steps, as ``specdraft speculate`` runs it), recording its probability for each token and how many
of them the target's continuation accepts. The target's verify pass V(n) for n = 1..17 tokens and each draft's
step D are timed in this process (CPU clock, median). A rule decides after each drafted token whether to stop;
a step that drafts L tokens of which a are accepted yields a + 1 tokens in L * D + V(L + 1) (+ D for the
two-token catch-up after a fully accepted draft), and the modelled speedup is tokens * V(1) / time over all
points. Rules: always k; "probability" (stop after a token with p < t, transformers' assisted generation); and
"calibrated" (stop once the product of the per-token acceptance rates, by bin of p, falls below t), its rates
counted on the even points and scored on the odd ones, so it is judged on points it did not learn from.

It is a model of a speculation step, not a speculation run (no Python overhead, EOS, prompt prefill): use it to
compare rules, and ``bench/bench_speculate.py --draft-stop both`` to measure the chosen one. The result goes to
``bench/results/draft_stop.<cpu class>.json`` and to --out.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import torch

from harness import add_out_argument, argument_parser, forward_seconds, save_result

DRAFT_TOKENS = 16
VERIFY_SIZES = list(range(1, DRAFT_TOKENS + 2))


def collect(draft_dir: str, points: list[dict]) -> list[dict]:
    """Per point: the draft's top probability for each of its 16 greedy tokens and the accepted length."""
    from tqdm import tqdm

    from specdraft.drafting.cached import CachedDraftModel, top_probability
    from specdraft.drafting.metrics import accepted_length
    from specdraft.model.loader import load_draft

    model, _ = load_draft(draft_dir, "int4")
    drafter = CachedDraftModel(model, lean=True)
    rows = []
    with torch.inference_mode():
        for point in tqdm(points, desc=Path(draft_dir).name, unit="point"):
            drafter.reset()
            context = point["context_ids"]
            logits = drafter.feed(context, 0)
            drafter.tokens.extend(context)
            tokens, probs = [], []
            for i in range(DRAFT_TOKENS):
                probs.append(top_probability(logits))
                tokens.append(int(logits[0, -1].argmax()))
                if i < DRAFT_TOKENS - 1:
                    logits = drafter.feed(tokens[-1:], len(drafter.tokens))
                    drafter.tokens.append(tokens[-1])
            rows.append({"id": point["id"], "offset": point.get("offset"), "probs": probs,
                         "accepted": accepted_length(tokens, point["target_ids"])})
    return rows


def simulate(rows: list[dict], step_ms: float, verify_ms: dict[int, float], k: int, stop) -> dict:
    """Modelled tokens per step and speedup of drafting up to k tokens with ``stop(probs_so_far) -> bool``."""
    tokens = time = drafted = 0.0
    for row in rows:
        probs, length = row["probs"], k
        for i in range(k - 1):
            if stop(probs[: i + 1]):
                length = i + 1
                break
        kept = min(row["accepted"], length)
        tokens += kept + 1
        drafted += length
        time += length * step_ms + verify_ms[length + 1] + (step_ms if kept == length else 0.0)
    return {"speedup": tokens * verify_ms[1] / time, "tokens_per_step": tokens / len(rows),
            "drafted_per_step": drafted / len(rows)}


def calibration(rows: list[dict]):
    """``speculate.AcceptanceCalibration`` (the acceptance rate per bin of the draft's probability, given every
    earlier token accepted) as a run learns it, counted here over ``rows`` at once."""
    from specdraft.drafting.calibration import AcceptanceCalibration

    cal = AcceptanceCalibration()
    for row in rows:
        cal.observe(row["probs"], row["accepted"], refused=row["accepted"] < len(row["probs"]))
    return cal


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--draft", action="append", required=True, help="packed draft dir (repeatable)")
    ap.add_argument("--validation", type=Path, required=True, help="validation.jsonl (context_ids, target_ids)")
    ap.add_argument("--every", type=int, default=3, help="use every N-th point")
    ap.add_argument("--target", default=None, help="target spec (default: the embedded SmolLM2-135M)")
    ap.add_argument("--context", type=int, default=200, help="cache length for the timings")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specdraft.model.loader import load_draft
    from specdraft.model.specs import DEFAULT_TARGET, load_model

    points = [json.loads(line) for line in args.validation.read_text().splitlines() if line.strip()][::args.every]
    target = load_model(args.target or DEFAULT_TARGET)
    verify_ms = {n: 1e3 * forward_seconds(target, n, args.context, args.repeats) for n in VERIFY_SIZES}
    del target
    print("verify ms by tokens:", {n: round(v, 1) for n, v in verify_ms.items()})
    report = {"points": len(points), "verify_ms": verify_ms, "drafts": {}}
    for draft_dir in args.draft:
        model, _ = load_draft(draft_dir, "int4")
        step_ms = {forward: 1e3 * forward_seconds(model, 1, args.context, 2 * args.repeats, forward=forward)
                   for forward in ("lean", "compiled")}
        del model
        rows = collect(draft_dir, points)
        learn, score = rows[::2], rows[1::2]
        cal = calibration(learn)
        bins = len(cal.seen)
        rates = [cal.estimate((b + 0.5) / bins) for b in range(bins)]  # for the report

        def still_kept(probs: list[float]) -> float:
            return float(np.prod([cal.estimate(p) for p in probs]))

        rules = {"always k": lambda probs: False}
        for t in (0.2, 0.4, 0.6, 0.8):
            rules[f"probability < {t}"] = lambda probs, t=t: probs[-1] < t
        for t in (0.2, 0.4, 0.5, 0.6, 0.7, 0.8):
            rules[f"calibrated < {t}"] = lambda probs, t=t: still_kept(probs) < t
        table = {}
        for forward, d in step_ms.items():
            table[forward] = {rule: {str(k): simulate(score, d, verify_ms, k, stop) for k in (2, 4, 8, 16)}
                              for rule, stop in rules.items()}
        report["drafts"][draft_dir] = {
            "step_ms": step_ms, "mean_accepted": statistics.mean(r["accepted"] for r in rows),
            "calibration_rates": rates, "modelled": table, "rows": rows}
        print(f"\n{draft_dir}: step {step_ms['compiled']:.1f} ms compiled ({step_ms['lean']:.1f} eager), "
              f"mean accepted {report['drafts'][draft_dir]['mean_accepted']:.2f} of {DRAFT_TOKENS}; "
              f"acceptance rate by probability bin {[round(r, 2) for r in rates]}")
        print(f"{'rule (compiled steps)':<22}" + "".join(f"{'k=' + str(k):>8}" for k in (2, 4, 8, 16)))
        for rule, per_k in table["compiled"].items():
            print(f"{rule:<22}" + "".join(f"{per_k[str(k)]['speedup']:>7.2f}x" for k in (2, 4, 8, 16)))
    save_result("draft_stop", report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
