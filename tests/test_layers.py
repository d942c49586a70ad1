"""The package's layers (pyproject.toml, [tool.importlinter]): imports point one way, stages never import each
other, and the decode loop, traces and training load no HTTP server code."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_decoding_traces_and_training_do_not_import_the_server():
    code = ("import json, sys\n"
            "import specdraft.model.decode, specdraft.stages.traces, specdraft.stages.train, specdraft.stages.label\n"
            "print(json.dumps(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'specdraft.server') "
            "if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
