"""The figures README.md and BENCHMARKS.md quote, rendered from the measured results (``bench/results/*.json``): one
source per figure.

  .venv/bin/python bench/report.py            # rewrite the generated blocks of README.md and BENCHMARKS.md
  .venv/bin/python bench/report.py --check    # exit 1 when a block differs from what the results say (a test runs it)

A generated block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; everything outside the blocks is
written by hand (method, commands, what a figure means) and quotes no figure.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CLASS_NAMES = {"avx2": "AVX2 only", "avx512": "AVX-512", "avx512-bf16": "AVX-512 + bf16", "amx": "AMX"}


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def machine(result: dict[str, Any], cores: bool = True) -> str:
    m = result["machine"]
    emulated = m.get("avx2_emulation")
    return (f"{m['cpu']} family {m['cpu_family']} model {m['cpu_model']} "
            f"({CLASS_NAMES.get(m['cpu_class_native'] if emulated else m['cpu_class'])}"
            + (", AVX2 emulated" if emulated else "") + ")" + (f", {m['cpus']} cores" if cores else ""))


def where(result: dict[str, Any], date: str) -> str:
    """A summary row's machine and date (the cores are the same everywhere: the table of machines above)."""
    return f"{machine(result, cores=False)}, {date}"


def x(value: float) -> str:
    return f"{value:.2f}×"


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 1200 else (f"{seconds / 60:.1f} min" if seconds < 7200
                                                      else f"{seconds / 3600:.1f} h")


# ------------------------------------------------------------------------------------------ README

def readme_results() -> str:
    """README's results table: acceptance per budget, speed per engine with its baseline, the demo's wall time."""
    fast, avx2 = load("demo.avx512-bf16"), load("demo.avx2")
    llama, peers = load("llamacpp_speed.avx512-bf16"), load("server_peers.avx512-bf16")
    b = fast["figures"]["budgets"]
    small2 = avx2["figures"]["budgets"]["small"]
    rows = [("trained draft (24 of the target's 30 layers, 4-bit pack)", "trained"),
            ("prompt lookup (no model)", "lookup"),
            ("trained draft behind prompt lookup", "trained_lookup"),
            ("self-draft: the target's own weights at 4 bits, untrained", "self")]
    lines = ["| accepted of 16 greedy draft tokens | `small` | `default` | `full` |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {small2['accepted'][key]:.2f} | {b['default']['accepted'][key]:.2f} | "
              f"{b['full']['accepted'][key]:.2f} |" for label, key in rows]
    # the small budget on all 80 questions, its hybrid rule chosen as eval chooses it now (AVX-512's small pack)
    mt_result = load("mt_bench_demo_small.avx512-bf16")
    mt = mt_result["figures"]
    hybrid = _per_turn(mt["hybrid_rule"]["reported"]["per_category"])
    default_mt = b["default"].get("mt_bench")  # its demo's own evaluation, where it had MT-bench
    # the default demo's pack on its demo's own MT-bench points, its rule chosen as eval chooses it now
    default_hybrid = _per_turn(load("mt_bench_demo_default.avx512-bf16")["figures"]["hybrid_rule"]["reported"]
                               ["per_category"])
    lines += ["", f"| MT-bench, all {mt['questions']} questions, both turns (never trained on), turn 1 / turn 2 | "
              "`small` | `default` |", "|---|---:|---:|"]
    lines += [f"| {label}, every point | {mt[key]['turn1']['mean']:.2f} / {mt[key]['turn2']['mean']:.2f} | "
              + (f"{default_mt[row]['turn1']:.2f} / {default_mt[row]['turn2']:.2f} |" if default_mt else "— |")
              for label, key, row in (("trained draft", "draft", "trained"),
                                      ("prompt lookup (no model)", "lookup", "lookup"))]
    for label, column in (("on the half of the prompts the hybrid's rule was not chosen on: trained draft",
                           "draft_only"), ("there: prompt lookup", "lookup_alone"),
                          ("there: trained draft behind lookup, its rule measured on the other half", "chosen")):
        lines.append(f"| {label} | {_turns(hybrid, column)} | {_turns(default_hybrid, column)} |")
    torch_full = b["full"]["speedup_torch"]
    best = max(llama["figures"]["drafters"][:-1], key=lambda r: r["speedup"])  # the last row is the F32 target's
    trained = next(r for r in llama["figures"]["drafters"] if r["name"] == "draft")
    clients = peers["figures"]["clients"]["4"]
    lines += ["", "| speed, each against its baseline on the same machine | |", "|---|---:|",
              f"| specdraft's engine (torch, float32 target) against its own plain greedy, `full`: self-draft / "
              f"trained draft / prompt lookup | {x(torch_full['self'])} / {x(torch_full['draft'])} / "
              f"{x(torch_full['lookup'])} |",
              f"| llama.cpp against its plain decoding of the Q4_1 target ({llama['figures']['plain_tokens_per_s']} "
              f"tokens/s): best drafter ({best['label'].split(' (')[0]}, k = {best['best_k']}) / trained draft | "
              f"{x(best['speedup'])} / {x(trained['speedup'])} |",
              f"| `specdraft serve` against `llama-server`, the same draft, 4 clients: answered/s | "
              f"{x(clients['ratio'])} |",
              *_readme_loop_rows(),
              f"| `make demo` (small), the install included: AVX-512 + bf16 / AVX2-only EPYC | "
              f"{minutes(b['small']['wall_seconds'])} / {minutes(small2['wall_seconds'])} |",
              "",
              f"Measured on an {machine(fast)} ({_date_range([r['date'] for r in b.values()])}); "
              f"`small` and the AVX2 figures on an {machine(avx2)} ({small2['date']}). Acceptance is on the packaged "
              "held-out set: "
              f"{small2['eval_points']}, {b['default']['eval_points']} and {b['full']['eval_points']} points. "
              f"MT-bench: `small` by `bench/bench_mt_bench.py` with the "
              f"{CLASS_NAMES[mt_result['machine']['cpu_class']]} EPYC's own `small` draft ({mt['points']} points, "
              f"{mt['scored_tokens']} target tokens scored after each turn, {mt_result['date']})"
              + (f", `default` by its demo ({default_mt['points']} points, {default_mt['scored_tokens']} tokens; its "
                 "hybrid by `bench/bench_mt_bench.py --validation` on those points)." if default_mt else ".")]
    return "\n".join(lines)


