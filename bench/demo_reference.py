"""Record a finished small-budget demo as the reference the demo's machine probe scales from.

  .venv/bin/python bench/demo_reference.py runs/demo

Reads the run's ``demo_summary.json`` (the probe it measured before its first stage, its threads, the machine) and
each stage's seconds from its markers (``.stages/*.json``), and writes ``src/specdraft/assets/demo_reference.json``
(``specdraft.demo.plan`` reads it). Run it on a demo that ran every stage in one sitting, on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdraft.core.io import atomic_write_json, read_json
from specdraft.demo import BUDGETS
from specdraft.demo.plan import REFERENCE_PATH, stage_units


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--command", default="make demo", help="how the run was started")
    args = ap.parse_args(argv)
    summary = read_json(args.run_dir / "demo_summary.json")
    if summary.get("stages_done_earlier"):
        raise SystemExit(f"{args.run_dir}: stages {summary['stages_done_earlier']} ran in an earlier sitting; "
                         "record a run that ran every stage at once")
    seconds = {m.stem: read_json(m)["seconds"] for m in (args.run_dir / ".stages").glob("*.json")}
    probe = summary["plan"]
    record = {"what": "one small-budget `specdraft demo`, every stage in one sitting: the seconds each stage took and "
                      "the machine probe measured before the first (specdraft.demo.plan)",
              "command": args.command, "date": summary.get("created_at", time.strftime("%Y-%m-%d"))[:10],
              "machine": probe["machine"], "threads": probe["threads"], "probe_seconds": probe["probe_seconds"],
              "budget": summary["budget"], "units": stage_units(BUDGETS[summary["budget"]]),
              "stage_seconds": dict(sorted(seconds.items()))}
    atomic_write_json(REFERENCE_PATH, record)
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
