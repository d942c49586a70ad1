"""``--compute auto``: the choice follows the timings it is given, whatever machine runs the test (a fake timer),
orders candidates by what the CPU reports only to break ties, stops timing hopeless candidates, and the loader
records what it picked and why."""

from __future__ import annotations

import pytest
import torch

from specdraft.model.loader import load_draft
from specdraft.quant.compute_choice import (
    CANDIDATES,
    SERVE_WORKLOAD,
    Candidate,
    LinearShape,
    ModuleTimer,
    Workload,
    choose_compute,
    linear_shapes,
)

SHAPES = [LinearShape(576, 576, 48), LinearShape(192, 576, 48), LinearShape(1536, 576, 48),
          LinearShape(576, 1536, 24), LinearShape(49152, 576, 1, head=True)]
AVX2 = {"capability": "AVX2", "avx512_bf16": False, "amx": False}
AVX512_BF16 = {"capability": "AVX512", "avx512_bf16": True, "amx": False}


def fake_timer(per_row: dict[str, float], per_call: dict[str, float] | None = None, calls: list | None = None):
    """Seconds of one call: a fixed cost per call plus a cost per row and weight, by kind of module."""
    per_call = per_call or {}

    def measure(kind: str, shape: LinearShape, rows: int) -> float:
        if calls is not None:
            calls.append((kind, shape, rows))
        return per_call.get(kind, 1e-5) + per_row[kind] * rows * shape.out_features * shape.in_features
    return measure


def test_an_avx2_like_machine_gets_float32():
    # bf16 several times float32 at many rows, int4 a little dearer than float32 at few (AVX2, issue 47's figures)
    measure = fake_timer({"f32": 1e-11, "bf16": 6e-11, "int4": 1.5e-11, "int4-head": 1.6e-11})
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX2)
    assert (choice.compute, choice.candidates["float32"]["worst_ratio_to_fastest"]) == ("float32", 1.0)
    assert choice.reason.startswith("measured over 6 scenarios") and "float32 1.00x" in choice.reason
    assert "CPU AVX2" in choice.reason


def test_a_machine_with_fast_int4_decode_and_bf16_prefill_gets_int4_with_a_bf16_prefill():
    # decode steps read every weight once per token: bytes decide them, so int4 wins at few rows; the bf16 GEMM wins
    # the prefill (AVX-512 bf16 / AMX)
    measure = fake_timer({"f32": 1e-11, "bf16": 0.5e-11, "int4": 3e-11, "int4-head": 3e-11},
                         per_call={"f32": 4e-4, "bf16": 2e-4, "int4": 0.6e-4, "int4-head": 0.6e-4})
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX512_BF16)
    assert (choice.compute, choice.prefill) == ("int4", "bfloat16")


def test_fast_int4_decode_beside_slow_bf16_gets_a_float32_prefill():
    measure = fake_timer({"f32": 1e-11, "bf16": 6e-11, "int4": 3e-11, "int4-head": 3e-11},
                         per_call={"f32": 4e-4, "bf16": 4e-4, "int4": 0.6e-4, "int4-head": 0.6e-4})
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX2)
    assert (choice.compute, choice.prefill) == ("int4", "float32")


def test_the_pick_is_within_its_worst_ratio_of_the_fastest_in_every_scenario():
    measure = fake_timer({"f32": 1e-11, "bf16": 2e-11, "int4": 2e-11, "int4-head": 2e-11},
                         per_call={"f32": 3e-4, "bf16": 1e-4, "int4": 0.5e-4, "int4-head": 0.5e-4})
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX2)
    timed = {name: row["seconds_per_request"] for name, row in choice.candidates.items() if "pruned" not in row}
    name = next(c.name for c in CANDIDATES if (c.compute, c.prefill) == (choice.compute, choice.prefill)
                or (c.compute == choice.compute != "int4"))
    for scenario, seconds in timed[name].items():
        fastest = min(row[scenario] for row in timed.values())
        assert seconds <= choice.candidates[name]["worst_ratio_to_fastest"] * fastest * 1.001
    assert all(choice.candidates[name]["worst_ratio_to_fastest"] <= row["worst_ratio_to_fastest"]
               for row in choice.candidates.values() if "pruned" not in row)


