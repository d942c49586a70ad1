"""The audit's verdict and its two renderings: audit.json (every finding, the facts re-derived, the config and
the run metadata) and audit.md (counts per section, the failures first, then every finding with what it rests
on)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.audit.config import AuditConfig
from specdraft.audit.context import SECTIONS, STATUSES, Finding
from specdraft.core.io import atomic_write_json, atomic_write_text
from specdraft.core.provenance import run_metadata


@dataclass
class AuditReport:
    run_dir: Path
    findings: list[Finding]
    out_dir: Path
    facts: dict[str, Any]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail"]

    @property
    def passed(self) -> bool:
        return not self.failed

    def counts(self, section: str | None = None) -> dict[str, int]:
        c = Counter(f.status for f in self.findings if section is None or f.section == section)
        return {s: c.get(s, 0) for s in STATUSES}

    def by_check(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]


def render_markdown(report: AuditReport, cfg: AuditConfig, meta: dict[str, Any]) -> str:
    c = report.counts()
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# specdraft audit: `{report.run_dir}`", "",
             f"**{verdict}**: {c['fail']} failed, {c['warn']} warnings, {c['pass']} passed, {c['skip']} skipped "
             f"({meta.get('created_at')}, specdraft git {meta.get('git_sha')}).", "",
             "Each finding cites the file (relative to the run dir) and the field it rests on.", "",
             "| section | pass | fail | warn | skip |", "|---|---:|---:|---:|---:|"]
    for s in SECTIONS:
        sc = report.counts(s)
        lines.append(f"| {s} | {sc['pass']} | {sc['fail']} | {sc['warn']} | {sc['skip']} |")
    if report.failed:
        lines += ["", "## Failures", ""]
        lines += [f"- **{f.section} / {f.check}**: {f.message}" for f in report.failed]
    for s in SECTIONS:
        lines += ["", f"## {s}", ""]
        for f in (f for f in report.findings if f.section == s):
            cites = "; ".join(f"`{x['file']}`" + (f" → `{x['field']}`" if x["field"] else " (whole file)")
                              for x in f.cites)
            lines.append(f"- {f.status.upper()} **{f.check}**: {f.message}"
                         + (f"  \n  rests on: {cites}" if cites else ""))
            lines += [f"  - {d}" for d in f.details]
    return "\n".join(lines) + "\n"


def write_report(report: AuditReport, cfg: AuditConfig) -> tuple[Path, Path]:
    meta = run_metadata()
    out = report.out_dir
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "run_dir": str(report.run_dir),
        "passed": report.passed,
        "counts": report.counts(),
        "sections": {s: report.counts(s) for s in SECTIONS},
        "findings": [f.to_json() for f in report.findings],
        "facts": report.facts,
        "config": cfg.to_json_dict(),
        **meta,
    }
    json_path, md_path = out / "audit.json", out / "audit.md"
    atomic_write_json(json_path, data)
    atomic_write_text(md_path, render_markdown(report, cfg, meta))
    return md_path, json_path
