import pytest
import torch

from specdraft.model.sampling import GREEDY, SamplingParams, sample_from, warp_probs


def test_greedy_is_the_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    assert warp_probs(logits, GREEDY).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_one_is_softmax_and_rows_sum_to_one():
    logits = torch.randn(3, 11)
    probs = warp_probs(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, logits.softmax(-1))
    torch.testing.assert_close(warp_probs(logits, SamplingParams(temperature=0.5)), (logits / 0.5).softmax(-1))


def test_top_k_and_top_p_keep_the_expected_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert (warp_probs(logits, SamplingParams(temperature=1.0, top_k=2)) > 0).tolist() == [True, True, False, False]
    # 0.5 + 0.3 = 0.8 < 0.85, so the third token is needed; the fourth is not.
    kept = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.85))
    assert (kept > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(kept[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    # A tiny top_p still keeps the most likely token.
    assert (warp_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6)) > 0).tolist() == [True, False, False, False]


def test_sampling_is_seeded():
    probs = warp_probs(torch.randn(5, 50), SamplingParams(temperature=1.0))
    draw = lambda: sample_from(probs, torch.Generator().manual_seed(7)).tolist()  # noqa: E731
    assert draw() == draw()
    assert sample_from(probs.unsqueeze(0)).shape == (1, 5)


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": -1.0}), ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("top_k", {"top_k": -2})])
def test_bad_settings_name_their_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook top-p: sort the whole vocabulary, keep while the mass before a token is under top_p."""
    probs = logits.softmax(-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])  # flat rows need a nucleus past the first top-k
def test_top_p_equals_a_full_sort_of_the_vocabulary(top_p, scale):
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3)) * scale
    torch.testing.assert_close(warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)),
                               _nucleus_by_full_sort(logits, top_p))


def test_sample_from_draws_the_distribution_and_never_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    draws = sample_from(probs.expand(20000, -1).contiguous(), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).float() / 20000
    assert counts[[0, 2, 5]].sum() == 0
    # 20,000 draws: each frequency within 0.02 of its probability (about 4.5 standard deviations at p = 0.5)
    assert torch.allclose(counts, probs, atol=0.02)
