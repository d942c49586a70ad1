"""Record a finished demo: its figures as a measured result, and (a small budget run in one sitting) the reference the
demo's machine probe scales from.

  .venv/bin/python bench/demo_results.py runs/demo --wall-with-install 806 [--reference]

Reads the run's ``demo_summary.json``: acceptance per drafter, the speed-ups in specdraft's engine, the wall time,
and each stage's seconds. Writes its budget's row into ``bench/results/demo.<cpu class>.json`` (the rows of the other
budgets kept), and with ``--reference`` ``src/specdraft/assets/demo_reference.json`` (``specdraft.demo.plan``).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import argument_parser, command, machine_record, result_path
from specdraft.core.io import atomic_write_json, read_json
from specdraft.demo import BUDGETS
from specdraft.demo.plan import REFERENCE_PATH, stage_kinds, stage_units
from specdraft.reports.demo import mt_bench_turns


def budget_row(summary: dict, wall_with_install: float | None) -> dict:
    acc, spec = summary["acceptance"], summary["speculate"]["drafters"]
    return {"date": summary["created_at"][:10], "wall_seconds": wall_with_install or summary["wall_seconds"],
            "wall_includes_install": wall_with_install is not None, "eval_points": summary["data"]["eval_points"],
            "eval_set": summary["eval_set"]["kind"],
            "accepted": {name: round(row["mean_accepted_pooled"], 2) for name, row in acc.items()},
            "accepted_at_temperature": {t: {name: round(row["at_temperature"][t], 2) for name, row in acc.items()
                                            if t in (row.get("at_temperature") or {})}
                                        for t in sorted({t for row in acc.values() for t in row.get("at_temperature")
                                                         or {}}, key=float) if float(t) > 0},
            "speedup_torch": {name: round(row["speedup_median"], 2) for name, row in spec.items()},
            "mt_bench": mt_bench_row(summary.get("mt_bench"), BUDGETS[summary["budget"]].mt_bench_eval_tokens),
            "compute": {where: {k: v for k, v in c.items() if k != "prefill" or c["compute"] == "int4"}
                        for where, c in (summary.get("compute") or {}).items()}}


def mt_bench_row(section: dict | None, scored_tokens: int) -> dict | None:
    """MT-bench's both turns over every point: the trained draft's and prompt lookup's mean accepted, overall and per
    turn, and the target tokens the budget scores after each turn (None where the run had no MT-bench, or recorded no
    lookup beside the draft)."""
    if not section or section.get("unavailable") or not section.get("lookup_per_category"):
        return None
    row: dict = {"points": section["points"], "scored_tokens": scored_tokens}
    turns = mt_bench_turns(section)
    for name, column in (("trained", "draft"), ("lookup", "lookup")):
        cells = {f"turn{turn}": columns[column] for turn, columns in turns.items()}
        cells["all"] = {"points": sum(c["points"] for c in cells.values()),
                        "accepted_total": sum(c["accepted_total"] for c in cells.values())}
        row[name] = {key: round(c["accepted_total"] / c["points"], 2) for key, c in sorted(cells.items())}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--wall-with-install", type=float, help="seconds `make demo` took, the install included")
    ap.add_argument("--wall-note", help="how the wall time was taken where it differs from the usual: a cold pip cache")
    ap.add_argument("--reference", action="store_true", help="also record it as the machine probe's reference")
    args = ap.parse_args(argv)
    summary = read_json(args.run_dir / "demo_summary.json")
    record = machine_record()
    path = result_path("demo", record)
    result = read_json(path) if path.is_file() else {"bench": "demo", "figures": {"budgets": {}}}
    result.update({"command": "make demo BUDGET=<budget>", "date": summary["created_at"][:10], "machine": record})
    result["figures"]["budgets"][summary["budget"]] = budget_row(summary, args.wall_with_install)
    if args.wall_note:
        result["figures"]["budgets"][summary["budget"]]["wall_note"] = args.wall_note
    atomic_write_json(path, result)
    print(f"wrote {path}")
    if args.reference:
        if summary.get("stages_done_earlier"):
            raise SystemExit(f"{args.run_dir}: stages {summary['stages_done_earlier']} ran in an earlier sitting; "
                             "record a run that ran every stage at once")
        seconds = {m.stem: read_json(m)["seconds"] for m in (args.run_dir / ".stages").glob("*.json")}
        plan = summary["plan"]
        atomic_write_json(REFERENCE_PATH, {
            "what": "one `specdraft demo` with every stage in one sitting: the seconds each stage took and the machine "
                    "probe measured before the first (specdraft.demo.plan)",
            "command": "make demo", "recorded_by": command(), "date": summary["created_at"][:10],
            "machine": plan["machine"],
            "threads": plan["threads"], "probe_seconds": plan["probe_seconds"], "budget": summary["budget"],
            "units": stage_units(BUDGETS[summary["budget"]]), "kinds": stage_kinds(BUDGETS[summary["budget"]]),
            "stage_seconds": dict(sorted(seconds.items()))})
        print(json.dumps(read_json(REFERENCE_PATH), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
