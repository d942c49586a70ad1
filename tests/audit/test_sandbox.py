"""The audit's sandbox program on a module that misbehaves, and the classification of what it opened."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import specdraft
from specdraft.audit.sandbox import (
    SANDBOX_PATH,
    SandboxResult,
    allowed_roots,
    classify_opens,
    classify_path,
    read_sandbox_events,
    sandbox_command,
)


def test_sandbox_blocks_and_records_network_and_files(tmp_path):
    outside = next(p for p in ("/etc/os-release", "/etc/hostname", "/etc/passwd") if Path(p).is_file())
    site = tmp_path / "site"  # stands in for site-packages: a package with code and a stray data file
    (site / "leakypkg").mkdir(parents=True)
    (site / "leakypkg" / "__init__.py").write_text("")
    (site / "leakypkg" / "lookup.json").write_text("{}")
    cheat = tmp_path / "cheat_table.json"  # tmp_path lies in the temp dir: a table left there for the server
    cheat.write_text("{}")
    (tmp_path / "leaky.py").write_text(
        "import pathlib, socket, tempfile\n"
        "import leakypkg\n"
        f"open({outside!r}).read()\n"
        f"open({str(site / 'leakypkg' / 'lookup.json')!r}).read()\n"
        f"open({str(cheat)!r}).read()\n"
        "pathlib.Path('scratch.txt').write_text('own dir')\n"  # the cwd: the sandbox's own dir
        "with tempfile.NamedTemporaryFile('w+', delete=False) as f:\n"  # a temp file the server creates
        "    f.write('mine'); own_tmp = f.name\n"
        "open(own_tmp).read()\n"
        "print('own temp file:', own_tmp)\n"
        "for call in (lambda: socket.create_connection(('203.0.113.7', 80), timeout=1),\n"
        "             lambda: socket.getaddrinfo('example.com', 443)):\n"
        "    try:\n"
        "        call()\n"
        "    except OSError as e:\n"
        "        print('refused:', e)\n")
    events, sandbox_dir = tmp_path / "events.jsonl", tmp_path / "sandbox"
    sandbox_dir.mkdir()
    proc = subprocess.run([*sandbox_command(events), "leaky"], cwd=sandbox_dir, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{site}", "PYTHONDONTWRITEBYTECODE": "1"},
                          timeout=60)
    result = SandboxResult()
    read_sandbox_events(events, result)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("refused: specdraft audit sandbox") == 2
    own_tmp = proc.stdout.split("own temp file: ", 1)[1].split()[0]
    Path(own_tmp).unlink()
    assert {e["event"] for e in result.network} == {"connect", "getaddrinfo"}
    assert any("203.0.113.7" in json.dumps(e) for e in result.network)
    assert result.sandbox_dir == os.path.realpath(sandbox_dir)  # the working dir, not the program's own dir
    roots = allowed_roots(tmp_path / "model", [*result.python_roots, str(site)], own_dirs=[result.sandbox_dir],
                          created=result.created, absent=result.absent)
    opened = classify_opens(result.opens, roots)
    assert {outside, str(site / "leakypkg" / "lookup.json"), str(cheat)} <= opened["other"]
    assert str(site / "leakypkg" / "__init__.py") in opened["python"]
    assert {own_tmp, str(Path(result.sandbox_dir) / "scratch.txt")} <= opened["temp"]
    assert own_tmp in result.created and not opened["other"] & result.created


def test_classification_of_paths(tmp_path):
    # the run dir is never an allowed place to read, even inside a temp dir; its model dir is
    roots = allowed_roots(tmp_path / "run" / "model", [], denied=[tmp_path / "run"])
    assert classify_path(str(tmp_path / "run" / "draft" / "model.safetensors"), roots) == "other"
    assert classify_path(str(tmp_path / "run" / "model" / "draft.qd4"), roots) == "model_dir"
    assert classify_path(str(tmp_path / "elsewhere.bin"), roots) == "other"
    assert classify_path("/dev/shm/table.bin", roots) == "other" and classify_path("/proc/self/maps", roots) == "system"
    package = Path(specdraft.__file__).parent
    assert classify_path(str(package / "lookup.json"), roots) == "other"
    assert classify_path(str(package / "audit" / "serve.py"), roots) == "python"
    # the sandbox program ships in the package: reading it is reading Python code
    assert SANDBOX_PATH.is_file() and classify_path(str(SANDBOX_PATH), roots) == "python"


def test_an_installed_wheels_own_data_file_is_allowed_only_while_it_matches_its_record(tmp_path):
    import base64
    import hashlib

    site = tmp_path / "site"
    (site / "shippedpkg").mkdir(parents=True)
    (site / "shippedpkg" / "__init__.py").write_text("")
    shipped, planted = site / "shippedpkg" / "depends.json", site / "shippedpkg" / "lookup.json"
    shipped.write_text('{"python": ["3.11"]}')
    planted.write_text('{"prompt": "continuation"}')
    digest = base64.urlsafe_b64encode(hashlib.sha256(shipped.read_bytes()).digest()).rstrip(b"=").decode()
    info = site / "shippedpkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shippedpkg\nVersion: 1.0\n")
    (info / "RECORD").write_text(f"shippedpkg/__init__.py,,\nshippedpkg/depends.json,sha256={digest},36\n"
                                 "shippedpkg-1.0.dist-info/RECORD,,\n")
    roots = allowed_roots(tmp_path / "model", [str(site)])
    assert classify_path(str(shipped), roots) == "python"
    assert classify_path(str(planted), roots) == "other"  # in no RECORD
    shipped.write_text('{"python": ["3.11"], "table": [1, 2, 3]}')
    assert classify_path(str(shipped), roots) == "other"  # no longer what the wheel shipped
