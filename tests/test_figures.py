"""One source per figure: README.md and BENCHMARKS.md quote only what bench/results holds, through the blocks
bench/report.py renders, and nothing under src/ reads the documentation at run time."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_quoted_figure_is_its_results_own():
    check = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--check"], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr


def test_the_check_catches_a_figure_that_drifted(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import report
    finally:
        sys.path.remove(str(ROOT / "bench"))
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    # the default budget's trained draft, quoted in the results block
    trained = report.load("demo.avx512-bf16")["figures"]["budgets"]["default"]["accepted"]["trained"]
    cell = f"| {trained:.2f} |"
    assert cell in text
    readme.write_text(text.replace(cell, f"| {trained + 0.01:.2f} |", 1))
    monkeypatch.setattr(report, "BLOCKS", {readme: report.BLOCKS[ROOT / "README.md"]})
    assert report.main(["--check"]) == 1


def test_no_module_reads_the_documentation():
    docs = re.compile(r"""["'](BENCHMARKS|README)(\.md)?["']|/ *["']BENCHMARKS""")
    readers = [f"{path}:{n}" for path in (ROOT / "src").rglob("*.py")
               for n, line in enumerate(path.read_text().splitlines(), 1) if docs.search(line)]
    assert readers == []


def test_the_pages_stay_short():
    """README is a product page and BENCHMARKS.md a summary with its tables (issue 48): the notebook is docs/history.md;
    a figure that does not fit replaces one, or moves to bench/results/archive/."""
    assert (ROOT / "README.md").stat().st_size <= 9_000
    assert (ROOT / "BENCHMARKS.md").stat().st_size <= 40_000
