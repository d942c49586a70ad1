import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdraft.drafting.lookup import LookupDrafter, lookup_draft
from specdraft.drafting.metrics import AcceptanceStats, accepted_length, paired_difference


def test_accepted_length_is_longest_common_prefix():
    assert accepted_length([1, 2, 3], [1, 2, 4]) == 2
    assert accepted_length([], [1]) == 0
    assert accepted_length([5], [6]) == 0
    assert accepted_length([1, 2], [1, 2, 3]) == 2


@given(st.lists(st.integers(0, 3), min_size=4, max_size=4), st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_accepted_length_matches_definition(draft, target):
    a = accepted_length(draft, target)
    assert draft[:a] == target[:a]
    assert a == 4 or draft[a] != target[a]


def test_stats_recomputed_independently():
    rng = random.Random(0)
    stats, raw = AcceptanceStats(k=4), []
    for p in range(5):
        for _ in range(3):
            target = [rng.randrange(3) for _ in range(4)]
            draft = [rng.randrange(3) for _ in range(4)]
            a = stats.add(draft, target, prompt_id=f"p{p}", category="c" + str(p % 2))
            raw.append((f"p{p}", "c" + str(p % 2), a))
    lengths = [a for _, _, a in raw]
    assert stats.mean_accepted_pooled == sum(lengths) / len(lengths)
    per_prompt = [sum(a for q, _, a in raw if q == p) / 3 for p in {q for q, _, _ in raw}]
    assert abs(stats.mean_accepted_per_prompt - sum(per_prompt) / len(per_prompt)) < 1e-12
    assert sum(stats.histogram) == 15 and sum(i * h for i, h in enumerate(stats.histogram)) == sum(lengths)
    cum = stats.cumulative_acceptance()
    for i in range(4):
        assert cum[i] == sum(a > i for a in lengths) / 15
    cond = stats.conditional_acceptance()
    assert abs(cond[0] - cum[0]) < 1e-12
    for i in range(1, 4):
        if cum[i - 1]:
            assert abs(cond[i] - cum[i] / cum[i - 1]) < 1e-12
    # mean accepted length = sum of cumulative acceptance over positions
    assert abs(sum(cum) - stats.mean_accepted_pooled) < 1e-12
    cats = stats.per_category()
    assert cats["c0"]["points"] == 9 and cats["c1"]["points"] == 6


def test_lookup_copies_latest_earlier_occurrence():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # last 3 tokens (1 2 3; 4-gram 5 1 2 3 has no earlier match) most recently continued with 7 8 5
    assert lookup_draft(ctx, 3) == [7, 8, 5]
    assert lookup_draft([4, 5, 6], 3) == []
    assert LookupDrafter().draft([ctx, [1, 1]], 2) == [[7, 8], [1]]


def test_per_category_and_context_length_are_exact_on_hand_made_points():
    """A point on each side of every bucket edge; counts, sums and both means per group by hand; the overall
    figures are those of the points without groups."""
    from specdraft.drafting.metrics import CONTEXT_BUCKETS, context_bucket

    assert [lower for _, lower in CONTEXT_BUCKETS] == [0, 256, 1024, 4096]
    edges = {1: "<256", 255: "<256", 256: "256-1K", 1023: "256-1K", 1024: "1K-4K", 4095: "1K-4K", 4096: ">=4K",
             100_000: ">=4K"}
    assert {n: context_bucket(n) for n in edges} == edges
    target = list(range(10, 14))
    # (prompt, category, context tokens, accepted length)
    cases = [("a", "x", 255, 4), ("a", "x", 256, 2), ("b", "x", 1023, 0), ("b", "y", 1024, 3),
             ("c", "y", 4095, 1), ("c", "y", 4096, 4), ("d", "y", 10, 2)]
    stats, plain = AcceptanceStats(k=4), AcceptanceStats(k=4)
    for pid, cat, n, a in cases:
        draft = target[:a] + [0] * (4 - a)
        assert stats.add(draft, target, prompt_id=pid, category=cat, context_tokens=n) == a
        plain.add(draft, target, prompt_id=pid, category=cat)
    summary = stats.summary()
    assert summary["per_category"] == {
        "x": {"points": 3, "prompts": 2, "accepted_total": 6, "mean_accepted": 2.0,
              "mean_accepted_per_prompt": ((4 + 2) / 2 + 0) / 2},
        "y": {"points": 4, "prompts": 3, "accepted_total": 10, "mean_accepted": 2.5,
              "mean_accepted_per_prompt": (3 + (1 + 4) / 2 + 2) / 3}}
    assert summary["per_context_length"] == {
        "<256": {"points": 2, "prompts": 2, "accepted_total": 6, "mean_accepted": 3.0,
                 "mean_accepted_per_prompt": 3.0},
        "256-1K": {"points": 2, "prompts": 2, "accepted_total": 2, "mean_accepted": 1.0,
                   "mean_accepted_per_prompt": 1.0},
        "1K-4K": {"points": 2, "prompts": 2, "accepted_total": 4, "mean_accepted": 2.0,
                  "mean_accepted_per_prompt": 2.0},
        ">=4K": {"points": 1, "prompts": 1, "accepted_total": 4, "mean_accepted": 4.0,
                 "mean_accepted_per_prompt": 4.0}}
    assert list(summary["per_context_length"]) == [label for label, _ in CONTEXT_BUCKETS]  # in the buckets' order
    # the overall figures do not depend on the groups
    without = plain.summary()
    assert without["per_context_length"] == {}
    assert {k: v for k, v in summary.items() if k != "per_context_length"} == {
        k: v for k, v in without.items() if k != "per_context_length"}
    assert summary["accepted_total"] == 16 and summary["points"] == 7


def test_a_paired_difference_resamples_prompts_whole():
    """Two prompts: one 4 points at +1, one 1 point at -2. The mean is per point; a resample takes each prompt's
    points together: a, a (1.0), a, b (0.4) or b, b (-2.0), each end a quarter of the draws."""
    out = paired_difference([1, 1, 1, 1, -2], ["a", "a", "a", "a", "b"], resamples=400)
    assert out["prompts"] == 2 and out["difference"] == pytest.approx(0.4)
    assert out["interval_90"] == [-2.0, 1.0]
    assert not out["below"] and not out["above"]
    assert paired_difference([-1, -3, -1, -2], ["a", "b", "c", "d"])["below"]
    assert paired_difference([2, 1, 1, 1, 3], ["a", "b", "b", "c", "d"])["above"]
    few = paired_difference([-1, -3, -2], ["a", "b", "c"])  # every resample below, but too few prompts to say so
    assert few["interval_90"][1] < 0 and not few["below"]
    with pytest.raises(ValueError):
        paired_difference([1], ["a", "b"])


@given(st.lists(st.tuples(st.integers(-16, 16), st.sampled_from("abcde")), min_size=1, max_size=30))
def test_a_paired_difference_lies_within_its_extremes(rows):
    out = paired_difference([d for d, _ in rows], [p for _, p in rows], resamples=50)
    per_prompt: dict = {}
    for d, p in rows:
        per_prompt.setdefault(p, []).append(d)
    means = [sum(v) / len(v) for v in per_prompt.values()]
    assert min(means) - 1e-9 <= out["interval_90"][0] <= out["interval_90"][1] <= max(means) + 1e-9
