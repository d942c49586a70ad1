"""specdraft.core.provenance: package versions, the git commit, run metadata and a stage's log file."""

import logging
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

from specdraft.core.io import COMMIT_RE
from specdraft.core.provenance import (
    TRACKED_PACKAGES,
    git_sha,
    package_versions,
    run_metadata,
    setup_file_logging,
    stage_log,
)

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                   cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def no_enclosing_repo(tmp_path, monkeypatch):
    """git must not find a repository above tmp_path."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    for var in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(var, raising=False)


def test_package_versions_report_installed_and_missing_packages():
    versions = package_versions(["pytest", "surely-not-installed-pkg-xyz"])
    assert versions == {"python": sys.version.split()[0], "pytest": metadata.version("pytest"),
                        "surely-not-installed-pkg-xyz": None}
    assert list(package_versions([])) == ["python"]


def test_the_tracked_packages_include_specdraft_and_torch():
    versions = package_versions()
    assert set(versions) == {"python", *TRACKED_PACKAGES}
    assert versions["pydantic"] == metadata.version("pydantic")


@needs_git
def test_git_sha_outside_a_checkout_is_none(tmp_path, no_enclosing_repo):
    assert git_sha(tmp_path) is None


def test_git_sha_without_git_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    assert git_sha(tmp_path) is None


@needs_git
def test_git_sha_is_the_head_commit_and_dirty_only_for_tracked_changes(tmp_path, no_enclosing_repo):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert COMMIT_RE.fullmatch(head)
    assert git_sha(repo) == head
    (repo / "untracked.txt").write_text("not part of the source")
    assert git_sha(repo) == head
    (repo / "sub").mkdir()
    assert git_sha(repo / "sub") == head  # any folder of the checkout
    (repo / "a.py").write_text("x = 2\n")
    assert git_sha(str(repo)) == head + "+dirty"


def test_run_metadata_records_time_code_versions_and_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["specdraft", "traces", "--limit", "3"])
    meta = run_metadata()
    assert set(meta) == {"created_at", "git_sha", "versions", "argv"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["created_at"])
    assert meta["argv"] == ["specdraft", "traces", "--limit", "3"]
    assert meta["versions"]["python"] == sys.version.split()[0]
    assert meta["git_sha"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", meta["git_sha"])


@pytest.fixture
def quiet_logger():
    """A logger of its own at WARNING, restored afterwards (setup_file_logging lowers it to INFO)."""
    logger = logging.getLogger("specdraft_core_test")
    level, handlers = logger.level, list(logger.handlers)
    logger.setLevel(logging.WARNING)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_stage_log_writes_info_to_the_file_for_the_stage_only(tmp_path, quiet_logger):
    log_path = tmp_path / "deep" / "stage.log"
    with stage_log(log_path, name=quiet_logger.name) as logger:
        assert logger is quiet_logger and len(logger.handlers) == 1
        logger.info("decoding %d prompts", 3)
        logging.getLogger(quiet_logger.name + ".child").warning("a child's warning")
        logger.debug("not kept")
    quiet_logger.info("after the stage")
    assert quiet_logger.handlers == []
    lines = log_path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO specdraft_core_test: decoding 3 prompts",
                        lines[0])
    assert lines[1].endswith("WARNING specdraft_core_test.child: a child's warning")


def test_setup_file_logging_appends_utf8_and_keeps_a_lower_level(tmp_path, quiet_logger):
    log_path = tmp_path / "x.log"
    log_path.write_text("earlier run\n", encoding="utf-8")
    quiet_logger.setLevel(logging.DEBUG)
    handler = setup_file_logging(log_path, quiet_logger.name)
    try:
        assert quiet_logger.level == logging.DEBUG  # a lower level is not raised
        assert handler.level == logging.INFO
        quiet_logger.info("é€ 😀")
        quiet_logger.debug("below the file's level")
    finally:
        quiet_logger.removeHandler(handler)
        handler.close()
    lines = log_path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "earlier run" and len(lines) == 2 and lines[1].endswith(" INFO specdraft_core_test: é€ 😀")
