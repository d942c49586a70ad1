"""The speed-up model: its arithmetic on known costs, and its replay of a drafter against the real loop."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.lookup import LookupDrafter
from specdraft.drafting.prediction import (
    Replay,
    TargetCosts,
    acceptance_per_position,
    ceiling,
    measure_target_costs,
    predict,
    replay_drafter,
    verdict,
)
from specdraft.drafting.speculative import speculative_generate
from specdraft.drafting.timing import Prompt, run_speculation_bench
from specdraft.model.targets import TorchTarget

PROMPTS = [[5, 9, 14, 22, 31, 40], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(40, 70))]


@pytest.fixture(scope="module")
def target_and_draft(tiny_qwen3_dir, tiny_llama_dir):
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
    return TorchTarget(load(tiny_qwen3_dir)), load(tiny_llama_dir)


@pytest.mark.parametrize("kind", ["lookup", "model"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_replay_proposes_and_accepts_what_the_speculative_loop_does(target_and_draft, kind, k):
    target, other = target_and_draft
    drafter = LookupDrafter() if kind == "lookup" else ModelDrafter(other, max_batch_size=1)
    for prompt in PROMPTS:
        reference = target.greedy(prompt, 24).tokens
        gen = speculative_generate(target, drafter, prompt, 24, k)
        replay = replay_drafter(drafter, prompt, reference, k, 24)
        assert gen.tokens == reference
        assert replay.accepted == gen.accepted_per_step
        assert sum(replay.drafted) == gen.drafted and len(replay.draft_seconds) == gen.steps


def test_predicted_speedup_from_known_costs():
    costs = TargetCosts({1: 0.010, 2: 0.012, 3: 0.014}, prefill_seconds={4: 0.05})
    # a 7-token output: two steps of 2 drafted, 2 accepted (+ the target's own token each), 1 ms drafting each
    replay = Replay(drafted=[2, 2], accepted=[2, 2], draft_seconds=[0.001, 0.001])
    out = predict(costs, [[1, 2, 3, 4]], [[0] * 7], [replay], k=2)
    plain, spec = 0.05 + 6 * 0.010, 0.05 + 2 * 0.014 + 0.002
    assert out["predicted_speedup"] == pytest.approx(plain / spec)
    assert out["tokens_per_step"] == 3 and out["acceptance_per_position"] == [1.0, 1.0]
    assert out["draft_cost_per_token_vs_target_step"] == pytest.approx(0.05)
    # a step that drafted nothing pays a one-token pass; a pass beyond the measured sizes scales linearly
    assert costs.verify(6) == pytest.approx(0.014 * 2)


def test_acceptance_per_position_counts_only_steps_that_drafted_that_far():
    replays = [Replay(drafted=[3, 1, 0], accepted=[1, 1, 0]), Replay(drafted=[3], accepted=[3])]
    assert acceptance_per_position(replays, 3) == [1.0, 0.5, 0.5]


def test_ceiling_and_verdict_say_when_no_drafter_can_pay():
    linear = TargetCosts({n: 0.01 * n for n in range(1, 10)})  # a verify pass costs what its tokens cost apart
    assert ceiling(linear, 4) == pytest.approx(1.0)
    rows = {"4": {"draft_cost_per_token_vs_target_step": 0.8, "predicted_speedup": 0.5}}
    lines = verdict(linear, [4], {"draft": rows}, "llama.cpp")
    assert "at most 1.00x" in lines[0] and "cannot pay here" in lines[1]
    cheap = TargetCosts({1: 0.01, 2: 0.011, 3: 0.012, 5: 0.013})
    assert ceiling(cheap, 4) == pytest.approx(5 * 0.01 / 0.013)
    assert "cannot pay" not in verdict(cheap, [4], {"draft": rows}, "torch")[1]


def test_target_costs_are_measured_for_every_size(target_and_draft):
    target, _ = target_and_draft
    costs = measure_target_costs(target, PROMPTS[2], [2, 5], repeats=2)
    assert set(costs.pass_seconds) == {1, 2, 5} and all(s > 0 for s in costs.pass_seconds.values())
    assert target.verify([PROMPTS[2][0]], len(PROMPTS[2])) is not None  # the cache is left at the prompt


def test_bench_reports_predictions_beside_measurements(target_and_draft):
    target, other = target_and_draft
    drafters = [("lookup", LookupDrafter()), ("other", ModelDrafter(other, max_batch_size=1))]
    result = run_speculation_bench(target, drafters, [Prompt(str(i), p) for i, p in enumerate(PROMPTS)], [2, 4],
                                   16, warmup=False, predict=True)
    prediction = result["prediction"]
    assert prediction["engine"] == "torch" and prediction["verdict"]
    for name in ("lookup", "other"):
        for k in ("2", "4"):
            row, measured = prediction["drafters"][name][k], result["drafters"][name]["per_k"][k]
            # the replay walks the loop's own steps: the same tokens per step as measured, exactly
            assert row["tokens_per_step"] == pytest.approx(measured["tokens_per_step"])
            assert row["measured_speedup"] == measured["speedup_wall"]
            assert measured["predicted_speedup"] == row["predicted_speedup"] > 0
