"""The demo's summary (``demo_summary.md``) rendered from its record (``demo_summary.json``): what the draft saw,
what each number means, the speed in each engine against its own baseline, a verdict computed from the figures,
the measured results of the larger budgets, and where the time went."""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.reports.eval import shortfall_words

# The measured results the summary quotes (bench/results/<name>.<cpu class>.json): what each budget reaches, and
# the speed in llama.cpp
REFERENCE_BENCHES = {"demo": "demo", "llama_cpp": "llamacpp_speed"}


def reference_results(folder: str | None) -> dict[str, list[dict]] | None:
    """The quoted results found in ``folder`` (``DemoConfig.reference_results``), by kind; None without one."""
    if not folder or not Path(folder).is_dir():
        return None
    out: dict[str, list[dict]] = {}
    for kind, bench in REFERENCE_BENCHES.items():
        out[kind] = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(folder).glob(f"{bench}.*.json"))]
    return out


def _where(result: dict) -> str:
    m = result["machine"]
    return f"{m['cpu']} (family {m['cpu_family']}, model {m['cpu_model']}, {m['cpu_class']}), {m['cpus']} cores"


def _budgets_reference(reference: dict | None) -> list[str]:
    results = (reference or {}).get("demo") or []
    if not results:
        return ["(No measured results beside this installation: see the repository's BENCHMARKS.md.)"]
    lines = ["| budget | machine | wall time with the install | accepted of 16: trained / lookup / self-draft | "
             "speed-up in specdraft's engine: trained / lookup / self-draft |", "|---|---|---:|---|---|"]
    for result in results:
        for name, row in result["figures"]["budgets"].items():
            acc, speed = row["accepted"], row.get("speedup_torch") or {}
            lines.append(f"| {name} | {_where(result)}, {result['date']} | {_fmt_seconds(row['wall_seconds'])} | "
                         f"{_fmt(acc.get('trained'), 2)} / {_fmt(acc.get('lookup'), 2)} / {_fmt(acc.get('self'), 2)} | "
                         + " / ".join(f"{_fmt(speed.get(k), 2)}x" for k in ("draft", "lookup", "self")) + " |")
    return lines


def _llama_cpp_reference(reference: dict | None) -> list[str]:
    results = (reference or {}).get("llama_cpp") or []
    if not results:
        return ["(No measured results beside this installation: see the repository's BENCHMARKS.md.)"]
    lines = []
    for result in results:
        fig = result["figures"]
        lines += [f"{_where(result)}, {result['date']}, llama.cpp's plain decoding of `{fig['target']}` at "
                  f"{fig['plain_tokens_per_s']} tokens/s (`{result['command']}`):", "",
                  "| drafter in llama.cpp | best k | speed-up, median (range) | predicted |", "|---|---:|---|---:|"]
        lines += [f"| {row['label']} | {row['best_k']} | {row['speedup']:.2f}x ({row['range'][0]:.2f}-"
                  f"{row['range'][1]:.2f}x) | {_fmt(row.get('predicted'), 2)}x |" for row in fig["drafters"]]
    return lines


def _label(spec: dict, name: str) -> str:
    return spec["drafters"][name].get("label", name)


def _engine_name(spec: dict) -> str:
    if spec["engine"] == "llama.cpp":
        return "llama.cpp"
    return f"specdraft's own engine ({spec['engine']}, {spec.get('target_dtype')} target)"


def _baseline_name(spec: dict) -> str:
    return "llama.cpp's plain decoding" if spec["engine"] == "llama.cpp" else "its own plain greedy decoding"


def _pays(row: dict, repeats: int) -> bool:
    """Faster than the engine's plain decoding: the median, and over several passes the whole range, above 1x."""
    if not (row.get("speedup_median") or 0) > 1:
        return False
    return repeats <= 1 or not row.get("speedup_range") or row["speedup_range"][0] > 1


def _passes(spec: dict) -> str:
    """Over how many passes a drafter was seen to beat plain decoding."""
    repeats = spec.get("repeats", 1)
    return f" in each of the {repeats} passes" if repeats > 1 else " in its one pass (the machine's noise not measured)"


