"""``train --mixed-precision auto``: the choice follows the timings it is given, whatever machine runs the test (a
fake timer): bf16 only when it is clearly faster, the CPU's features only ordering the two; an explicit setting
and a GPU are not measured; the shapes carry the gradients each layer's backward computes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.quant.train_precision import (
    BF16_MARGIN,
    PROBE_ROWS,
    StepTimer,
    TrainShape,
    choose_train_precision,
    resolve_train_precision,
    train_shapes,
)

# a small draft's layers: attention and MLP trained, the vocabulary head frozen (its input's gradient only)
SHAPES = [TrainShape(576, 576, 48), TrainShape(192, 576, 48), TrainShape(1536, 576, 48), TrainShape(576, 1536, 24),
          TrainShape(49152, 576, 1, head=True, weight_grad=False)]
AVX2 = {"capability": "AVX2", "avx512_bf16": False, "amx": False}
AMX = {"capability": "AVX512", "avx512_bf16": True, "amx": True}


def fake_timer(per_weight_row: dict[str, float], calls: list | None = None):
    """Seconds of one forward and backward: a cost per row, weight and matmul (the forward, and one per gradient)."""

    def measure(precision: str, shape: TrainShape, rows: int) -> float:
        if calls is not None:
            calls.append((precision, shape, rows))
        matmuls = 1 + shape.input_grad + shape.weight_grad
        return per_weight_row[precision] * rows * shape.out_features * shape.in_features * matmuls
    return measure


def never_measure(precision, shape, rows):
    raise AssertionError("measured where nothing should be timed")


def test_bf16_clearly_faster_is_picked_even_where_the_cpu_favours_float32():
    choice = choose_train_precision(SHAPES, 1024, 256, measure=fake_timer({"no": 2e-11, "bf16": 1e-11}), cpu=AVX2)
    assert choice.precision == "bf16" and choice.bf16_speedup == pytest.approx(2.0)
    assert all("seconds_per_step" in choice.measured[name] for name in ("float32", "bf16")) and not choice.given
    assert "bf16 2.00x as fast; bf16" in choice.reason and "CPU AVX2, " in choice.reason


@pytest.mark.parametrize("cpu", [AVX2, AMX])
def test_bf16_a_little_faster_is_not_enough(cpu):
    """bf16 changes the numerics: under the margin float32 stays, whichever the CPU favours."""
    choice = choose_train_precision(SHAPES, 1024, 256, measure=fake_timer({"no": 1.2e-11, "bf16": 1e-11}), cpu=cpu)
    assert choice.precision == "no" and choice.bf16_speedup == pytest.approx(1.2) and 1.2 < BF16_MARGIN
    assert f"kept only at {BF16_MARGIN:.2f}x" in choice.reason
    assert all("seconds_per_step" in row for row in choice.measured.values())  # close: both timed to the end


def test_an_avx2_like_machine_keeps_float32_and_stops_timing_bf16_early():
    calls: list = []
    choice = choose_train_precision(SHAPES, 1024, 256, measure=fake_timer({"no": 1e-11, "bf16": 6e-11}, calls),
                                    cpu=AVX2)
    assert choice.precision == "no" and 1 / 6 <= choice.bf16_speedup < 1  # a bound: bf16 was not timed to the end
    assert [p for p, _, _ in calls][:len(SHAPES)] == ["no"] * len(SHAPES)  # the CPU's favourite first
    assert len([c for c in calls if c[0] == "bf16"]) == 1  # the heaviest shape alone settles it
    assert "stopped" in choice.measured["bf16"] and "at most" in choice.reason


def test_a_bf16_machine_stops_timing_float32_once_bf16_has_won():
    calls: list = []
    choice = choose_train_precision(SHAPES, 1024, 256, measure=fake_timer({"no": 6e-11, "bf16": 1e-11}, calls),
                                    cpu=AMX)
    assert choice.precision == "bf16" and calls[0][0] == "bf16"
    assert "stopped" in choice.measured["float32"] and "at least" in choice.reason and choice.bf16_speedup >= 1.25
    assert "CPU AVX512 + avx512_bf16 + AMX" in choice.reason


def test_rows_are_probed_at_most_probe_rows_and_the_head_at_its_own_rows():
    calls: list = []
    choose_train_precision(SHAPES, 1024, 40, measure=fake_timer({"no": 1e-11, "bf16": 1e-11}, calls), cpu=AVX2)
    assert {rows for _, shape, rows in calls if not shape.head} == {PROBE_ROWS}
    assert {rows for _, shape, rows in calls if shape.head} == {40}


def test_an_explicit_setting_wins_and_is_not_measured(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    for setting in ("no", "bf16"):
        choice = resolve_train_precision(model, setting, "cpu", 256, measure=never_measure, cpu=AMX)
        assert choice == {"precision": setting, "requested": setting, "given": True,
                          "reason": f"--mixed-precision {setting}"}


def test_auto_on_a_gpu_is_bf16_without_measuring(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    choice = resolve_train_precision(model, "auto", "cuda:0", 256, measure=never_measure, cpu=AVX2)
    assert (choice["precision"], choice["given"], choice["requested"]) == ("bf16", False, "auto")
    assert "not measured" in choice["reason"]


def test_auto_on_the_cpu_measures_the_models_own_shapes(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    calls: list = []
    choice = resolve_train_precision(model, "auto", "cpu", 256, 64, measure=fake_timer({"no": 1e-11, "bf16": 4e-12},
                                                                                       calls), cpu=AVX2)
    assert choice["precision"] == "bf16" and choice["requested"] == "auto" and choice["given"] is False
    assert {shape for _, shape, _ in calls} == set(train_shapes(model))
    assert choice["rows"] == {"rows": 256, "head_rows": 64, "probe_rows": PROBE_ROWS}


def test_train_shapes_carry_the_gradients_each_backward_computes(tiny_qwen3_dir):
    """Frozen embedding and first layer: that layer runs forward alone; the trained layer computes its input's and
    its weight's gradients; the frozen (tied) head its input's only."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    rng = torch.get_rng_state()
    shapes = train_shapes(model)
    assert torch.equal(torch.get_rng_state(), rng)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(s.count for s in shapes) == len(linears)
    per_layer = sum(isinstance(m, torch.nn.Linear) for m in model.model.layers[0].modules())
    layers = model.config.num_hidden_layers
    assert sum(s.count for s in shapes if not s.head and (s.input_grad, s.weight_grad) == (False, False)) == per_layer
    assert sum(s.count for s in shapes if not s.head and (s.input_grad, s.weight_grad) == (True, True)) == \
        per_layer * (layers - 1)
    (head,) = [s for s in shapes if s.head]
    assert (head.out_features, head.input_grad, head.weight_grad) == (model.config.vocab_size, True, False)


def test_the_real_timer_times_a_forward_and_backward_in_both_precisions():
    timer = StepTimer(repeats=1)
    for shape in (TrainShape(64, 32), TrainShape(64, 32, input_grad=False, weight_grad=False),
                  TrainShape(3 * 8192, 16, head=True, weight_grad=False)):  # a wide head: probed and scaled
        assert timer("no", shape, 8) > 0 and timer("bf16", shape, 8) > 0
