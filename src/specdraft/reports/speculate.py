"""The speculate report rendered from its record (``speculate.json``): ``speculate.md``.

`specdraft speculate` measures and writes the record; the words and tables a reader sees are made here from it
(each engine run's tables by ``drafting.timing_report``), so the report can be rendered again from its JSON alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdraft.drafting.calibration import DEFAULT_DRAFT_CONFIDENCE
from specdraft.drafting.timing_report import results_markdown


def _draft_compute_text(report: dict[str, Any]) -> str:
    """What the in-process drafts computed in and why (``auto``: measured at load), from their source records."""
    cfg = report["config"]
    choices = [source.get("compute_choice") for source in (report.get("drafter_sources") or {}).values()
               if source.get("kind") == "in-process"]
    said = sorted({f"{c['compute']} ({c['reason']})" for c in choices if c})
    return "; ".join(said) if said else str(cfg["draft_compute"])


def _stop_rule_text(cfg: dict[str, Any]) -> str:
    """The in-process drafts' stop rule as a clause of the report's first line ('' when they always draft k)."""
    rule, threshold = cfg.get("draft_stop"), cfg.get("draft_confidence")
    if rule is None:  # a report from before the calibrated rule: its threshold alone, null meaning always k
        rule, threshold = "probability", threshold or 0.0

    def clause(rule: str) -> str:
        t = DEFAULT_DRAFT_CONFIDENCE[rule] if threshold is None else threshold
        if rule == "calibrated":
            return f"once the estimated probability that all of it is accepted (calibrated during the run) is < {t}"
        return f"after a token it gives p < {t}"

    if threshold == 0:
        return ""
    if rule == "both":
        return f"; an in-process draft stops a step's draft {clause('calibrated')} ('-prob': {clause('probability')})"
    return f"; an in-process draft stops a step's draft {clause(rule)}"


def speculate_markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    llama = cfg.get("engine") == "llama.cpp"
    if llama:
        header = ["# Speculative decoding in llama.cpp (greedy, batch 1)", "",
                  f"Target `{(report.get('target') or {}).get('gguf', cfg['target'])}` "
                  f"in llama.cpp (llama-cpp-python {report.get('llama_cpp_python')}), draft `{cfg['draft']}`, "
                  f"{report['prompts']} prompts, max {cfg['max_new_tokens']} new tokens, {report['threads']} threads. "
                  "Baseline: llama.cpp's own plain decoding of the same file (one token per pass), in the same run.",
                  ""]
    elif report.get("sampling"):
        sampling = report["sampling"]
        header = [f"# Speculative sampling (temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, "
                  f"top-k {sampling['top_k']}, batch 1)", "",
                  f"Target `{cfg['target']}`, draft `{cfg['draft']}`, {report['prompts']} prompts, "
                  f"max {cfg['max_new_tokens']} new tokens, target dtype {cfg['dtype']}, "
                  f"draft compute {_draft_compute_text(report)}, torch threads {report['threads']}; "
                  f"seed {sampling['seed']}. "
                  "Every drafter's tokens are drawn from its own distribution under the same settings as the "
                  "target's; each is kept with probability min(1, p/q), a refused one replaced from "
                  "max(0, p - q): the output is distributed as plain sampling from the target.", "",
                  "Baseline: specdraft's own engine (torch) sampling the target plainly, one forward per token, in "
                  f"the same run (target dtype {cfg['dtype']}).", ""]
    else:
        header = ["# Speculative decoding (greedy, lossless, batch 1)", "",
                  f"Target `{cfg['target']}`, draft `{cfg['draft']}`, {report['prompts']} prompts, "
                  f"max {cfg['max_new_tokens']} new tokens, target dtype {cfg['dtype']}, "
                  f"draft compute {_draft_compute_text(report)}, torch threads {report['threads']}"
                  + _stop_rule_text(cfg)
                  + ("; its decode steps compiled (torch.compile)" if cfg.get("draft_compile", "off") != "off"
                     and cfg.get("draft_lean") != "off" else "") + ".", "",
                  "Baseline: specdraft's own engine (torch) decoding the target plainly, in the same run "
                  f"(target dtype {cfg['dtype']}).", ""]
    lines = header + [
        f"Clock: **{report['clock']}** (tokens/s, speedup and best k use it; the other is in the JSON"
        + ("; CPU time = this process's CPU seconds, at 1 thread immune to other processes' load"
           if report["clock"] == "cpu" else "") + ").", ""]
    lines += results_markdown(report)
    full = report.get("full_precision")
    if full:
        lines += ["", "## Full-precision target", "",
                  f"The target at F32 (`{Path(full['target']['gguf']).name}`, llama.cpp's quantize of "
                  f"`{Path(full['target']['from']).name}`) against its own 4-bit file as its draft, same prompts "
                  "and k; the baseline is llama.cpp's plain decoding of the F32 file.", ""]
        lines += results_markdown(full)
    for name, error in report.get("compile_errors", {}).items():
        lines.append(f"{name}: torch.compile failed ({error}); its steps ran eagerly.")
    if report.get("plot"):
        lines += ["", f"![tokens/s per k]({report['plot']})"]
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"