def _speed_findings(spec: dict) -> list[str]:
    """The fastest drafter in one engine, and which drafters (if any) beat its plain decoding."""
    rows, engine, baseline = spec["drafters"], _engine_name(spec), _baseline_name(spec)
    name, best = max(rows.items(), key=lambda kv: kv[1]["speedup_median"] or 0)
    rng = best.get("speedup_range")
    lines = [f"Fastest in {engine}: the {_label(spec, name)}, {best['speedup_median']:.2f}x {baseline} (k = "
             f"{best['best_k']}" + (f", range {rng[0]:.2f}x to {rng[1]:.2f}x" if rng else "") + ")."]
    paying = [f"the {_label(spec, n)}" for n, r in rows.items() if _pays(r, spec.get("repeats", 1))]
    if paying:
        named = paying[0] if len(paying) == 1 else ", ".join(paying[:-1]) + " and " + paying[-1]
        lines.append(f"In {engine} {named} beat{'s' if len(paying) == 1 else ''} {baseline}{_passes(spec)}.")
    else:
        lines.append(f"In {engine} no drafter beats {baseline}{_passes(spec)}.")
    return lines


def _trained_against_lookup(spec: dict) -> list[str]:
    """The trained draft, alone and behind lookup, against prompt lookup in speed, and whether each difference is
    bigger than the spread over passes."""
    rows = spec["drafters"]
    if "lookup" not in rows:
        return []
    lk = rows["lookup"]
    lk_low, lk_high = lk["speedup_range"] or (None, None)
    spread = f" over {spec['repeats']} passes" if spec.get("repeats", 1) > 1 else ""
    lines = []
    for name in ("draft", "draft+lookup"):
        if name not in rows:
            continue
        t = rows[name]
        t_low, t_high = t["speedup_range"] or (None, None)
        overlap = t_low is not None and lk_low is not None and t_low <= lk_high and lk_low <= t_high
        compare = ("level with" if overlap else "faster than" if t["speedup_median"] > lk["speedup_median"]
                   else "slower than")
        lines.append(f"In {_engine_name(spec)} the {_label(spec, name)} ({t['speedup_median']:.2f}x) is {compare} "
                     f"prompt lookup ({lk['speedup_median']:.2f}x)"
                     + (f": their ranges{spread} overlap, so the difference is within the noise of "
                        f"{spec.get('prompts')} prompts" if overlap else "") + ".")
    return lines


def _llama_cpp_findings(spec: dict) -> list[str]:
    """What the llama.cpp run says beyond its speed-ups: whether any drafter can pay there, measured and
    predicted from its costs, and the target at full precision."""
    rows, lines = spec["drafters"], []
    measured = {n: r["speedup_median"] or 0 for n, r in rows.items()}
    predicted = {n: r["best_predicted_speedup"] for n, r in rows.items() if r.get("best_predicted_speedup")}
    if predicted:
        top_measured, top_predicted = max(measured, key=measured.get), max(predicted, key=predicted.get)
        if max(measured.values()) <= 1 and max(predicted.values()) <= 1:
            lines.append(f"In llama.cpp no drafter can pay on this machine: every drafter's best speed-up, measured "
                         f"and predicted from the measured costs, is at most 1x (best measured: the "
                         f"{_label(spec, top_measured)}, {measured[top_measured]:.2f}x; best predicted: the "
                         f"{_label(spec, top_predicted)}, {predicted[top_predicted]:.2f}x).")
        else:
            lines.append(f"In llama.cpp the measured costs predict the most from the {_label(spec, top_predicted)}: "
                         f"{predicted[top_predicted]:.2f}x (measured {measured[top_predicted]:.2f}x).")
    full = spec.get("full_precision")
    for name, row in (full or {}).get("drafters", {}).items():
        pays = _pays(row, full.get("repeats", 1))
        lines.append(f"Against the target at F32 in llama.cpp the {_label(full, name)} gives "
                     f"{row['speedup_median']:.2f}x llama.cpp's plain decoding of the F32 file: "
                     + (f"it pays{_passes(full)}." if pays else "it does not pay."))
    return lines


