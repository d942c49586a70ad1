"""The hybrid's rule measured, not fixed: the rule as data, the fixed rule unchanged, lookup's match length, the
calibration split, and a choice made on calibration points only."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdraft.core.records import ValidationPoint
from specdraft.drafting.base import Drafter
from specdraft.drafting.hybrid import DEFAULT_HYBRID_MIN_NGRAM, HybridDrafter
from specdraft.drafting.hybrid_rule import (
    AGAINST_BETTER,
    CANDIDATE_MIN_MATCH,
    MIN_CATEGORY_PROMPTS,
    HybridRule,
    RulePoint,
    against_better,
    calibration_split,
    candidate_key,
    choose_rule,
    measure_rules,
    rule_points,
)
from specdraft.drafting.lookup import MAX_MATCH, lookup_draft, lookup_match
from specdraft.drafting.metrics import accepted_length


class Constant(Drafter):
    """Drafts the same tokens everywhere (a stand-in model)."""

    name = "const"

    def __init__(self, tokens):
        self.tokens = tokens

    def draft(self, contexts, n):
        return [list(self.tokens[:n]) for _ in contexts]


def test_match_length_counts_the_tokens_before_the_copied_occurrence():
    ctx = [9, 1, 2, 3, 4, 5, 7, 8, 6, 2, 3, 4, 5]
    # the 4-gram 2 3 4 5 recurs; before it 1 vs 6: a match of 4, the copy what followed (7 8 6 ...)
    assert lookup_match(ctx, 3) == ([7, 8, 6], 4)
    restated = [5, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6]
    assert lookup_match(restated, 2) == ([7, 0], 6)  # 1..6 restated whole (before it 0 vs 5)
    long = list(range(100)) * 2
    assert lookup_match(long, 1)[1] == MAX_MATCH  # measured back only so far
    assert lookup_match([1, 2, 3], 4) == ([], 0)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4))
def test_the_fixed_rule_is_the_threshold_min_ngram_on_the_match_length(ctx, min_ngram):
    """lookup at n = 4..min_ngram finds a draft exactly where the match length reaches min_ngram, the same one."""
    draft, match = lookup_match(ctx, 5, 4, 1)
    assert lookup_draft(ctx, 5, 4, min_ngram) == (draft if match >= min_ngram else [])
    assert HybridRule(min_ngram).uses_lookup(match) == bool(lookup_draft(ctx, 5, 4, min_ngram))


def test_the_hybrid_keeps_its_default_behaviour_and_applies_a_rule():
    rng = random.Random(5)
    contexts = [[rng.randrange(6) for _ in range(rng.randrange(2, 30))] for _ in range(60)]
    model = [99] * 16
    fixed = HybridDrafter(Constant(model))  # as before: lookup first wherever the last 2+ tokens recur
    assert fixed.name == "const+lookup2" and fixed.rule == HybridRule(DEFAULT_HYBRID_MIN_NGRAM)
    assert fixed.draft(contexts, 8) == [lookup_draft(c, 8, 4, 2) or model[:8] for c in contexts]
    for t in (1, 3, 8, None):
        hybrid = HybridDrafter(Constant(model), rule=HybridRule(t, {"other": 1}))
        expect = []
        for c in contexts:
            draft, match = lookup_match(c, 8)
            expect.append(draft if t is not None and match >= t else model[:8])
        assert hybrid.draft(contexts, 8) == expect  # the overall threshold: a context has no category here
        assert hybrid.lookup_used == sum(e != model[:8] for e in expect)
    assert HybridDrafter(Constant(model), rule=HybridRule(None)).name == "const+lookup-never"


def test_a_rule_round_trips_as_json_and_refuses_bad_thresholds():
    rule = HybridRule(3, {"turn2/writing": 1, "turn1/math": None})
    assert HybridRule.from_json(rule.to_json()) == rule
    assert rule.for_category("turn1/math") == HybridRule(None) and rule.for_category("x") == HybridRule(3)
    assert rule.uses_lookup(5, "turn2/writing") and not rule.uses_lookup(5, "turn1/math")
    for bad in ({"min_match": 0}, {"min_match": "2"}, {"min_match": 2, "per_category": {"a": True}}, {}, []):
        with pytest.raises(ValueError, match="hybrid rule"):
            HybridRule.from_json(bad)


def test_rule_points_score_lookup_beside_the_model():
    ctx = [1, 2, 3, 4, 7, 8, 1, 2, 3, 4]
    points = [ValidationPoint("p", "c", 0, ctx, [7, 8, 9] + [0] * 13),
              ValidationPoint("q", "c", 0, [5, 6], [1] * 16)]
    rows = rule_points(points, [2, 5], 16)
    draft, match = lookup_match(ctx, 16)
    assert rows[0] == RulePoint("p", "c", 10, 2, accepted_length(draft, points[0].target_ids), match)
    assert rows[0].lookup == 2 and rows[0].match == 4
    assert rows[1] == RulePoint("q", "c", 2, 5, 0, 0)
    assert rows[1].accepted(HybridRule(1)) == 5  # no lookup draft: the model's
    assert rows[1].accepted(None) == 0  # lookup alone has nothing there


def _points(prompts, category, model, lookup, match, per_prompt=2):
    return [RulePoint(f"{category}-{i}", category, 100, model, lookup, match)
            for i in range(prompts) for _ in range(per_prompt)]


def test_the_split_alternates_prompts_within_each_category():
    points = _points(4, "a", 1, 1, 1) + _points(3, "b", 1, 1, 1)
    side = calibration_split(points)
    calibration = {p.id for p, c in zip(points, side) if c}
    reported = {p.id for p, c in zip(points, side) if not c}
    assert calibration == {"a-0", "a-2", "b-0", "b-2"} and reported == {"a-1", "a-3", "b-1"}
    assert not calibration & reported  # a prompt's points are on one side


def test_the_rule_is_chosen_on_calibration_points_and_reported_on_the_others():
    """Calibration says lookup pays wherever it matches; the reported prompts say the opposite. The chosen rule
    follows calibration, and its reported figure is what it accepts on the reported prompts."""
    points = []
    for i in range(8):
        good = i % 2 == 0  # calibration prompts (every other): lookup accepts 6, the model 1
        points += [RulePoint(f"p{i}", "chat", 300, 1 if good else 5, 6 if good else 0, 1)] * 3
    record = measure_rules(points)
    assert HybridRule.from_json(record["chosen"]) == HybridRule(1)  # lookup wherever it matches
    assert record["split"]["calibration"] == {"points": 12, "prompts": 4}
    assert record["split"]["reported"] == {"points": 12, "prompts": 4}
    calibration = record["calibration"]["overall"]
    assert calibration[candidate_key(1)]["mean_accepted"] == 6 and calibration["draft_only"]["mean_accepted"] == 1
    reported = record["reported"]["overall"]
    assert reported["chosen"] == {"points": 12, "prompts": 4, "accepted_total": 0, "mean_accepted": 0.0,
                                  "mean_accepted_per_prompt": 0.0}
    assert reported["draft_only"]["accepted_total"] == 60  # the better rule there, not chosen: never seen
    assert reported["better_of_two"]["accepted_total"] == 60  # the better of the two at each reported point
    assert "better_of_two" not in calibration
    assert "chosen" not in calibration
    assert record["reported"]["per_context_length"]["256-1K"]["chosen"]["points"] == 12


def test_the_ceiling_is_the_better_of_the_two_at_each_point_and_no_rule_exceeds_it():
    points = []
    for i in range(12):
        model, lookup, match = (i * 7) % 5, (i * 3) % 9, i % 4
        points += [RulePoint(f"p{i}", "mixed" if i % 3 else "other", 100 + 40 * i, model, lookup, match)] * 2
    reported = measure_rules(points)["reported"]
    for row in [reported["overall"], *reported["per_category"].values(), *reported["per_context_length"].values()]:
        ceiling = row["better_of_two"]["accepted_total"]
        assert all(cell["accepted_total"] <= ceiling for key, cell in row.items() if key != AGAINST_BETTER)
    side = calibration_split(points)
    assert reported["overall"]["better_of_two"]["accepted_total"] == sum(
        max(p.model, p.lookup) for p, c in zip(points, side) if not c)


def _prompts(category, prompts, points, model, lookup, match=20, first=0):
    return [RulePoint(f"{category}{i}", category, 10, model, lookup, match)
            for i in range(first, first + prompts) for _ in range(points)]


def test_a_category_gets_its_own_rule_only_where_it_holds_prompt_by_prompt():
    """Every match here is 20 tokens long: no overall threshold tells the categories apart. "new" (the most points:
    the model wins) makes the overall rule "never"; "copy" gains from lookup on each of its 4 prompts; "mixed"
    gains in sum from one prompt and loses on its other 3; "few" gains on each of too few prompts."""
    new = _prompts("new", 10, 4, model=4, lookup=0)
    copy = _prompts("copy", MIN_CATEGORY_PROMPTS, 2, model=1, lookup=8)
    mixed = (_prompts("mixed", 1, 4, model=0, lookup=16)
             + _prompts("mixed", MIN_CATEGORY_PROMPTS - 1, 4, model=3, lookup=2, first=1))
    few = _prompts("few", MIN_CATEGORY_PROMPTS - 1, 1, model=1, lookup=8)
    rule = choose_rule(new + copy + mixed + few)
    assert rule.min_match is None
    assert rule.per_category == {"copy": 1}  # the first threshold of the tie: lookup wherever it matches
    # "mixed"'s summed gain is real on these points (+52), one prompt's: a rule that summed it would take it
    gain = sum(p.accepted(HybridRule(1)) - p.accepted(HybridRule(None)) for p in mixed)
    assert gain == 52
    # where the match length tells them apart, the overall threshold does it alone: above "new"'s short matches,
    # below "copy"'s long ones (3, the first of the tie)
    rule = choose_rule(_prompts("new", 10, 4, model=4, lookup=0, match=2) + copy)
    assert rule.min_match == 3 and rule.per_category == {}
    assert set(CANDIDATE_MIN_MATCH) >= {None, DEFAULT_HYBRID_MIN_NGRAM}
    with pytest.raises(ValueError, match="no calibration points"):
        choose_rule([])


def test_a_rule_against_the_better_of_the_two_tells_a_shortfall_from_noise():
    """Lookup is the better of the two in each group. Where the rule loses to it on every prompt the whole interval is
    below zero; where it loses on one prompt of six, the mean is below but the interval reaches zero (its
    resamples often leave that prompt out); where it is lookup itself, the difference is zero."""
    never = HybridRule(None)
    everywhere = [RulePoint(f"p{i}", "c", 10, 1, 3, 5) for i in range(6) for _ in range(2)]
    shortfall = against_better(everywhere, never)
    assert shortfall["better"] == "lookup_alone" and shortfall["difference"] == -2
    assert shortfall["interval_90"] == [-2, -2] and shortfall["below"] and not shortfall["above"]
    one = [RulePoint(f"p{i}", "c", 10, 3 if i else 1, 3, 5) for i in range(6) for _ in range(2)]
    noisy = against_better(one, never)
    assert noisy["difference"] < 0 and noisy["interval_90"][1] == 0 and not noisy["below"]
    assert against_better(everywhere, HybridRule(1))["difference"] == 0
    model_better = [RulePoint(f"p{i}", "c", 10, 4, 3, 5) for i in range(3)]
    assert against_better(model_better, never)["better"] == "draft_only"


def test_every_reported_group_carries_the_chosen_rule_against_the_better_of_the_two():
    points = [RulePoint(f"p{i}", "ab"[i % 4 // 2], 10, i % 3, (i * 5) % 7, i % 5) for i in range(16) for _ in range(2)]
    reported = measure_rules(points)["reported"]
    for row in [reported["overall"], *reported["per_category"].values(), *reported["per_context_length"].values()]:
        cell = row[AGAINST_BETTER]
        best = max(row["draft_only"]["accepted_total"], row["lookup_alone"]["accepted_total"])
        assert cell["difference"] == pytest.approx((row["chosen"]["accepted_total"] - best) / row["chosen"]["points"])
        assert cell["interval_90"][0] <= cell["difference"] <= cell["interval_90"][1]