def test_a_tie_goes_to_the_format_the_cpu_favours():
    same = fake_timer({"f32": 1e-11, "bf16": 1e-11, "int4": 1e-11, "int4-head": 1e-11})
    assert choose_compute(SHAPES, SERVE_WORKLOAD, measure=same, cpu=AVX2).compute == "float32"
    picked = choose_compute(SHAPES, SERVE_WORKLOAD, measure=same, cpu=AVX512_BF16)
    assert (picked.compute, picked.prefill) == ("int4", "bfloat16")


def test_a_hopeless_candidate_is_not_timed_further():
    calls: list = []
    measure = fake_timer({"f32": 1e-11, "bf16": 50e-11, "int4": 1.2e-11, "int4-head": 1.2e-11}, calls=calls)
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX2)
    assert "pruned" in choice.candidates["bfloat16"] and "pruned" in choice.candidates["int4, bfloat16 prefill"]
    bf16_rows = {rows for kind, _, rows in calls if kind == "bf16"}
    assert bf16_rows == {64, 1}  # the first scenario (64 tokens, 1 row) only: never the 128-row probe


def test_the_module_kinds_follow_the_candidate():
    int4_f32 = Candidate("int4", "float32")
    assert [int4_f32.module(prefill, head) for prefill, head in ((True, False), (False, False), (True, True))] == \
        ["f32", "int4", "int4-head"]
    assert Candidate("bfloat16").module(False, True) == "bf16"


def test_the_real_timer_times_each_kind_once_per_shape_and_rows():
    timer = ModuleTimer(group_size=32, repeats=1)
    shape = LinearShape(64, 64)
    seconds = [timer(kind, shape, rows) for kind in ("f32", "bf16", "int4", "int4-head") for rows in (1, 4)]
    assert all(s > 0 for s in seconds) and len(timer.modules) == 4
    wide = LinearShape(3 * 8192, 64)  # timed on PROBE_OUT_FEATURES rows and scaled
    assert timer("f32", wide, 1) > 0 and ("f32", 8192, 64) in timer.modules


def test_linear_shapes_count_the_model_and_mark_the_head(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    shapes = linear_shapes(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(s.count for s in shapes) == len(linears)
    assert [s for s in shapes if s.head] == [LinearShape(model.config.vocab_size, model.config.hidden_size, 1, True)]


@pytest.mark.parametrize("workload", [SERVE_WORKLOAD, Workload(decode_rows=(8,), context_tokens=(32,))])
def test_load_draft_auto_records_what_it_measured_and_applies_it(packed_dir, workload):
    model, source = load_draft(packed_dir, "auto", workload=workload)
    choice, summary = source["compute_choice"], source["compute_summary"]
    assert choice["requested"] == "auto" and choice["reason"].startswith("measured over")
    assert (summary["compute"], source["compute"]) == (choice["compute"], choice["compute"])
    if choice["compute"] == "int4":
        assert summary["prefill"] == choice["prefill"]
    assert choice["workload"]["decode_rows"] == list(workload.decode_rows)
    _, explicit = load_draft(packed_dir, "bfloat16")
    assert explicit["compute_choice"]["reason"] == "--compute bfloat16" and explicit["compute"] == "bfloat16"


def test_where_float32_cannot_be_row_invariant_a_server_never_picks_it():
    measure = fake_timer({"f32": 1e-11, "bf16": 6e-11, "int4": 1.5e-11, "int4-head": 1.6e-11})
    choice = choose_compute(SHAPES, SERVE_WORKLOAD, measure=measure, cpu=AVX2, f32_row_block=None)
    assert choice.compute == "int4" and choice.prefill in ("int4", "bfloat16")
    assert "not row-invariant" in choice.candidates["float32"]["pruned"]
    assert "not row-invariant" in choice.candidates["int4, float32 prefill"]["pruned"]