def _trained_draft_costs(spec: dict) -> list[str]:
    """Where the trained draft does not pay in an engine: whether its draft cost leaves it any room to (the most
    it could reach with every drafted token accepted), or its acceptance falls short."""
    row = spec["drafters"].get("draft")
    if not row or _pays(row, spec.get("repeats", 1)) or row.get("all_accepted_speedup") is None:
        return []
    cost = (f"a drafted token costs it {row['draft_cost_per_token']:.2f}x a target step, so with every token "
            f"accepted it would reach at most {row['all_accepted_speedup']:.2f}x")
    if row["all_accepted_speedup"] <= 1:
        return [f"In {_engine_name(spec)} the trained draft cannot pay whatever it accepts: {cost}. A draft pays "
                "where its tokens cost a small share of a target step: a draft much smaller than its target, the "
                "premise of the GPU reference pair (README.md)."]
    return [f"In {_engine_name(spec)} it is the trained draft's acceptance that falls short: {cost}, and it keeps "
            f"{_fmt(row['accepted_per_step'], 2)} drafted tokens per step."]


def verdict(summary: dict) -> list[str]:
    """The findings in plain words, computed from what was measured: the fastest drafter in each engine and
    whether any beats that engine's plain decoding, the trained draft against its init and against lookup (and
    whether a difference in speed is bigger than the spread over passes), and what llama.cpp's measured costs
    say can pay there."""
    acc, lines = summary["acceptance"], []
    trained, init, lookup = (acc.get(n, {}).get("mean_accepted_pooled") for n in ("trained", "init", "lookup"))
    if trained is not None and init is not None:
        lines.append(f"Training moved the draft from {init:.2f} to {trained:.2f} accepted tokens of 16 "
                     f"({trained - init:+.2f}); prompt lookup accepts {lookup:.2f}." if lookup is not None else
                     f"Training moved the draft from {init:.2f} to {trained:.2f} accepted tokens of 16.")
    lines += _mt_bench_finding(summary.get("mt_bench"))
    for spec in (summary.get("speculate"), summary.get("speculate_llama_cpp")):
        if spec and spec.get("drafters"):
            lines += _speed_findings(spec) + _trained_against_lookup(spec) + _trained_draft_costs(spec)
            if spec["engine"] == "llama.cpp":
                lines += _llama_cpp_findings(spec)
    return lines


def mt_bench_turns(section: dict) -> dict[int, dict[str, dict]]:
    """Per turn, over every MT-bench point: the trained draft's points and accepted tokens (``draft``) and, where the
    run recorded them, prompt lookup's (``lookup``)."""
    lookup = section.get("lookup_per_category") or {}
    return _turn_rows({c: {"draft": cell, **({"lookup": lookup[c]} if c in lookup else {})}
                       for c, cell in (section.get("per_category") or {}).items()}, section.get("categories") or {})


def _mt_bench_finding(section: dict | None) -> list[str]:
    """The trained draft against prompt lookup on MT-bench, per turn, over every point (none without lookup's)."""
    if not section or not section.get("lookup_per_category"):
        return []
    said = []
    for turn, cells in mt_bench_turns(section).items():
        if "lookup" not in cells:
            continue
        draft, lookup = (cells[k]["accepted_total"] / cells[k]["points"] if cells[k]["points"] else 0.0
                         for k in ("draft", "lookup"))
        side = "more than" if draft > lookup else "as much as" if draft == lookup else "less than"
        said.append(f"{side} prompt lookup on turn {turn} ({draft:.2f} against {lookup:.2f})")
    if not said:
        return []
    return [f"On MT-bench (never trained on), over every point, the trained draft accepts {', and '.join(said)}."]


