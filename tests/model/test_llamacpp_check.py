"""llama.cpp built for what the CPU runs and checked before use: a child that dies by a signal is caught and named,
the build leaves AMX out where the CPU lists it but cannot run it, and a dead engine is an error, not a dead
process (no llama-cpp-python needed: the engine is a child process here)."""

import pytest

from specdraft.model import llamacpp_check as check

DIES_OF_AN_ILLEGAL_INSTRUCTION = "import os, signal; print('loading'); os.kill(os.getpid(), signal.SIGILL)"


def test_an_engine_that_dies_by_a_signal_is_caught_and_named():
    outcome = check.smoke(DIES_OF_AN_ILLEGAL_INSTRUCTION, timeout=60)
    assert not outcome.ok and outcome.detail.startswith("killed by SIGILL") and "loading" in outcome.detail
    message = check.failure_message(outcome)
    assert "does not run on this CPU" in message and "killed by SIGILL" in message
    assert "CPU: " in message and "Build flags now: " in message and "make install-llama" in message
    assert check.smoke("print('decoded 4 tokens')", timeout=60) == check.Outcome(True, "decoded 4 tokens")
    assert check.run_child(["python3", "-c", "import sys; sys.exit(7)"]).detail.startswith("exit code 7")


def test_the_build_leaves_amx_out_only_where_the_cpu_cannot_run_it(monkeypatch):
    monkeypatch.setattr(check, "amx_runs", lambda: check.Outcome(False, "killed by SIGILL"))
    flags = check.build_flags({})
    assert flags.startswith(check.NATIVE) and flags.count("-mno-amx-tile") == 2  # C and C++
    monkeypatch.setattr(check, "amx_runs", lambda: check.Outcome(True, "ok"))
    assert check.build_flags({}) == check.NATIVE  # AMX kept where it runs
    monkeypatch.setattr(check, "amx_runs", lambda: None)  # not listed: nothing to leave out
    assert check.build_flags({}) == check.NATIVE
    assert check.build_flags({"CMAKE_ARGS": "-DGGML_BLAS=ON"}) == "-DGGML_BLAS=ON"  # the user's own wins


def test_the_amx_probe_runs_in_a_child_and_decides_the_build(monkeypatch):
    """On a CPU that lists amx_tile the probe compiles and executes tile instructions in a child: here the listing
    is faked, so the probe meets this CPU as it is. Whatever it finds, the flags follow it."""
    listed = "amx_tile" in check.cpu_flags()
    monkeypatch.setattr(check, "cpu_flags", lambda: {"avx2", "amx_tile"})
    outcome = check.amx_runs()
    if outcome is None:
        pytest.skip("no C compiler to build the probe with")
    if not listed:  # a CPU without AMX cannot run the tiles: the probe must say so, not assume
        assert not outcome.ok and outcome.detail
    want = check.NATIVE if outcome.ok else f'{check.NATIVE} -DCMAKE_C_FLAGS="{check.NO_AMX}"'
    assert check.build_flags({}).startswith(want)
    monkeypatch.setattr(check, "cpu_flags", lambda: {"avx2"})
    assert check.amx_runs() is None


def test_speculate_refuses_a_dead_engine_before_loading_it(monkeypatch, tmp_path):
    from specdraft.stages import speculate
    monkeypatch.setattr(speculate, "engine_problem", lambda: "llama.cpp does not run on this CPU: killed by SIGILL")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hello"}\n')
    config = speculate.SpeculateConfig(engine="llama.cpp", prompts=prompts, draft="lookup", out=tmp_path / "out")
    with pytest.raises(RuntimeError, match="killed by SIGILL"):
        speculate.run_speculate(config)


def test_the_check_runs_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(check, "smoke", lambda: calls.append(1) or check.Outcome(True, "ok"))
    check.engine_problem.cache_clear()
    try:
        assert check.engine_problem() is None and check.engine_problem() is None and calls == [1]
    finally:
        check.engine_problem.cache_clear()

