"""Acceptance at temperature: alpha_i = sum_x min(p_i(x), q_i(x)) along the reference continuation, expected
accepted length sum_k prod_(i<=k) alpha_i; at temperature 0 exactly the greedy figures."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.core.records import ValidationPoint
from specdraft.drafting.acceptance import acceptance_probabilities, evaluate_at_temperatures, evaluate_drafter
from specdraft.drafting.base import DraftDistributions
from specdraft.drafting.batched import ModelDrafter, path_logits
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.lookup import LookupDrafter, lookup_draft
from specdraft.drafting.metrics import ExpectedAcceptanceStats, expected_accepted_length
from specdraft.model.sampling import SamplingParams, warp_probs
from specdraft.model.simple_decode import naive_greedy


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tiny_qwen3_dir, tiny_llama_dir):
    return _load(tiny_qwen3_dir), _load(tiny_llama_dir)


@pytest.fixture(scope="module")
def points(models):
    """The target's greedy continuations, some altered at one position (the target "disagrees" there) so that
    its own draft accepts every length; some contexts repeat their tail so that lookup proposes."""
    target, _ = models
    rng = random.Random(5)
    out = []
    for i in range(8):
        ctx = [rng.randrange(3, 300) for _ in range(6 + i)]
        if i % 3 == 0:
            ctx += ctx[:3]
        tokens = naive_greedy(target, ctx, 16, stop_at_eos=False).tokens
        if i % 2:
            j = 2 * i - 1
            tokens = tokens[:j] + [(tokens[j] + 1) % 300] + tokens[j + 1:]
        out.append(ValidationPoint(f"p{i // 2}", "x", i, ctx, tokens))
    return out


def test_expected_accepted_length_by_hand():
    assert expected_accepted_length([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted_length([1, 1, 0, 1]) == 2
    stats = ExpectedAcceptanceStats(k=2)
    stats.add([0.5, 0.5], prompt_id="a")
    stats.add([1.0, 0.0], prompt_id="a")
    stats.add([0.0, 1.0], prompt_id="b")
    s = stats.summary()
    assert s["mean_expected_accepted_pooled"] == pytest.approx((0.75 + 1.0 + 0.0) / 3)
    assert s["mean_expected_accepted_per_prompt"] == pytest.approx((0.875 + 0.0) / 2)
    assert s["expected_cumulative_acceptance"] == pytest.approx([1.5 / 3, 0.25 / 3])
    assert s["expected_conditional_acceptance"] == pytest.approx([0.5, 0.25 / 1.5])
    assert s["mean_alpha"] == pytest.approx([0.5, 0.5])


def test_acceptance_probabilities_by_hand():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = DraftDistributions.full([0, 2], torch.tensor([[0.2, 0.2, 0.6], [0.0, 0.5, 0.5]]))
    assert acceptance_probabilities(p, q) == pytest.approx([0.2 + 0.2 + 0.2, 0.0 + 0.1 + 0.5])
    one_hot = DraftDistributions.one_hot([1], positions=2)  # one proposed token, then nothing
    assert acceptance_probabilities(p, one_hot) == pytest.approx([0.3, 0.0])
    assert acceptance_probabilities([1, 2], one_hot) == [1.0, 0.0]  # p one-hot on the reference tokens
    assert acceptance_probabilities([0, 2], one_hot) == [0.0, 0.0]


def _drafters(models):
    target, draft = models
    return {"trained": ModelDrafter(draft, "draft"), "kept-cache": CachedDraftModel(draft, "kept", lean=False),
            "self": ModelDrafter(target, "self"), "lookup": LookupDrafter(),
            "hybrid": HybridDrafter(ModelDrafter(target, "self"), min_ngram=2)}


@pytest.mark.parametrize("name", ["trained", "kept-cache", "self", "lookup", "hybrid"])
def test_temperature_zero_is_greedy_acceptance_exactly(models, points, name):
    drafter = _drafters(models)[name]
    greedy = evaluate_drafter(drafter, points, k=16)
    at = evaluate_at_temperatures(drafter, None, points, [0.0], k=16)
    row = at["temperatures"]["0.0"]
    assert [p["0.0"] for p in at["per_point"]] == [p["accepted"] for p in greedy["per_point"]]
    assert row["mean_expected_accepted_pooled"] == greedy["mean_accepted_pooled"]
    assert row["mean_expected_accepted_per_prompt"] == greedy["mean_accepted_per_prompt"]
    assert row["expected_cumulative_acceptance"] == greedy["cumulative_acceptance"]
    assert row["expected_conditional_acceptance"] == greedy["conditional_acceptance"]
    if name == "self":
        assert len({p["accepted"] for p in greedy["per_point"]}) > 3  # lengths of every kind, not all 0 or 16


@torch.inference_mode()
def test_at_temperature_recomputed_from_the_distributions(models, points):
    """alpha_i recomputed here: the model draft's q from its own full forward, lookup's q one-hot on its draft."""
    target, draft = models
    params = SamplingParams(temperature=0.7, top_k=50)
    for drafter in (ModelDrafter(draft), LookupDrafter()):
        got = evaluate_at_temperatures(drafter, target, points, [0.7], k=16, top_k=50)
        for point, row in zip(points, got["per_point"]):
            seq = torch.tensor([point.context_ids + point.target_ids[:15]])
            p = warp_probs(target(input_ids=seq).logits[0, -16:], params)
            if isinstance(drafter, LookupDrafter):
                proposal = lookup_draft(point.context_ids, 16)
                alphas = [float(p[i, t]) for i, t in enumerate(proposal)] + [0.0] * (16 - len(proposal))
            else:
                q = warp_probs(draft(input_ids=seq).logits[0, -16:], params)
                alphas = torch.minimum(p, q).sum(-1).tolist()
            assert row["0.7"] == pytest.approx(expected_accepted_length(alphas), abs=1e-5)


def test_path_logits_is_one_forward_over_the_path(models):
    target, _ = models
    ctx, cont = [5, 6, 7], [8, 9, 10]
    full = target(input_ids=torch.tensor([ctx + cont])).logits[0]
    assert torch.allclose(path_logits(target, ctx, cont), full[2:5], atol=1e-5)


def test_temperature_zero_takes_the_draft_as_the_drafter_decodes_it(models, points):
    """An int4 draft's teacher-forced pass may break a near-tie the other way than its decode steps: at
    temperature 0 the figure comes from the draft it decodes (here one that differs from its forward's argmax)."""
    target, draft = models

    class DecodesOtherwise(ModelDrafter):
        def draft(self, contexts, num_tokens):
            return [[(t + 1) % 300 for t in row] for row in super().draft(contexts, num_tokens)]

    drafter = DecodesOtherwise(target)
    at = evaluate_at_temperatures(drafter, target, points, [0.0, 1.0], k=16)
    greedy = evaluate_drafter(drafter, points)
    assert [p["0.0"] for p in at["per_point"]] == [p["accepted"] for p in greedy["per_point"]]
    assert at["temperatures"]["1.0"]["mean_expected_accepted_pooled"] > 0  # the forward's own distribution there


@torch.inference_mode()
def test_points_on_one_path_share_a_forward_and_score_as_alone(models, monkeypatch):
    """A prompt's points at offsets 0, 4, 8 lie on one token path: one target forward and one draft forward
    serve all three, with the figures each point gets alone; temperature 0 scores the greedy pass's drafts."""
    import specdraft.drafting.acceptance as acceptance

    target, draft = models
    prompt = [7, 8, 9, 10, 11]
    continuation = naive_greedy(target, prompt, 24, stop_at_eos=False).tokens
    on_path = [ValidationPoint("a", "x", off, prompt + continuation[:off], continuation[off:off + 16])
               for off in (0, 4, 8)]
    elsewhere = ValidationPoint("b", "x", 0, [20, 21, 22], naive_greedy(target, [20, 21, 22], 16).tokens)
    pts = [on_path[1], elsewhere, on_path[0], on_path[2]]
    assert sorted(len(m) for _, _, m in acceptance.shared_paths(pts, 16)) == [1, 3]
    forwards = []
    counted = acceptance.path_logits

    def counting(model, context, cont):
        forwards.append(len(context) + len(cont))
        return counted(model, context, cont)

    monkeypatch.setattr(acceptance, "path_logits", counting)
    drafter = ModelDrafter(draft)
    greedy = evaluate_drafter(drafter, pts, k=16)
    shared = evaluate_at_temperatures(drafter, target, pts, [0.0, 0.7], k=16,
                                      greedy_drafts=[row["draft"] for row in greedy["per_point"]])
    assert len(forwards) == 2  # one per path, not one per point
    alone = [evaluate_at_temperatures(drafter, target, [p], [0.0, 0.7], k=16)["per_point"][0] for p in pts]
    for got, want in zip(shared["per_point"], alone):
        assert got["0.0"] == want["0.0"] and got["0.7"] == pytest.approx(want["0.7"], abs=1e-4)
    assert [row["0.0"] for row in shared["per_point"]] == [row["accepted"] for row in greedy["per_point"]]