def _speed_table(spec: dict) -> list[str]:
    """One engine's speed-ups: plain decoding first, then each drafter at its best k."""
    exact = spec.get("exact_engine", True)
    head = "| drafter | best k | speed-up (median) | range over passes | predicted | accepted per step |"
    rule = "|---|---|---|---|---|---|"
    if not exact:
        head, rule = head + " = plain greedy | what it is |", rule + "---|---|"
    lines = [head, rule, f"| {'plain decoding' if spec['engine'] == 'llama.cpp' else 'plain greedy'} | - | 1.00x "
                         f"({_fmt(spec.get('baseline_tokens_per_s'), 1)} tokens/s) | - | - | - |"
                         + ("" if exact else " - | - |")]
    for name, row in spec["drafters"].items():
        rng, predicted, equal = row.get("speedup_range"), row.get("predicted_speedup"), row.get("equal_to_plain_greedy")
        line = (f"| {_label(spec, name)} | {row['best_k']} | {_fmt(row['speedup_median'], 2)}x | "
                f"{f'{rng[0]:.2f}x to {rng[1]:.2f}x' if rng else '-'} | "
                f"{f'{predicted:.2f}x' if predicted is not None else '-'} | {_fmt(row['accepted_per_step'], 2)} |")
        if not exact:
            line += f" {f'{equal:.0%}' if equal is not None else '-'} | {row.get('description', '-')} |"
        lines.append(line)
    return lines


def _llama_cpp_section(summary: dict) -> list[str]:
    """Speed in llama.cpp: measured in this run, or quoted from the measured results with how to measure it here."""
    lines = ["## Speed in llama.cpp (the engine CPU users run)", ""]
    spec = summary.get("speculate_llama_cpp")
    if not spec:
        skipped = summary.get("llama_cpp_not_measured") or {}
        why = f"Not measured in this run: {skipped.get('why')}. {skipped.get('how')}."
        if not summary.get("embedded_target", True):
            return lines + [why]
        return lines + [why + " What it gave on a named machine (measured results):", ""] + _llama_cpp_reference(
            summary.get("reference"))
    target = Path(spec["target_file"]).name if spec.get("target_file") else "the target's GGUF file"
    threads = spec.get("threads")
    lines += [f"llama-cpp-python {spec.get('llama_cpp_python')}, the target's own file `{target}`, "
              f"{threads} thread{'' if threads == 1 else 's'}; {spec.get('prompts')} prompts x "
              f"{spec.get('max_new_tokens')} tokens, {spec.get('repeats', 1)} pass(es), {spec.get('clock')} clock. "
              "Speed-up = tokens/s over llama.cpp's plain decoding of the same file in the same run; predicted = "
              "from the target's measured pass costs and a replay of each drafter "
              "(`speculate_llama_cpp/speculate.md`); = plain greedy = the share of outputs equal to llama.cpp's "
              "plain decoding (its multi-token passes may round differently from its one-token passes, by design).",
              ""] + _speed_table(spec)
    full = spec.get("full_precision")
    if full:
        f32 = Path(full["target_file"]).name if full.get("target_file") else "F32"
        lines += ["", f"The target at full precision (`{f32}`, llama.cpp's quantize of its own file) against its "
                      "own 4-bit file as its draft, same prompts:", ""] + _speed_table(full)
    if spec.get("prediction_verdict"):
        lines += ["", "What the measured costs predict (`drafting.prediction`):", ""]
        lines += [f"- {line}" for line in spec["prediction_verdict"]]
    return lines


