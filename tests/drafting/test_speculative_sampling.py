"""Speculative sampling is lossless: its output tokens are distributed as plain sampling from the target.

Tiny random target and draft (vocabulary 8) that disagree; the exact distribution of each output position under
plain sampling is enumerated from the target (every continuation), and the speculative sampler's empirical
frequencies over N seeded runs must lie within a distribution-free bound of it. The same test run with a broken
acceptance rule falls outside the bound: the test has the power to see it.
"""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.drafting import speculative
from specdraft.drafting.base import DraftDistributions
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.lookup import LookupDrafter
from specdraft.drafting.speculative import residual_distribution, speculative_generate
from specdraft.model.sampling import SamplingParams, warp_probs
from specdraft.model.targets import TargetModel, TorchTarget

VOCAB, NEW_TOKENS, K = 8, 4, 2
PROMPT = [3, 1, 4, 1, 5]
PARAMS = SamplingParams(temperature=0.8, top_k=6)
FALSE_FAILURE = 1e-6  # chance that the correct sampler fails the bound, over all positions together


def tiny_lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.6)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models():
    return tiny_lm(1), tiny_lm(2)


@torch.inference_mode()
def exact_marginals(model, prompt, positions, params) -> torch.Tensor:
    """[positions, V]: P(token at each output position) under plain sampling, every continuation enumerated."""
    marginals = torch.zeros(positions, VOCAB, dtype=torch.float64)
    prefixes = [()]
    weights = torch.ones(1, dtype=torch.float64)
    for pos in range(positions):
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        probs = warp_probs(model(input_ids=batch).logits[:, -1], params).double()  # [len(prefixes), V]
        joint = weights[:, None] * probs
        marginals[pos] = joint.sum(0)
        prefixes = [p + (x,) for p in prefixes for x in range(VOCAB)]
        weights = joint.reshape(-1)
    return marginals


def l1_bound(samples: int) -> float:
    """Weissman et al. (2003): P(||empirical - true||_1 >= eps) <= (2^V - 2) exp(-N eps^2 / 2); split over the
    positions (union bound) for a total chance FALSE_FAILURE of failing the correct sampler."""
    return math.sqrt(2 / samples * math.log(NEW_TOKENS * (2 ** VOCAB - 2) / FALSE_FAILURE))


def speculative_frequencies(target, drafter, samples, seed=0) -> torch.Tensor:
    counts = torch.zeros(NEW_TOKENS, VOCAB, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        gen = speculative_generate(target, drafter, PROMPT, NEW_TOKENS, K, eos_ids=set(), sampling=PARAMS,
                                   generator=generator)
        assert len(gen.tokens) == NEW_TOKENS
        for pos, tok in enumerate(gen.tokens):
            counts[pos, tok] += 1
    return counts / samples


def worst_l1(models, drafter, samples) -> float:
    """The largest L1 distance, over the output positions, between the sampler's frequencies and the exact
    marginals."""
    target_model, _ = models
    exact = exact_marginals(target_model, PROMPT, NEW_TOKENS, PARAMS)
    empirical = speculative_frequencies(TorchTarget(target_model), drafter, samples)
    return float((empirical - exact).abs().sum(-1).max())


def test_the_draft_differs_from_the_target(models):
    """Otherwise any acceptance rule would look lossless."""
    target_model, draft_model = models
    p = exact_marginals(target_model, PROMPT, 1, PARAMS)[0]
    q = exact_marginals(draft_model, PROMPT, 1, PARAMS)[0]
    assert 0.5 * float((p - q).abs().sum()) > 0.3


# (drafter, samples): the re-prefilling draft with the tighter bound (L1 0.26, total variation 0.13, at 600
# samples); the kept-cache draft and prompt lookup (a one-hot q: the residual is p with the drafted token taken
# out) more loosely, for time. A broken rule lands near L1 1.9 here (the draft is far from the target).
DRAFTERS = {
    "model": (lambda draft: ModelDrafter(draft), 600),
    "kept-cache": (lambda draft: CachedDraftModel(draft, lean=False), 300),
    "lookup": (lambda draft: LookupDrafter(), 300),
}


@pytest.mark.parametrize("kind", DRAFTERS)
def test_speculative_sampling_matches_plain_sampling(models, kind):
    make, samples = DRAFTERS[kind]
    assert worst_l1(models, make(models[1]), samples) < l1_bound(samples)


@pytest.mark.parametrize("broken", [
    pytest.param(lambda p_x, q_x: 1.0, id="accept-always"),
    pytest.param(lambda p_x, q_x: 1.0 if q_x >= p_x else q_x / p_x, id="min(1,q/p)"),
])
def test_a_broken_acceptance_rule_fails_the_same_bound(models, monkeypatch, broken):
    monkeypatch.setattr(speculative, "acceptance_probability", broken)
    assert worst_l1(models, ModelDrafter(models[1]), 300) > l1_bound(300)


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)  # nothing left: p itself


def test_greedy_draft_with_probs_is_the_greedy_draft_one_hot(models):
    _, draft = models
    for drafter in (ModelDrafter(draft), CachedDraftModel(draft, lean=False)):
        got = drafter.draft_with_probs([PROMPT], 5, SamplingParams(), torch.Generator().manual_seed(0))[0]
        drafter.reset()
        assert got.ids == drafter.draft_one(PROMPT, 5)
        assert torch.equal(got.dense(VOCAB), torch.nn.functional.one_hot(torch.tensor(got.ids), VOCAB).float())


def test_sampled_drafts_are_seeded_and_carry_their_distribution(models):
    _, draft = models
    runs = [ModelDrafter(draft).draft_with_probs([PROMPT], 3, PARAMS, torch.Generator().manual_seed(7))[0]
            for _ in range(2)]
    assert runs[0].ids == runs[1].ids
    q = runs[0].dense(VOCAB)
    assert torch.allclose(q.sum(-1), torch.ones(3))
    assert all(q[i, t] > 0 for i, t in enumerate(runs[0].ids))
    assert torch.allclose(q[0], warp_probs(draft(input_ids=torch.tensor([PROMPT])).logits[0, -1], PARAMS))


def test_sampling_refuses_a_target_without_probabilities():
    class GreedyOnly(TargetModel):
        engine, vocab_size, eos_ids = "llama.cpp", VOCAB, frozenset()
        prefill = verify = truncate = None

    with pytest.raises(ValueError, match="llama.cpp engine gives its greedy tokens only"):
        speculative_generate(GreedyOnly(), LookupDrafter(), PROMPT, 4, 2, sampling=PARAMS)


def test_dense_q_leaves_out_ids_past_the_vocabulary():
    q = DraftDistributions.full([1], torch.tensor([[0.25, 0.5, 0.0, 0.25]]))  # a draft with a padded 4th row
    assert torch.equal(q.dense(3), torch.tensor([[0.25, 0.5, 0.0]]))