def _turns(per_turn: dict[str, dict[str, float]], column: str) -> str:
    return f"{per_turn['turn1'][column]:.2f} / {per_turn['turn2'][column]:.2f}"


def _date_range(dates: list[str]) -> str:
    first, last = min(dates), max(dates)
    return first if first == last else f"{first} to {last}"


def _per_turn(per_category: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """A rule table's columns per turn ("turn1/writing" -> "turn1"): mean accepted over the turn's points."""
    totals: dict[str, dict[str, list[float]]] = {}
    for category, cells in per_category.items():
        for column, cell in cells.items():
            if "points" not in cell:  # against_better: a difference, not a column of accepted lengths
                continue
            total = totals.setdefault(category.split("/")[0], {}).setdefault(column, [0, 0])
            total[0] += cell["points"]
            total[1] += cell["accepted_total"]
    return {turn: {column: accepted / points for column, (points, accepted) in columns.items()}
            for turn, columns in totals.items()}


# The CPU classes README's loop rows name, in order, with the words it names them by
README_LOOP_CLASSES = (("avx2", "an AVX2-only EPYC"), ("avx512-bf16", "an AVX-512 + bf16 EPYC"))


def _readme_loop_rows() -> list[str]:
    """The loop rows: each engine's server time per generated token against llama-server's, per CPU class measured,
    and what auto picks."""
    classes = [(cls, name) for cls, name in README_LOOP_CLASSES if (RESULTS / f"server_loop_demo.{cls}.json").is_file()]
    levels = {cls: load(f"server_loop_demo.{cls}")["figures"]["levels"] for cls, _ in classes}
    loops = " / ".join(str(lv["loops"]) for lv in levels[classes[0][0]])
    picks = {cls: set(load(f"engine_choice.{cls}")["figures"]["picks"]) for cls, _ in classes
             if (RESULTS / f"engine_choice.{cls}.json").is_file()}
    llama = "llama.cpp engine" + (" (what `--engine auto` picks on each, given `--gguf`)"
                                  if picks and all(p == {"llama.cpp"} for p in picks.values()) else "")
    labels = {"reuse": f"`specdraft serve` in a speculation loop, time per generated token against `llama-server` with "
                       f"its prompt cache (below 1: cheaper), {loops} loop(s), on "
                       + "; on ".join(name for _, name in classes) + ": torch engine",
              "llama_engine": f"the same, {llama}",
              f"llama_engine_stop_{LOOP_STOP}": f"the same, llama.cpp engine, drafts that stop below confidence "
                                                f"{LOOP_STOP} (`stop_confidence`)"}
    rows = [f"| {label} | " + "; ".join(" / ".join(x(_loop_ratio(lv, name, "llama_server")) for lv in levels[cls])
                                        for cls, _ in classes) + " |"
            for name, label in labels.items()]
    # whole conversations: the second turn's context extends what the server saw in the first (where measured)
    for cls, name in README_LOOP_CLASSES:
        if (RESULTS / f"server_loop_demo_conversation.{cls}.json").is_file():
            conversation = load(f"server_loop_demo_conversation.{cls}")
            level = conversation["figures"]["levels"][0]
            count = f"{level['loops']} loop" + ("s" if level["loops"] != 1 else "")
            rows.append(f"| the same over whole MT-bench conversations (both turns in one loop), {count}, on {name} "
                        f"({conversation['date']}): "
                        f"llama.cpp engine / drafts that stop below confidence {LOOP_STOP} | "
                        f"{x(_loop_ratio(level, 'llama_engine', 'llama_server'))} / "
                        f"{x(_loop_ratio(level, f'llama_engine_stop_{LOOP_STOP}', 'llama_server'))} |")
    return rows


def readme_demo_time() -> str:
    """The set-up line's time for `make demo`, per CPU class measured."""
    fast, avx2 = load("demo.avx512-bf16"), load("demo.avx2")
    small, small2 = fast["figures"]["budgets"]["small"], avx2["figures"]["budgets"]["small"]
    return (f"about {small['wall_seconds'] / 60:.0f} min on an AVX-512 + bf16 EPYC and "
            f"{small2['wall_seconds'] / 60:.0f} min on an AVX2-only EPYC, the install included.")


# ---------------------------------------------------------------------------------------- BENCHMARKS

def summary_rows() -> list[tuple[str, str, str, str]]:
    """(what, figure, machine, source) for BENCHMARKS.md's summary table, one per current figure."""
    rows: list[tuple[str, str, str, str]] = []
    for path in sorted(RESULTS.glob("demo.*.json")):
        result = json.loads(path.read_text())
        for budget, r in result["figures"]["budgets"].items():
            acc, speed = r["accepted"], r["speedup_torch"]
            rows.append((f"`make demo BUDGET={budget}`: wall time" + (" with the install" if r["wall_includes_install"]
                                                                      else ""),
                         minutes(r["wall_seconds"]) + (f" ({r['wall_note']})" if r.get("wall_note") else ""),
                         where(result, r['date']), path.name))
            rows.append((f"`{budget}`: accepted of 16, trained / behind lookup / lookup / self-draft / untrained "
                         f"({r['eval_points']} points of {r['eval_set']})",
                         " / ".join(f"{acc[k]:.2f}" for k in ("trained", "trained_lookup", "lookup", "self", "init")),
                         where(result, r['date']), path.name))
            if result["machine"].get("avx2_emulation"):  # a check that the emulation holds: the rest is the class's
                continue
            if r.get("mt_bench"):
                mt = r["mt_bench"]
                rows.append((f"`{budget}`: MT-bench both turns ({mt['points']} points, never trained on), accepted of "
                             "16, trained / lookup (turn 1; turn 2)",
                             "; ".join(f"{mt['trained'][t]:.2f} / {mt['lookup'][t]:.2f}" for t in ("turn1", "turn2")),
                             where(result, r['date']), path.name))
            if r.get("accepted_at_temperature"):
                rows.append((f"`{budget}`: expected accepted under sampling, trained / lookup (T 0.7; T 1.0)",
                             "; ".join(f"{t['trained']:.2f} / {t['lookup']:.2f}"
                                       for t in r["accepted_at_temperature"].values()),
                             where(result, r['date']), path.name))
            rows.append((f"`{budget}`: speed-up in specdraft's engine against its float32 greedy, self-draft / "
                         "trained / lookup", " / ".join(x(speed[k]) for k in ("self", "draft", "lookup")),
                         where(result, r['date']), path.name))
    llama = load("llamacpp_speed.avx512-bf16")
    for r in llama["figures"]["drafters"]:
        rows.append((f"llama.cpp, {r['label']}, against llama.cpp's plain decoding (best k = {r['best_k']})",
                     f"{x(r['speedup'])} ({r['range'][0]:.2f}–{r['range'][1]:.2f}×), predicted {x(r['predicted'])}",
                     where(llama, llama['date']), "llamacpp_speed.avx512-bf16.json"))
    peers = load("server_peers.avx512-bf16")
    clients = peers["figures"]["clients"]
    rows.append((f"`specdraft serve` / `llama-server` answered/s (ours / theirs; p99 ours / theirs), "
                 f"{' / '.join(clients)} clients",
                 "; ".join(f"{x(c['ratio'])} ({c['specdraft_answered_per_s']} / {c['llama_server_answered_per_s']}; "
                           f"{c['p99_s'][0]} s / {c['p99_s'][1]} s)" for c in clients.values()),
                 where(peers, peers['date']), "server_peers.avx512-bf16.json"))
    for path in sorted(RESULTS.glob("compute.*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        auto = fig["formats"]["auto (default)"]["served"]
        rows.append(("`specdraft serve --compute auto`: its pick; its `/draft` answer against the fastest explicit "
                     "format's, 64 / 256 / 1,024 tokens",
                     f"{auto['compute']}" + (f" ({auto['prefill']} prefill)" if auto["compute"] == "int4" else "")
                     + "; " + " / ".join(x(v) for v in fig["auto_vs_fastest_explicit"].values()),
                     where(result, result['date']), path.name))
    for path in sorted(RESULTS.glob("mt_bench_*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        draft, lookup = fig["draft"], fig["lookup"]
        reported = fig["hybrid_rule"]["reported"]["overall"]
        rows.append((f"`{fig['model_dir']}` on MT-bench ({fig['points']} points), accepted of 16: trained / lookup, "
                     "turn 1; turn 2; hybrid / trained / lookup where its rule was not chosen",
                     f"{draft['turn1']['mean']:.2f} / {lookup['turn1']['mean']:.2f}; "
                     f"{draft['turn2']['mean']:.2f} / {lookup['turn2']['mean']:.2f}; "
                     + " / ".join(f"{reported[k]['mean_accepted']:.2f}" for k in ("chosen", "draft_only",
                                                                                  "lookup_alone")),
                     where(result, result['date']), path.name))
    for path in sorted(RESULTS.glob("engine_choice.*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        picks = ", ".join(f"{name} {n} of {fig['repeats']}" for name, n in fig["picks"].items())
        rows.append(("`specdraft serve --gguf` (`--engine auto`): what it picks, and its replayed loop's cost, torch "
                     "against llama.cpp", f"{picks}; {x(fig['torch_loop_vs_llama_cpp'])}",
                     where(result, result['date']), path.name))
    for path in sorted(RESULTS.glob("llamacpp_rows.*.json")):
        result = json.loads(path.read_text())
        against = result["figures"]["against_single_passes"]
        sizes = [n for n in against["sequences"] if n != "1"]
        rows.append((f"llama.cpp, a `llama_decode` of the draft carrying {' / '.join(sizes)} tokens against as many "
                     "one-token passes: one token per sequence (the server's step); of one sequence",
                     "; ".join(" / ".join(x(against[kind][n]) for n in sizes)
                               for kind in ("sequences", "one_sequence")),
                     where(result, result['date']), path.name))
    for path in sorted(RESULTS.glob("trace_backends.*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        ratios = " / ".join(x(t["best_llama_cpp_by_cpu_time"]["vs_hf"]) for t in fig["by_threads"])
        threads = " / ".join(str(t["threads"]) for t in fig["by_threads"])
        agree = _llama_cpp_agreement(fig)
        converted = {dtype: [next(r for r in t["runs"] if r.get("weights") == dtype) for t in fig["by_threads"]]
                     for dtype in _converted_runs(fig)}
        hf = [next(r for r in t["runs"] if r["backend"] == "hf") for t in fig["by_threads"]]
        rows.append((f"`specdraft traces --backend llama.cpp` against `--backend hf`: tokens per CPU-second at "
                     f"{threads} thread(s); prompts whose {fig['max_new_tokens']} greedy tokens are the torch "
                     "target's" + "".join(f"; the same with the file's weights as {dtype}" for dtype in converted),
                     f"{ratios}; {agree['identical_prompts']} of {agree['prompts']}" + "".join(
                         f"; {' / '.join(x(r['tokens_per_cpu_s'] / h['tokens_per_cpu_s']) for r, h in zip(runs, hf))}"
                         f"; {runs[0]['vs_hf']['identical_prompts']} of {runs[0]['vs_hf']['prompts']}"
                         for runs in converted.values()),
                     where(result, result['date']), path.name))
        sharded = _sharded_hf(fig)
        if sharded:
            one, many = sharded
            rows.append((f"`specdraft traces` (hf) as {many['processes']} one-thread processes (`--shard "
                         f"i/{many['processes']}`) against one process of {many['processes']} threads: tokens per "
                         "second; per CPU-second; the same tokens",
                         f"{x(many['tokens_per_s'] / one['tokens_per_s'])}; "
                         f"{x(many['tokens_per_cpu_s'] / one['tokens_per_cpu_s'])}; "
                         f"{'yes' if many['identical_to_hf'] else 'no'}", where(result, result['date']), path.name))
    for path in sorted(RESULTS.glob("multiturn_data.*.json")):
        result = json.loads(path.read_text())
        variants = result["figures"]["variants"]
        turn2 = {name: v["accepted"]["mt_bench"]["turn2"] for name, v in variants.items()}
        rows.append((f"training rows of other kinds (`specdraft conversations`), small recipe: MT-bench turn 2 "
                     f"accepted of 16, {' / '.join(turn2)} / prompt lookup",
                     " / ".join(f"{r['draft']:.2f}" for r in turn2.values())
                     + f" / {next(iter(turn2.values()))['lookup']:.2f}", where(result, result['date']),
                     path.name))
    for path in sorted(RESULTS.glob("server_loop*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        levels = fig["levels"]
        base, compared = _loop_settings(fig)
        if levels[-1]["loops"] >= SOAK_LOOPS:  # a soak: many loops within a cache budget, each setting's memory
            last = levels[-1]
            rows.append((f"`specdraft serve` soak, {last['loops']} speculation loops ({_loop_draft(fig)}, "
                         f"{_loop_prompts(fig)}): server ms per generated token, p99 per call, prefix cache peak / "
                         "budget, server peak RSS, 503s waited out",
                         "; ".join(f"{_loop_setting_label(name)}: {last[name]['ms_per_token']:.0f} ms, "
                                   f"{last[name]['p99_ms'] / 1000:.1f} s, {last[name]['cache_peak_mb']:.1f} / "
                                   f"{last[name]['cache_budget_mb']:.0f} MB, {last[name]['rss_mb_peak']:.0f} MB, "
                                   f"{last[name].get('refused_503', 0)}" for name in [base] + compared),
                         where(result, result['date']), path.name))
            continue
        # one row per result: what each engine costs against llama-server's (or the baseline's) prompt cache, and
        # what reuse saves; BENCHMARKS.md's loop tables hold every setting
        peer = "llama_server" if "llama_server" in compared else base
        against_peer = [n for n in [base] + compared if n != peer and "no_reuse" not in n]
        with_reuse = {n: "llama_engine" if n.startswith("llama_engine") else base
                      for n in compared if n.endswith("no_reuse")}
        with_reuse.update({n: n.removeprefix("no_reuse_") for n in compared
                           if n.startswith("no_reuse_stop_")})
        without = [(n, b) for n, b in with_reuse.items() if b in [base] + compared]
        loops = " / ".join(f"{lv['loops']}" for lv in levels)
        figure = (f"against {_loop_setting_label(peer)}: "
                  + ", ".join(f"{_loop_short_label(n)} " + " / ".join(x(_loop_ratio(lv, n, peer)) for lv in levels)
                              for n in against_peer)
                  + "".join(f"; {_loop_short_label(n)}, without reuse against "
                            "with: " + " / ".join(x(_loop_ratio(lv, n, b)) for lv in levels) for n, b in without))
        if fig.get("turn") == "conversation" and peer == "llama_server":  # the second turn after the first, not cold
            figure += "".join(f"; the second turn's tokens alone, {_loop_short_label(n)}: " + " / ".join(
                x(lv[n]["by_turn"]["2"]["ms_per_token"] / lv[peer]["by_turn"]["2"]["ms_per_token"]) for lv in levels)
                for n in against_peer if n.startswith("llama_engine_stop_"))
        rows.append((f"`specdraft serve` in a speculation loop ({_loop_draft(fig)}, {_loop_prompts(fig)}): time "
                     f"per generated token, {loops} loop(s)", figure,
                     where(result, result['date']), path.name))
    return rows


def _llama_cpp_agreement(fig: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's greedy tokens on the GGUF file against the hf backend's (the same prompts: every thread count
    agrees)."""
    return next(r["vs_hf"] for r in fig["by_threads"][0]["runs"] if r["backend"] == "llama.cpp" and "weights" not in r)


SOAK_LOOPS = 16  # a loop result of this many loops is a soak (bench/bench_server_loop.py --loops 16)
LOOP_STOP = "0.4"  # the stop_confidence README quotes (bench/bench_server_loop.py --stop-confidence)
# a loop result's settings (bench/bench_server_loop.py): the baseline first, then each compared with it
LOOP_SETTINGS = {"no_reuse": "torch, no reuse", "reuse": "torch, reuse", "full": "torch, reuse, full drafts",
                 "llama_engine": "llama.cpp, reuse", "llama_engine_no_reuse": "llama.cpp, no reuse",
                 "llama_server": "llama-server, cache_prompt"}


def _loop_settings(fig: dict[str, Any]) -> tuple[str, list[str]]:
    """(the baseline setting, the settings compared with it) of a loop result: prefix reuse with full drafts (named
    ``full`` in results where every setting reused) is the baseline; a result of one setting (a soak) has only it."""
    level = fig["levels"][0]
    settings = [k for k, v in level.items() if isinstance(v, dict) and "calls" in v]
    base = next((k for k in ("reuse", "full") if k in settings), settings[0])
    return base, [k for k in settings if k != base]


def _loop_ratio(level: dict[str, Any], name: str, base: str) -> float:
    """A setting's server time per generated token over the baseline's (above 1: it costs more)."""
    return level[name]["ms_per_token"] / level[base]["ms_per_token"]


def _loop_setting_label(name: str) -> str:
    if name.startswith("no_reuse_stop_"):
        return f"torch, no reuse, stop {name.removeprefix('no_reuse_stop_')}"
    if name.startswith("stop_"):
        return f"torch, stop {name.removeprefix('stop_')}"
    if name.startswith("llama_engine_stop_"):
        return f"llama.cpp, stop {name.removeprefix('llama_engine_stop_')}"
    if name.startswith("guided_"):
        return f"torch, guided {name.removeprefix('guided_')}"
    if name.startswith("llama_engine_guided_"):
        return f"llama.cpp, guided {name.removeprefix('llama_engine_guided_')}"
    return LOOP_SETTINGS.get(name, name)


def _loop_short_label(name: str) -> str:
    """A setting in a few words: its engine, and where it ends drafts early."""
    engine = "llama.cpp engine" if name.startswith("llama_engine") else "torch engine"
    stop = name.rsplit("stop_", 1)[1] if "stop_" in name else None
    guided = name.rsplit("guided_", 1)[1] if "guided_" in name else None
    return engine + (f" stopping below {stop}" if stop else "") + (f" guided by lookup ({guided})" if guided else "")


def _loop_draft(fig: dict[str, Any]) -> str:
    if fig["draft"].startswith("stand-in"):
        return "a 6-layer stand-in draft"
    return "the target packed as its own draft" if "target-packed" in fig["draft_dir"] else fig["draft"]


def _loop_prompts(fig: dict[str, Any]) -> str:
    if fig.get("turn") == "conversation":
        return (f"MT-bench conversations, both turns in one loop, the first answer's {fig['first_answer_tokens']} "
                f"tokens generated through it, then {fig['new_tokens']} of the second")
    turn = "second turns after the target's first answers" if fig.get("turn") == 2 else "first turns"
    return f"MT-bench {turn}, {fig['mean_prompt_tokens']:.0f}-token prompts"


def benchmarks_summary() -> str:
    lines = ["| what | figure | machine, date | result |", "|---|---|---|---|"]
    lines += [f"| {what} | {figure} | {where} | [{src}](bench/results/{src}) |"
              for what, figure, where, src in summary_rows()]
    return "\n".join(lines)


def compute_tables() -> str:
    """Per CPU class: each compute format's decode step, prefills and `/draft` answers, and what auto picks."""
    out: list[str] = []
    results = {path: json.loads(path.read_text()) for path in sorted(RESULTS.glob("compute.*.json"))}
    for path, result in results.items():
        if result["machine"].get("avx2_emulation"):  # in the check below and the summary
            continue
        fig = result["figures"]
        out += [f"**{CLASS_NAMES.get(result['machine']['cpu_class'])}**: {machine(result)}, {result['date']}, "
                f"`{result['command']}` ([{path.name}](bench/results/{path.name})).", "",
                "| compute | decode step at 256 tokens | prefill 64 / 256 / 1,024 tokens | `/draft` answer, 64 / 256 / "
                "1,024 tokens |", "|---|---:|---:|---:|"]
        for name, row in fig["formats"].items():
            p, s = row["in_process"], row["served"]
            label = name if not name.startswith("auto") else f"{name}: {s['compute']}" + (
                f", {s['prefill']} prefill" if s["compute"] == "int4" else "")
            out.append(f"| {label} | {1000 * p['decode_step_256_s']:.0f} ms | "
                       + " / ".join(f"{1000 * p[f'prefill_{n}_s']:.0f}" for n in (64, 256, 1024)) + " ms | "
                       + " / ".join(f"{s[f'answer_{n}_s']:.2f}" for n in (64, 256, 1024)) + " s |")
        out += ["", "`auto` against the fastest explicit format, per context length: "
                + ", ".join(f"{n} tokens {x(r)}" for n, r in fig["auto_vs_fastest_explicit"].items()) + ".", ""]
    if len(results) > 1:
        out += ["What sets the classes apart, and whether the AVX2 emulation reproduces it:", "",
                "| machine | bf16 prefill / float32 prefill, 64 / 256 / 1,024 tokens | `auto` serves |",
                "|---|---:|---|"]
        for path, result in results.items():
            formats = result["figures"]["formats"]
            s = formats["auto (default)"]["served"]
            ratios = [formats["bfloat16"]["in_process"][f"prefill_{n}_s"]
                      / formats["float32"]["in_process"][f"prefill_{n}_s"] for n in (64, 256, 1024)]
            out.append(f"| {machine(result)} ([{path.name}](bench/results/{path.name})) | "
                       f"{' / '.join(x(r) for r in ratios)} | {s['compute']}"
                       + (f", {s['prefill']} prefill" if s["compute"] == "int4" else "") + " |")
    return "\n".join(out).rstrip() if out else "(no compute results yet: `bench/bench_compute.py`)"


def trace_backend_tables() -> str:
    """Per machine: the traces stage's backends, tokens per CPU-second and per second, and llama.cpp's agreement."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("trace_backends.*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        out += [f"{machine(result)}, {result['date']}, `{result['command']}` "
                f"([{path.name}](bench/results/{path.name})): {fig['num_prompts']} prompts "
                f"({fig['prompt_tokens']['median']} tokens median), "
                f"{fig['max_new_tokens']} new tokens each, median of {fig['repeats']} runs.", "",
                "| threads | backend | tokens per CPU-second | tokens/s | against hf per CPU-second |",
                "|---:|---|---:|---:|---:|"]
        for t in fig["by_threads"]:
            hf = next(r for r in t["runs"] if r["backend"] == "hf")
            for r in t["runs"]:
                label = r["backend"] + (f" on the file's weights as {r['weights']}" if "weights" in r else "") + (
                    f", {r['sequences']} sequences" if "sequences" in r else f", batch {r['batch_size']}") + (
                    f", {r['processes']} one-thread processes (`--shard i/{r['processes']}`)" if "processes" in r
                    else "")
                out.append(f"| {t['threads']} | {label} | {r['tokens_per_cpu_s']:.1f} | {r['tokens_per_s']:.1f} | "
                           f"{x(r['tokens_per_cpu_s'] / hf['tokens_per_cpu_s'])} |")
        agree = _llama_cpp_agreement(fig)
        first = agree["first_difference"]
        notes = [f"llama.cpp's greedy tokens against the torch target's: {agree['identical_prompts']} of "
                 f"{agree['prompts']} prompts identical over {fig['max_new_tokens']} tokens, the first difference at "
                 f"token {first['median']:g} (median; quartiles {first['p25']:g}–{first['p75']:g}), at the first "
                 f"token for {first['first_token_differs']} prompts."]
        converted = [f"as {dtype}, {r['vs_hf']['identical_prompts']} of {r['vs_hf']['prompts']}"
                     for dtype, r in _converted_runs(fig).items()]
        if converted:
            notes.append("On the file's weights converted by llama.cpp's quantiser, prompts identical to the torch "
                         f"target's: {'; '.join(converted)}.")
        sharded = _sharded_hf(fig)
        if sharded:
            same = "the same" if sharded[1]["identical_to_hf"] else "other"
            notes.append(f"hf in one-thread processes decodes {same} tokens as hf in one process.")
        out += ["", *notes, ""]
    return "\n".join(out).rstrip() if out else "(no trace backend results yet: `bench/bench_trace_backends.py`)"


def _sharded_hf(fig: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(hf in one process, hf in one-thread processes) at the same thread count, where a result has them."""
    for t in fig["by_threads"]:
        hf = [r for r in t["runs"] if r["backend"] == "hf"]
        if len(hf) == 2:
            return hf[0], hf[1]
    return None


def _converted_runs(fig: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The llama.cpp runs on the GGUF's weights converted to another type, by type (the first thread count's)."""
    return {r["weights"]: r for r in fig["by_threads"][0]["runs"] if "weights" in r}


def server_loop_tables() -> str:
    """Per loop result: each setting's server time per generated token against the result's baseline setting (a
    soak's figures, and second turns', are their summary rows)."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("server_loop*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        if fig["levels"][-1]["loops"] >= SOAK_LOOPS or fig.get("turn") in (2, "conversation"):
            continue
        base, compared = _loop_settings(fig)
        draft = _loop_draft(fig)
        named = f"**{draft}**" if draft == fig["draft"] else f"**{draft}** ({fig['draft']})"
        out += [f"{named}, {machine(result)}, {result['date']}, `{result['command']}`"
                f" ([{path.name}](bench/results/{path.name})): {fig['prompts']}, {fig['new_tokens']} target tokens "
                f"a prompt, {fig['prompts_per_loop']} prompts a loop, compute `{' '.join(fig['compute'])}`.", "",
                "| loops | setting | calls | accepted / drafted per call | server ms per generated token | against "
                f"{_loop_setting_label(base)} | p50 / p99 per call | peak RSS | prefix cache peak / budget "
                "| drafts as the baseline's |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in fig["levels"]:
            for name in [base] + compared:
                r = lv[name]
                drafted = f"{r['mean_drafted']:.2f}" if "mean_drafted" in r else str(fig["num_draft"])
                ratio = x(_loop_ratio(lv, name, base))
                agreement = (lv.get(f"{name}_agreement") or lv.get("agreement")) if name != base else None
                against = (agreement or {}).get("against", base)
                same = ("—" if agreement is None else
                        f"{100 * agreement.get('identical_drafts', agreement.get('prefix_of_full', 0)):.0f}% "
                        + ("identical" if "identical_drafts" in agreement else "a prefix")
                        + ("" if against == base else f" of the {_loop_short_label(against)}'s"))
                cache = (f"{r['cache_peak_mb']:.1f} / {r['cache_budget_mb']:.0f} MB" if r.get("cache_budget_mb")
                         else "—")
                out.append(f"| {lv['loops']} | {_loop_setting_label(name)} | {r['calls']} | "
                           f"{r['mean_accepted']:.2f} / {drafted} | {r['ms_per_token']:.0f} | {ratio} | "
                           f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} ms | {r['rss_mb_peak']:.0f} MB | {cache} | {same} |")
        out.append("")
    return "\n".join(out).rstrip() if out else "(no loop results yet: `bench/bench_server_loop.py`)"


MULTITURN_SETS = (("heldout", "all", "packaged held-out, all"), ("mt_bench", "turn1", "MT-bench turn 1"),
                  ("mt_bench", "turn2", "MT-bench turn 2"))


def multiturn_tables() -> str:
    """Training rows of other kinds against the same number of single-turn rows: acceptance per evaluation set."""
    out: list[str] = []
    for path in sorted(RESULTS.glob("multiturn_data.*.json")):
        result = json.loads(path.read_text())
        fig = result["figures"]
        recipe, variants = fig["recipe"], fig["variants"]
        names = list(variants)
        out += [f"{machine(result)}, {result['date']}, `{result['command']}` "
                f"([{path.name}](bench/results/{path.name})): {recipe['rows']} training rows of "
                f"{recipe['trace_tokens']} tokens, {recipe['first_turns']} "
                f"single-turn rows in every variant and {recipe['new_rows']} of the variant's kind; one training "
                "run each.", "",
                "| evaluation set (points) | " + " | ".join(names) + " | prompt lookup |",
                "|---|" + "---:|" * (len(names) + 1)]
        for group, key, label in MULTITURN_SETS:
            base = variants[names[0]]["accepted"][group][key]
            cells = []
            for name in names:
                row = variants[name]["accepted"][group][key]
                paired = (variants[name].get("paired_vs_baseline") or {}).get(group, {}).get(key)
                cells.append(f"{row['draft']:.2f}" + (f" ({paired['difference']:+.2f}, "
                                                      f"{paired['interval_90'][0]:+.2f} to "
                                                      f"{paired['interval_90'][1]:+.2f})" if paired else ""))
            out.append(f"| {label} ({base['points']}) | " + " | ".join(cells) + f" | {base['lookup']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip() if out else "(no training-data results yet: `bench/bench_multiturn_data.py`)"


def _rule_words(chosen: dict[str, Any]) -> str:
    threshold, own, ratio = chosen["min_match"], chosen.get("per_category") or {}, chosen.get("guide_min_ratio")
    lookup = f"lookup's copies as the draft's guides (ratio {ratio:g})" if ratio else "lookup"
    return (("the draft everywhere" if threshold is None else f"{lookup} where its match >= {threshold}")
            + ("".join(f", {c} {'the draft' if t is None else f'>= {t}'}" for c, t in sorted(own.items()))
               if len(own) <= 2 else f", {len(own)} categories a threshold of their own"))


def mt_bench_tables() -> str:
    """Every MT-bench result in one table (a column each: the draft and lookup over every point per turn and
    category), each result's hybrid rule and what it accepts on the prompts it was not chosen on."""
    results = [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob("mt_bench_*.json"))]
    if not results:
        return "(no MT-bench results yet: `bench/bench_mt_bench.py`)"
    out: list[str] = []
    for n, (path, result) in enumerate(results, 1):
        fig = result["figures"]
        rule, reported = fig["hybrid_rule"], fig["hybrid_rule"]["reported"]["overall"]
        draft, lookup, hybrid = (reported[k]["mean_accepted"] for k in ("draft_only", "lookup_alone", "chosen"))
        out.append(f"{n}. {machine(result)}, {result['date']}, `{result['command']}` "
                   f"([{path.name}](bench/results/{path.name})): {fig['questions']} questions, "
                   f"{fig['points']} points. The hybrid's rule, chosen on {rule['split']['calibration']['points']} "
                   f"points: {_rule_words(rule['chosen'])}; on the other {rule['split']['reported']['points']}: draft "
                   f"{draft:.2f}, lookup {lookup:.2f}, hybrid {hybrid:.2f}.")
    out += ["", "| prompts | points | " + " | ".join(f"{n}: trained / lookup"
                                                    for n in range(1, len(results) + 1)) + " |",
            "|---|---:|" + "---:|" * len(results)]
    first = results[0][1]["figures"]
    for name in first["draft"]:
        counts = sorted({r["figures"]["draft"][name]["points"] for _, r in results}, key=lambda n: -n)
        out.append(f"| {name} | {' / '.join(map(str, counts))} | " + " | ".join(
            f"{r['figures']['draft'][name]['mean']:.2f} / {r['figures']['lookup'][name]['mean']:.2f}"
            for _, r in results) + " |")
    return "\n".join(out)


BLOCKS: dict[Path, dict[str, Callable[[], str]]] = {
    ROOT / "README.md": {"demo-time": readme_demo_time, "results": readme_results},
    ROOT / "BENCHMARKS.md": {"summary": benchmarks_summary, "compute": compute_tables,
                             "trace-backends": trace_backend_tables, "server-loop": server_loop_tables,
                             "multiturn-data": multiturn_tables, "mt-bench": mt_bench_tables},
}


def render(text: str, blocks: dict[str, Callable[[], str]], path: Path) -> str:
    for name, make in blocks.items():
        pattern = re.compile(rf"(<!-- {name}:begin[^>]*-->\n)(?:.*?\n)?(<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path}: no <!-- {name}:begin --> ... <!-- {name}:end --> block")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args(argv)
    stale = []
    for path, blocks in BLOCKS.items():
        text = path.read_text(encoding="utf-8")
        new = render(text, blocks, path)
        if new == text:
            continue
        if args.check:
            stale.append(path.name)
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), str(path),
                                                       "rendered from bench/results"))
        else:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote the generated blocks of {path.name}")
    if stale:
        print(f"\n{', '.join(stale)}: a quoted figure differs from bench/results; run bench/report.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