def summary_markdown(summary: dict) -> str:
    acc, spec, data = summary["acceptance"], summary["speculate"], summary.get("data") or {}
    temperatures = _temperature_columns(acc)
    dropped = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in sorted(data.get("prompts_dropped", {}).items()))
    lines = [f"# specdraft demo ({summary['budget']} budget) -- target {summary['target']}", "",
             "## What the draft saw", "",
             f"- Data: {data.get('prompts_kept')} prompts kept of {data.get('prompts_read')} read from "
             f"{data.get('corpora')} corpora ({summary['manifest']})" + (f"; dropped: {dropped}" if dropped else "")
             + ".",
             f"- Traces: the target's greedy answers to {data.get('traces')} of them "
             f"({data.get('trace_completion_tokens')} tokens); {data.get('train_examples')} trained on, "
             f"{data.get('heldout_examples')} held out to pick the best checkpoint.",
             f"- Training: {data.get('train_steps')} steps over {data.get('train_tokens')} tokens in "
             f"{_fmt_seconds(data.get('train_seconds'))}{_describe_resume(data)}; the draft starts as "
             f"{describe_init(summary)}.",
             f"- Evaluation: {data.get('eval_points')} points (a context and the target's next 16 tokens) from "
             f"{data.get('eval_prompts')} prompts of {summary['eval_set']['kind']} "
             f"({summary['eval_set']['path']}), never trained on.", "",
             "## Acceptance: how many of 16 drafted tokens the target keeps", "",
             "| drafter | accepted of 16 (pooled over points) | per-prompt mean | "
             + "".join(f"sampling at T = {key} | " for key in temperatures) + "what it is |",
             "|---|---|---|" + "---|" * len(temperatures) + "---|"]
    for name in ("init", "trained", "lookup", "trained_lookup", "self"):
        if name in acc:
            a = acc[name]
            what = a.get("description", "-")
            if name == "init" and not summary["draft_init"].startswith("truncate:"):
                what = f"the draft before training: `{summary['draft_init']}` as loaded"
            at = a.get("at_temperature") or {}
            lines.append(f"| {a.get('label', name)} | {_fmt(a.get('mean_accepted_pooled'), 2)} | "
                         f"{_fmt(a.get('mean_accepted_per_prompt'), 2)} | "
                         + "".join(f"{_fmt(at[key], 2) if key in at else '-'} | " for key in temperatures)
                         + f"{what} |")
    lines += ["", "Sampling at temperature T: the expected accepted length of speculative sampling (target and "
                  "draft warped alike), computed from their distributions along each point's greedy continuation "
                  "(`eval/*/report.md`); the trained draft's from the pack the server serves, loaded in process."]
    latency = summary.get("draft_latency") or {}
    lines += ["", "A 16-token draft over HTTP (eval clients, 8 concurrent): "
                  f"p50 {_fmt(latency.get('p50_ms'), 0)} ms, p99 {_fmt(latency.get('p99_ms'), 0)} ms."]
    lines += hybrid_rule_lines(summary.get("hybrid_rule"), "the evaluation set, the trained draft over HTTP")
    choices = summary.get("compute") or {}
    if choices:
        lines += ["", "Draft compute (`--compute auto` measures the formats on this CPU at load and keeps the "
                      "fastest for each step's work):", ""]
        lines += [f"- {where}: **{c['compute']}**" + (f", {c['prefill']} prefill" if c["compute"] == "int4" else "")
                  + f" ({c['reason']})" for where, c in choices.items()]
    lines += mt_bench_lines(summary.get("mt_bench"))
    lines += ["",
              f"## Speed in {_engine_name(spec)}, against its own plain greedy decoding", "",
              f"{spec.get('prompts')} prompts x {spec.get('max_new_tokens')} tokens, {spec.get('repeats', 1)} "
              f"pass(es), {spec.get('clock')} clock; every output equal to plain greedy: "
              f"{'yes' if spec.get('lossless') else 'NO'}. Speed-up = tokens/s over specdraft's plain greedy "
              "decoding of the same target in the same loop and run; the median and range are over the passes; "
              "predicted = from the target's measured pass costs and a replay of each drafter "
              "(`speculate/speculate.md`).", ""] + _speed_table(spec)
    lines += [""] + _llama_cpp_section(summary)
    lines += ["", "## Verdict", ""] + [f"- {line}" for line in verdict(summary)]
    if summary.get("embedded_target", True):
        lines += ["", "## What the larger budgets reach", "",
                  "`make demo BUDGET=default` or `BUDGET=full` (measured results, with their machine):", ""]
        lines += _budgets_reference(summary.get("reference"))
    self_pack = summary.get("pack_self") or {}
    lines += ["", "## Files and checks", "",
              f"Pack: {summary['pack']['bytes']} bytes, {summary['pack']['parameters']} parameters (self-draft: "
              f"{self_pack.get('bytes')} bytes, {self_pack.get('parameters')} parameters). "
              f"{_describe_export(summary.get('export'))}"
              f"Selfcheck exit {summary['selfcheck_exit']}, audit exit {summary['audit_exit']}. "
              f"Wall time: {_fmt_seconds(summary.get('wall_seconds'))}{_describe_earlier(summary)}."]
    lines += _stage_times(summary)
    return "\n".join(lines) + "\n"


