"""A speculation timing's result (``drafting.timing.run_speculation_bench``) as markdown: the baseline, every drafter
and k, the spread over passes, and the speed-ups predicted from measured costs (``drafting.prediction``) beside the
measured ones. Rendered from the result alone."""

from __future__ import annotations

from typing import Any


def results_markdown(result: dict[str, Any]) -> list[str]:
    """One engine run's tables: the baseline, every drafter and k, the spread over passes, the prediction."""
    base, exact = result["baseline"], result.get("exact_engine", True)
    sampled = bool(result.get("sampling"))
    lines = [f"Plain {'sampling' if sampled else 'greedy'} (same decode loop with no drafts, same run, alternated "
             f"per prompt): **{base['tokens_per_s']:.2f} tokens/s** ({base['tokens']} tokens; wall "
             f"{base['tokens_per_s_wall']:.2f}, CPU {base['tokens_per_s_cpu']:.2f} tokens/s)"
             + ("." if sampled else f"; the reference decode: {result['greedy_decode']['tokens_per_s']:.2f} "
                                    "tokens/s."), ""]
    if sampled:
        lines.append("Sampled outputs differ from run to run by design; the sampler's output distribution is "
                     "checked against plain sampling in tests/drafting/test_speculative_sampling.py. Acceptance = "
                     "drafted tokens kept by the probabilistic rule.")
    elif exact:
        lines.append(f"Output identical to plain greedy for every prompt, drafter and k: "
                     f"**{'yes' if result['lossless'] else 'NO (' + str(len(result['mismatches'])) + ' mismatches)'}"
                     "**.")
    else:
        runs = sum(1 for row in result["per_prompt"] for key in row["runs"] if key != "baseline")
        lines.append(f"Outputs equal to the engine's plain greedy: **{runs - len(result['mismatches'])} of {runs}** "
                     "runs. This engine computes a pass over several tokens with other kernels than a one-token pass "
                     "(by design), so where the top two tokens are close a verify pass may choose the other one; "
                     "where outputs part is in the JSON (`mismatches`: prompt, drafter, k, first differing token).")
        consistency = result.get("engine_consistency")
        if consistency:
            gap = consistency["median_top2_gap_where_differs"]
            lines.append(f"Measured on the plain greedy outputs themselves (teacher-forced): passes of "
                         f"{consistency['pass_tokens']} tokens, as a verify pass at the largest k, pick another argmax "
                         f"than the one-token passes at **{consistency['argmax_differs']} of "
                         f"{consistency['positions']}** positions; the logits differ by up to "
                         f"{consistency['max_logit_difference']:.2f} (largest logit {consistency['logit_scale']:.1f})"
                         + (f", and where the argmax differs the top two were {gap:.3f} apart (median)"
                            if gap is not None else "") + ".")
    lines += ["", "| drafter | k | tokens/s | speedup | predicted | speedup (wall) | speedup (CPU) | "
                  "accepted drafts/step | tokens/step | acceptance | draft time |" + ("" if exact else " = plain |"),
              "|---|---|---|---|---|---|---|---|---|---|---|" + ("" if exact else "---|")]
    for name, res in result["drafters"].items():
        for k, row in res["per_k"].items():
            mark = " **(best)**" if int(k) == res["best_k"] else ""
            predicted = row.get("predicted_speedup")
            lines.append(f"| {name} | {k}{mark} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}x | "
                         + (f"{predicted:.2f}x" if predicted is not None else "-")
                         + f" | {row['speedup_wall']:.2f}x | {row['speedup_cpu']:.2f}x | "
                         f"{row['accepted_per_step']:.2f} | {row['tokens_per_step']:.2f} | "
                         f"{row['acceptance_rate']:.2f} | {row['draft_time_share']:.0%} |"
                         + ("" if exact else f" {row.get('equal_to_plain_greedy', 0):.0%} |"))
    lines += ["", "accepted drafts/step = draft tokens kept per target verify pass; tokens/step adds the target's "
              "own token; acceptance = accepted / drafted; draft time = share of wall time spent drafting; "
              "predicted = the speed-up predicted from measured costs (below), before this table was measured."]
    for name, res in result["drafters"].items():
        shares = {k: row["lookup_step_share"] for k, row in res["per_k"].items() if "lookup_step_share" in row}
        if shares:
            lines.append(f"{name}: share of steps drafted by prompt lookup instead of the model: "
                         + ", ".join(f"k={k} {v:.0%}" for k, v in shares.items()) + ".")
    if result.get("repeats", 1) > 1:
        lines += ["", f"Speed-up in each of the {result['repeats']} passes over the prompts (each against the plain "
                      "greedy of the same pass): median and range, at each drafter's best k.", ""]
        for name, res in result["drafters"].items():
            row = res["per_k"][str(res["best_k"])]
            low, high = row["speedup_range"]
            lines.append(f"- {name} (k = {res['best_k']}): median {row['speedup_median']:.2f}x, range "
                         f"{low:.2f}x to {high:.2f}x")
    if result.get("prediction"):
        lines += [""] + prediction_markdown(result["prediction"])
    return lines


def prediction_markdown(prediction: dict[str, Any]) -> list[str]:
    """The predicted speed-ups beside the measured ones, the costs they come from, and the verdict."""
    costs = prediction["costs"]
    passes = ", ".join(f"{n}: {1000 * s:.1f} ms" for n, s in costs["pass_seconds"].items()
                       if int(n) in (1, 2, 3, 5, 9, 17) or n == max(costs["pass_seconds"], key=int))
    lines = ["### Predicted from measured costs", "",
             f"Target passes ({prediction['engine']}, median seconds by tokens in the pass) {passes}. "
             "speed-up(k) = E_k c_1 / (c_v(k+1) + c_d(k)): E_k tokens per step from the drafter's acceptance per "
             "position, c_d its draft seconds per step (a replay of the drafter over the target's greedy output), "
             "c_v the pass over the drafted tokens + 1 (drafting.prediction).", "",
             "| drafter | k | predicted | measured | predicted / measured | tokens/step | draft cost per token "
             "(target steps) | acceptance at positions 1, 2, 4, k |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in prediction["drafters"].items():
        for k, row in rows.items():
            acc = row["acceptance_per_position"]
            picks = ", ".join(f"{acc[i - 1]:.2f}" for i in sorted({1, 2, 4, int(k)}) if i <= len(acc))
            ratio = row.get("predicted_over_measured")
            lines.append(f"| {name} | {k} | {row['predicted_speedup']:.2f}x | {row.get('measured_speedup', 0):.2f}x | "
                         + (f"{ratio:.2f}" if ratio else "-") + f" | {row['tokens_per_step']:.2f} | "
                         f"{row['draft_cost_per_token_vs_target_step']:.2f} | {picks} |")
    lines += [""] + [f"- {line}" for line in prediction["verdict"]]
    return lines
