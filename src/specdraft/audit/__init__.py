"""`specdraft audit RUN_DIR`: prove where every artifact of a run came from, or name the link that breaks.

The audit reads a run directory (``specdraft.core.layout``; each path can be overridden), re-derives what it can
(hashes, counts, token ids, tensor names and shapes, n-gram overlap, greedy argmax) and compares it with what
each stage recorded. Every finding cites the file and the field it rests on. It writes ``RUN_DIR/audit/audit.md``
and ``audit.json`` and exits 1 when any finding fails (warnings do not).

One module per link, each independent of the others, in the order they run: ``data`` (manifest pins, splits,
sources, 13-gram contamination of prompts, completions *and* the labelled reference answers trained on against
the evaluation prompts), ``traces`` (declared target, greedy, counts, hashes, ids), ``training`` (init model,
tensor names/shapes, traces hash, teacher-forced labels re-scored), ``pack`` (weight file bytes/sha256 against
architecture.json and the recipe, recipe source against the checkpoint, the draft's generation config), ``export``
(each record in RUN_DIR/export/: the exported file's sha256, a GGUF file's tensor names and types from its own
header, the source sha256 against the run's models), ``serve`` (model dir contents, strict
load, and -- optional -- the server run in a ``sandbox`` that blocks and records outgoing connections and records
every file it opens; it may read only the model dir, Python code and package metadata, and its own temp files).
``context`` holds what they share, ``models`` the model checks both traces and training make, ``report`` the
rendering.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from specdraft.audit.config import AuditConfig
from specdraft.audit.context import AuditContext, Finding
from specdraft.audit.data import audit_data
from specdraft.audit.export import audit_export
from specdraft.audit.pack import audit_pack
from specdraft.audit.report import AuditReport, write_report
from specdraft.audit.serve import audit_serve
from specdraft.audit.traces import audit_traces
from specdraft.audit.training import audit_training
from specdraft.core.provenance import stage_log

__all__ = ["AuditConfig", "AuditReport", "Finding", "audit_run", "check_run", "run_audit"]

log = logging.getLogger(__name__)

LINKS = (("data", audit_data), ("traces", audit_traces), ("training", audit_training), ("pack", audit_pack),
         ("export", audit_export), ("serve", audit_serve))


def check_run(cfg: AuditConfig) -> AuditReport:
    """Every link in order, each guarded (an error in one is a failed finding, the next still runs)."""
    ctx = AuditContext(cfg)
    for section, link in LINKS:
        ctx.section = section
        t = time.time()
        ctx.guard(section, partial(link, ctx))
        if section == "training":
            ctx.release_rescoring_model()  # traces and training were its only users; free it before serving
        ctx.facts.setdefault("seconds", {})[section] = round(time.time() - t, 2)
    return AuditReport(ctx.run_dir, ctx.findings, ctx.paths.out, ctx.facts)


def audit_run(cfg: AuditConfig) -> AuditReport:
    """The checks without the exit code (tests and programmatic use); also writes audit.md / audit.json."""
    paths = cfg.run_paths()
    if not paths.run_dir.is_dir():
        raise FileNotFoundError(f"run dir {paths.run_dir}: no such directory")
    paths.out.mkdir(parents=True, exist_ok=True)
    with stage_log(paths.out / "audit.log", "specdraft"):
        report = check_run(cfg)
        md, js = write_report(report, cfg)
        c = report.counts()
        log.info("audit %s: %d failed, %d warnings, %d passed, %d skipped; wrote %s and %s",
                 "passed" if report.passed else "FAILED", c["fail"], c["warn"], c["pass"], c["skip"], md, js)
    return report


def run_audit(cfg: AuditConfig) -> int:
    """`specdraft audit RUN_DIR`: 0 when every check passes (warnings allowed), 1 on any failure, 2 on no run dir."""
    try:
        report = audit_run(cfg)
    except FileNotFoundError as e:
        log.error("%s", e)
        return 2
    c = report.counts()
    print(f"audit {'PASSED' if report.passed else 'FAILED'}: {c['fail']} failed, {c['warn']} warnings, "
          f"{c['pass']} passed, {c['skip']} skipped -> {report.out_dir / 'audit.md'}")
    for f in report.failed:
        print(f"  FAIL {f.section}/{f.check}: {f.message}")
    return 0 if report.passed else 1
