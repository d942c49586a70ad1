import json
import shutil

from specdraft.stages.selfcheck import Checks, SelfcheckConfig, check_weight_file, invalid_requests, run_selfcheck


def test_selfcheck_passes_on_a_tiny_packed_model(packed_dir, tmp_path, capsys):
    code = run_selfcheck(SelfcheckConfig(model_dir=packed_dir, out=tmp_path, threads=1))
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "selfcheck.json").read_text())
    assert code == 0, [c for c in report["checks"] if not c["ok"]]
    assert report["passed"] and report["counts"]["fail"] == 0
    names = [c["name"] for c in report["checks"]]
    for must in ("weight file bytes", "weight file sha256", "server starts on a free port and /health is ok",
                 "load log shows missing=0 unexpected=0", "no request got a 5xx"):
        assert must in names
    assert sum(n.startswith("invalid:") for n in names) == len(invalid_requests(300, 16))
    assert sum(n.startswith("valid request") for n in names) >= 3
    assert "PASS  weight file sha256" in printed and "FAIL" not in printed
    assert all(r["status"] < 500 for r in report["requests"])


def test_selfcheck_fails_on_a_flipped_byte(packed_dir, tmp_path, capsys):
    bad = tmp_path / "model"
    shutil.copytree(packed_dir, bad)
    weight = bad / "draft.qd4"
    data = bytearray(weight.read_bytes())
    data[-10] ^= 0x01  # one bit in the payload
    weight.write_bytes(bytes(data))
    code = run_selfcheck(SelfcheckConfig(model_dir=bad, out=tmp_path / "sc", startup_timeout_s=120))
    printed = capsys.readouterr().out
    assert code == 1
    report = json.loads((tmp_path / "sc" / "selfcheck.json").read_text())
    checks = {c["name"]: c["ok"] for c in report["checks"]}
    assert checks["weight file bytes"] is True
    assert checks["weight file sha256"] is False
    assert "FAIL  weight file sha256" in printed
    assert not report["passed"] and "weight file sha256" in report["failed"]


def test_weight_checks_without_a_server(packed_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(packed_dir, d)
    checks = Checks(echo=False)
    check_weight_file(d, checks)
    assert [c.ok for c in checks.items] == [True, True, True]
    (d / "draft.qd4").write_bytes((d / "draft.qd4").read_bytes() + b"\0")
    checks = Checks(echo=False)
    check_weight_file(d, checks)
    assert {c.name: c.ok for c in checks.items} == {"architecture.json readable": True,
                                                      "weight file bytes": False, "weight file sha256": False}
    arch = json.loads((d / "architecture.json").read_text())
    del arch["sha256"]
    (d / "architecture.json").write_text(json.dumps(arch))
    checks = Checks(echo=False)
    check_weight_file(d, checks)
    assert not checks.passed and "sha256" in checks.items[0].detail
    for broken in ({**arch, "sha256": "0" * 64, "bytes": "57664"}, [arch]):  # a wrong type: a FAIL, not a crash
        (d / "architecture.json").write_text(json.dumps(broken))
        checks = Checks(echo=False)
        check_weight_file(d, checks)
        assert [(c.name, c.ok) for c in checks.items] == [("architecture.json readable", False)]
        assert "architecture.json" in checks.items[0].detail


def test_missing_model_dir_fails(tmp_path):
    assert run_selfcheck(SelfcheckConfig(model_dir=tmp_path / "nope", out=tmp_path)) == 1
