"""The eval report rendered from its record (``report.json``): ``report.md`` and its PNG plots.

`specdraft eval` computes and writes the record; everything a reader sees is made here from it, so a report can be
rendered again from its JSON alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from specdraft.core import plots
from specdraft.drafting.hybrid_rule import AGAINST_BETTER, against_better_groups
from specdraft.drafting.metrics import MIN_INTERVAL_PROMPTS


def report_markdown(report: Mapping[str, Any], title: str = "Draft acceptance") -> str:
    k = report["k"]
    lines = [f"# {title}: {report['drafter']}", "",
             f"{report['points']} evaluation points from {report['prompts']} prompts, k = {k}.", "",
             "| metric | value |", "|---|---|",
             f"| mean accepted length, pooled over points (of {k}) | {report['mean_accepted_pooled']:.3f} |",
             f"| mean accepted length, per-prompt mean (of {k}) | {report['mean_accepted_per_prompt']:.3f} |",
             f"| tokens per verify step (1 + pooled mean) | {report['tokens_per_verify_step']:.3f} |",
             f"| P(all {k} accepted) | {report['cumulative_acceptance'][-1]:.3f} |"]
    hybrid = report.get("hybrid")
    if hybrid:
        lines.append(f"| points drafted by prompt lookup (last {hybrid['min_ngram']}+ tokens seen before) / by "
                     f"the model | {hybrid['lookup_points']} / {hybrid['model_points']} |")
    lat = report.get("latency") or {}
    pressure = report.get("backpressure") or {}
    if pressure.get("retries"):
        lines.append(f"| requests the server refused (503) and the client sent again after its Retry-After | "
                     f"{pressure['retries']} ({pressure['waited_s']:.1f} s waited; concurrency down to "
                     f"{pressure['concurrency_lowest']} of {pressure['concurrency']}) |")
    if lat.get("calls"):
        lines += [f"| latency p50 per {lat['unit']} | {lat['p50_ms']:.1f} ms |",
                  f"| latency p99 per {lat['unit']} | {lat['p99_ms']:.1f} ms |"]
    choice = compute_choice_of(report.get("drafter_source") or {})
    if choice:
        lines += ["", f"Draft compute: **{choice['compute']}** ({choice['reason']})."]
    lines += ["", f"_{report['means_note']}_", "",
              "## Per position", "",
              "| position | cumulative P(1..i accepted) | conditional P(i \\| < i) |", "|---|---|---|"]
    support = report.get("conditional_support") or [1] * k
    for i, (cum, cond, n) in enumerate(zip(report["cumulative_acceptance"], report["conditional_acceptance"],
                                           support), 1):
        lines.append(f"| {i} | {cum:.3f} | {f'{cond:.3f} (n={n})' if n else '— (no point got here)'} |")
    lines += ["", "## Accepted length histogram", "", "| accepted | points |", "|---|---|"]
    lines += [f"| {a} | {n} |" for a, n in enumerate(report["histogram"])]
    lines += group_markdown("Per category", "category", report["per_category"], k)
    lines += group_markdown("Per context length (tokens of the context)", "context", report.get("per_context_length"),
                            k)
    lines += hybrid_rule_markdown(report.get("hybrid_rule"), k)
    lines += temperature_markdown(report.get("acceptance_at_temperature"))
    plots = report.get("plots") or []
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def group_markdown(title: str, what: str, groups: Mapping[str, Mapping[str, Any]] | None, k: int) -> list[str]:
    """One table of per-group figures (a category, a context-length bucket); older records lack some columns."""
    if not groups:
        return []
    lines = ["", f"## {title}", "",
             f"| {what} | points | prompts | accepted (sum) | mean accepted, pooled (of {k}) | per-prompt mean |",
             "|---|---|---|---|---|---|"]
    for name, row in groups.items():
        lines.append(f"| {name} | {row['points']} | {row.get('prompts', '-')} | {row.get('accepted_total', '-')} | "
                     f"{row['mean_accepted']:.3f} | {_num(row.get('mean_accepted_per_prompt'))} |")
    return lines


def _num(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


# The columns a hybrid-rule table shows: (the record's key, the heading)
RULE_COLUMNS = (("draft_only", "the model only"), ("lookup_alone", "lookup alone"))


def hybrid_rule_markdown(section: Mapping[str, Any] | None, k: int) -> list[str]:
    """The measured hybrid rule: the rule chosen on the calibration prompts, every candidate there, and the
    reported prompts per category and context length (the model alone, lookup alone, the fixed rule, the chosen, and
    the better of the two at each point: how far the chosen is from what any choice between them could accept)."""
    if not section:
        return []
    split, candidates = section["split"], section["candidates"]
    fixed = section["fixed"]
    lines = ["", "## When lookup drafts in front of the model: the rule measured", "",
             f"Chosen on {split['calibration']['points']} points of {split['calibration']['prompts']} prompts: "
             f"**{section['chosen_words']}**. Reported below on the other {split['reported']['points']} points of "
             f"{split['reported']['prompts']} prompts. _{split['how']}_", "",
             f"| candidate | on the calibration prompts, mean accepted (of {k}) |", "|---|---|"]
    calibration = section["calibration"]["overall"]
    lines += [f"| {c['label']} | {calibration[key]['mean_accepted']:.3f} |" for key, c in candidates.items()]
    reported = section.get("reported")
    if not reported:
        return lines + ["", "(No reported prompts: every category has one prompt.)"]
    columns = [*RULE_COLUMNS, (fixed, candidates[fixed]["label"]), ("chosen", "the chosen rule")]
    if section.get("ceiling"):  # older records lack it
        columns.append((section["ceiling"]["key"], "the better of the two per point (a ceiling for any rule)"))
    against = AGAINST_BETTER in reported["overall"]  # older records lack it
    header = ["| {what} | points | " + " | ".join(h for _, h in columns)
              + (" | the chosen rule minus the better of the model and lookup (90% interval over prompts)"
                 if against else "") + " |",
              "|---|---|" + "---|" * (len(columns) + against)]

    def rows(groups: Mapping[str, Mapping[str, Any]]) -> list[str]:
        return [f"| {name} | {row['chosen']['points']} | "
                + " | ".join(f"{row[key]['mean_accepted']:.3f}" for key, _ in columns)
                + (f" | {against_better_words(row[AGAINST_BETTER])}" if against else "") + " |"
                for name, row in groups.items()]
    lines += ["", f"On the reported prompts, mean accepted (of {k}):", "",
              header[0].format(what="category"), header[1]]
    lines += rows({"all": reported["overall"], **reported["per_category"]})
    lines += ["", header[0].format(what="context"), header[1]] + rows(reported["per_context_length"])
    if against:
        lines += ["", shortfall_words(against_better_groups(reported))]
    return lines


def against_better_words(cell: Mapping[str, Any]) -> str:
    low, high = cell["interval_90"]
    better = "lookup" if cell["better"] == "lookup_alone" else "model"
    interval = (f"{low:+.2f} to {high:+.2f}" if cell["prompts"] >= MIN_INTERVAL_PROMPTS
                else f"{cell['prompts']} prompt(s): no interval")
    return f"{cell['difference']:+.2f} ({interval}) against {better}" + (" **below**" if cell["below"] else "")


def shortfall_words(groups: Mapping[str, Mapping[str, Any]]) -> str:
    """From each reported group's ``against_better`` cell (categories and context lengths): in how many the chosen
    rule accepts less than the better of the model alone and lookup alone, and in how many the whole 90% interval is
    below (beyond the noise of their few prompts)."""
    short = [name for name, cell in groups.items() if cell["difference"] < 0]
    below = [name for name, cell in groups.items() if cell["below"]]
    few = sum(cell["prompts"] < MIN_INTERVAL_PROMPTS for cell in groups.values())
    return (f"The chosen rule accepts less than the better of the model alone and lookup alone in {len(short)} of "
            f"{len(groups)} groups (categories and context lengths); beyond its 90% interval over prompts in "
            f"{len(below)}" + (f": {', '.join(below)}" if below else "")
            + (f" ({few} of the groups {'has' if few == 1 else 'have'} fewer than {MIN_INTERVAL_PROMPTS} reported "
               "prompts: no interval)." if few else "."))


def compute_words(choice: Mapping[str, Any] | None) -> str:
    if not choice:
        return "unknown"
    return choice["compute"] + (f" (prefill {choice['prefill']})" if choice["compute"] == "int4" else "")


def compute_choice_of(source: Mapping[str, Any]) -> dict[str, Any] | None:
    """The compute a drafter's model ran in and why (``model.loader.resolve_compute``), from its source record: in
    process, behind lookup, or the server's own (its /health)."""
    if source.get("kind") == "hybrid":
        return compute_choice_of(source.get("model") or {})
    return source.get("compute_choice")