# The measured hybrid rule's columns (``demo.pipeline.RULE_COLUMNS``) as the summary heads them
RULE_HEADINGS = {"draft_only": "trained draft", "lookup_alone": "prompt lookup", "fixed": "draft behind lookup, "
                 "the fixed rule", "chosen": "draft behind lookup, the chosen rule"}


def _mean(cell: dict) -> str:
    return f"{cell['accepted_total'] / cell['points']:.2f}" if cell.get("points") else "-"


def hybrid_rule_lines(rule: dict | None, where: str) -> list[str]:
    """One paragraph: the rule chosen on the calibration prompts, and each column on the other prompts."""
    if not rule:
        return []
    split, reported = rule["split"], rule.get("reported")
    line = (f"The hybrid's rule measured on {where}: chosen on {split['calibration']['points']} points of "
            f"{split['calibration']['prompts']} prompts (every other prompt of each category): "
            f"**{rule['chosen_words']}**.")
    if reported:
        overall = reported["overall"]
        line += (f" On the other {split['reported']['points']} points, accepted of 16: "
                 + ", ".join(f"{RULE_HEADINGS[name]} {_mean(cell)}" for name, cell in overall.items()) + ".")
        if rule.get("against_better"):
            line += " " + shortfall_words(rule["against_better"])
    else:
        line += " No prompt is left to report it on (every category has a single prompt here)."
    return ["", line]


def _turn_rows(groups: dict, categories: dict) -> dict[int, dict]:
    """Per-category cells (``{column: {points, accepted_total}}``) summed per turn, from the categories' turns."""
    turns: dict[int, dict] = {}
    for name, cells in groups.items():
        turn = (categories.get(name) or {}).get("turn")
        if turn is None:
            continue
        into = turns.setdefault(turn, {})
        for column, cell in cells.items():
            total = into.setdefault(column, {"points": 0, "accepted_total": 0})
            total["points"] += cell["points"]
            total["accepted_total"] += cell["accepted_total"]
    return dict(sorted(turns.items()))


def mt_bench_lines(section: dict | None) -> list[str]:
    """MT-bench's both turns: the trained draft over every point, and on the reported prompts the draft, lookup and
    the hybrid under the fixed and the chosen rule, per turn, category and context length."""
    if not section:
        return []
    lines = ["", "## MT-bench, both turns (the shared data's development set, never trained on)", ""]
    if section.get("unavailable"):
        why = section["unavailable"] or {}
        return lines + [f"Not measured in this run: {why.get('why')}. {why.get('how')}"]
    categories = section.get("categories") or {}
    turns = mt_bench_turns(section)
    lookup = section.get("lookup_per_category") or {}
    lookup_all = {"points": sum(c["points"] for c in lookup.values()),
                  "accepted_total": sum(c["accepted_total"] for c in lookup.values())}
    lines.append(f"{section['points']} points from {section['prompts']} prompts: the first turns, and the second "
                 "turns asked after the target's own greedy first answer (`mt_bench/`; "
                 "`eval_mt_bench/trained/report.md`). The trained draft over every point: "
                 f"{_fmt(section.get('mean_accepted_pooled'), 2)} accepted of 16"
                 + "".join(f", turn {t} {_mean(cells['draft'])}" for t, cells in turns.items()) + "."
                 + (f" Prompt lookup over every point: {_mean(lookup_all)}"
                    + "".join(f", turn {t} {_mean(cells['lookup'])}" for t, cells in turns.items() if "lookup" in cells)
                    + "."
                    if lookup else ""))
    rule = section.get("hybrid_rule")
    lines += hybrid_rule_lines(rule, "MT-bench")
    reported = (rule or {}).get("reported")
    if not reported:
        return lines
    header = ["| {what} | points | " + " | ".join(RULE_HEADINGS.values()) + " |", "|---|---:|" + "---:|" * 4]
    turns = {f"turn {t}": cells for t, cells in _turn_rows(reported["per_category"], categories).items()}
    tables = (("prompts", {**turns, **reported["per_category"]}), ("context", reported["per_context_length"]))
    for what, groups in tables:
        lines += ["", header[0].format(what=what), header[1]]
        lines += [f"| {name} | {cells['chosen']['points']} | " + " | ".join(_mean(cells[c]) for c in RULE_HEADINGS)
                  + " |" for name, cells in groups.items()]
    return lines