def temperature_markdown(section: Mapping[str, Any] | None) -> list[str]:
    """The acceptance-at-temperature tables: pooled per temperature, then per position."""
    if not section:
        return []
    skipped = section.get("skipped")
    if skipped:
        return ["", "## Acceptance at temperature", "",
                f"Not computed (temperatures {', '.join(f'{t:g}' for t in skipped['temperatures'])}): "
                f"{skipped['why']}."]
    k, rows = section["k"], section["temperatures"]
    source = section.get("draft_distributions") or {}
    lines = ["", "## Acceptance at temperature (expected, from distributions)", "",
             f"top-p {section['top_p']:g}, top-k {section['top_k']} for target and draft alike."
             + (f" {source['note']}." if source.get("note") else ""), "",
             f"| temperature | expected accepted, pooled (of {k}) | per-prompt mean | P(all {k} accepted) |",
             "|---|---|---|---|"]
    for key, row in rows.items():
        lines.append(f"| {key} | {row['mean_expected_accepted_pooled']:.3f} | "
                     f"{row['mean_expected_accepted_per_prompt']:.3f} | "
                     f"{row['expected_cumulative_acceptance'][-1]:.3f} |")
    lines += ["", "Expected P(tokens 1..i all accepted) per position:", "",
              "| position | " + " | ".join(f"T = {key}" for key in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for i in range(k):
        lines.append(f"| {i + 1} | " + " | ".join(f"{row['expected_cumulative_acceptance'][i]:.3f}"
                                                 for row in rows.values()) + " |")
    lines += ["", f"_{section['what']}_"]
    return lines


def write_plots(report: Mapping[str, Any], out: Path) -> list[str]:
    name = report["drafter"]
    files = [
        plots.plot_acceptance_per_position(report["cumulative_acceptance"], report["conditional_acceptance"],
                                           out / "acceptance_per_position.png",
                                           f"acceptance per position: {name}",
                                           support=report.get("conditional_support")),
        plots.plot_histogram(report["histogram"], out / "accepted_length_histogram.png",
                             f"accepted length (of {report['k']}): {name}"),
        plots.plot_bars({c: r["mean_accepted"] for c, r in report["per_category"].items()},
                        out / "acceptance_per_category.png", ylabel=f"mean accepted length (of {report['k']})",
                        title=f"per category: {name}",
                        annotate={c: f"{r['mean_accepted']:.2f} (n={r['points']})"
                                  for c, r in report["per_category"].items()}),
        ]
    lengths = report.get("per_context_length") or {}
    if lengths:
        files.append(plots.plot_bars({c: r["mean_accepted"] for c, r in lengths.items()},
                                     out / "acceptance_per_context_length.png",
                                     ylabel=f"mean accepted length (of {report['k']})",
                                     title=f"per context length (tokens): {name}",
                                     annotate={c: f"{r['mean_accepted']:.2f} (n={r['points']})"
                                               for c, r in lengths.items()}))
    section = report.get("acceptance_at_temperature") or {"temperatures": {}}
    for key, row in section["temperatures"].items():
        if row["temperature"] > 0:  # temperature 0 is the greedy plot above
            files.append(plots.plot_acceptance_per_position(
                row["expected_cumulative_acceptance"], row["expected_conditional_acceptance"],
                out / f"acceptance_per_position_T{key}.png",
                f"expected acceptance per position at temperature {key}: {name}"))
    return [p.name for p in files]