def _temperature_columns(acceptance: dict) -> list[str]:
    """The temperatures above 0 any drafter's acceptance was computed at (temperature 0 is the greedy column)."""
    keys = {key for row in acceptance.values() for key in (row.get("at_temperature") or {})}
    return sorted((k for k in keys if float(k) > 0), key=float)


def _stage_times(summary: dict) -> list[str]:
    """Each stage's seconds beside what the machine probe expected of it before the run (``demo.plan``)."""
    took, expected_plan = summary.get("stage_seconds") or {}, summary.get("plan") or {}
    expected = expected_plan.get("expected_seconds") or {}
    if not took:
        return []
    speed = expected_plan.get("speed_vs_reference")
    lines = ["", "## Where the time went", "",
             (f"Expected from a probe of this machine before the first stage (it ran the probe {speed:.2f}x as fast "
              f"as the reference, {expected_plan.get('reference_machine')}; `demo/plan.py`):" if speed else
              "No reference run to expect from."), "",
             "| stage | expected | took |", "|---|---:|---:|"]
    for stage in summary.get("stages") or list(took):
        if stage in took:
            lines.append(f"| {stage} | {_fmt_seconds(expected[stage]) if stage in expected else '-'} | "
                         f"{_fmt_seconds(took[stage])} |")
    return lines


def _describe_export(export: dict | None) -> str:
    if not export:
        return ""
    exact = ("every tensor holds the pack's values exactly" if export.get("exact") else
             f"{export.get('not_exact')} of {export.get('tensors')} tensors not exactly the pack's values")
    gguf = export.get("format", "gguf") == "gguf"
    engines = "GGUF for llama.cpp" if gguf else "Hugging Face dir for transformers / vLLM"
    return (f"{engines}: `{export.get('path')}`, {export.get('bytes')} bytes, {exact} "
            "(docs/exports.md). ")


def _describe_resume(data: dict) -> str:
    step = data.get("train_resumed_from_step")
    return f" over its sittings (resumed at step {step} after an interruption)" if step else ""


def _describe_earlier(summary: dict) -> str:
    earlier = summary.get("stages_done_earlier")
    if not earlier:
        return ""
    return (f" for this invocation, which skipped {len(earlier)} stages an earlier one finished "
            f"({', '.join(earlier)}; their times are in demo.log)")


def _fmt(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else str(x)


def describe_init(summary: dict) -> str:
    """``truncate:SPEC:0,1,...`` in words: how many of the target's layers the draft keeps, and which are frozen."""
    init, frozen = summary["draft_init"], summary.get("frozen_layers")
    if not init.startswith("truncate:"):
        return init
    layers = init.rpartition(":")[2].split(",")
    kept = f"the target's first {layers[0]} layers" if len(layers) == 1 else f"{len(layers)} of the target's layers"
    return kept + (f", the first {frozen} of them frozen" if frozen else "")


def _fmt_seconds(x) -> str:
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x:.0f} s" if x < 120 else f"{x / 60:.1f} min"
