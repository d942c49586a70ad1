"""The guided hybrid rules: lookup's copies as the model's guides instead of its replacement. The accepted length
walked from the model's distributions along the target, the rule as data, a guided rule chosen only where the
calibration points say it accepts more, the eval's record measuring the chosen one by drafting, and the client
sending the guide only where the rule uses lookup."""

import json

import httpx
import pytest
import torch

from specdraft.core.records import ValidationPoint
from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.hybrid_rule import (
    GUIDE_MIN_RATIOS,
    HybridRule,
    RulePoint,
    candidate_key,
    choose_rule,
    guided_accepted,
    measure_rules,
)
from specdraft.drafting.lookup import lookup_continuations
from specdraft.drafting.remote import HTTPDrafter
from specdraft.stages.evaluate import hybrid_rule_record

V = 10


def rows_with(tops: list[int], extra: dict[int, tuple[int, float]]) -> torch.Tensor:
    """Distributions [n, V]: 0.5 on each position's top token, the rest spread evenly, and at the positions of
    ``extra`` its token given the stated probability."""
    probs = torch.full((len(tops), V), 0.5 / (V - 1))
    for i, t in enumerate(tops):
        probs[i, t] = 0.5
    for i, (t, p) in extra.items():
        probs[i, t] = p
    return probs


def test_the_walk_takes_the_guide_while_its_token_has_the_ratio_then_the_models_own():
    target = [1, 2, 3, 4, 5]
    guide = [1, 2, 7, 4, 5]  # wrong at position 2
    # the model's top is the target everywhere: leaving the guide at 2 keeps it right to the end
    probs = rows_with(target, {2: (7, 0.01)})
    assert guided_accepted(probs, target, [guide], 0.1) == 5  # 0.01 < 0.1 * 0.5: the guide's 7 refused
    assert guided_accepted(probs, target, [guide], 0.01) == 2  # 0.01 >= 0.01 * 0.5: taken, and wrong
    # an earlier occurrence's copy beside it: where the two part, the draft takes the one it finds likelier
    assert guided_accepted(probs, target, [guide, [1, 2, 3, 4, 5]], 0.01) == 5
    # the model's top is wrong at 1, the guide right there with enough weight: the guide carries it
    probs = rows_with([1, 9, 3, 4, 5], {1: (2, 0.2)})
    assert guided_accepted(probs, target, [[1, 2, 3, 4, 5]], 0.3) == 5
    assert guided_accepted(probs, target, [[1, 2, 3, 4, 5]], 0.5) == 1
    assert guided_accepted(probs, target, [], 0.1) == 1  # no guide: the model alone
    # once off the guides it never takes them again, even where they hold the target
    probs = rows_with([1, 9, 9, 4, 5], {1: (2, 0.01)})
    assert guided_accepted(probs, [1, 9, 3, 4, 5], [[1, 2, 3, 4, 5]], 0.1) == 2


def test_the_rule_as_data_and_its_checks():
    rule = HybridRule(3, {"turn2/writing": 1}, 0.1)
    assert HybridRule.from_json(json.loads(json.dumps(rule.to_json()))) == rule
    assert HybridRule.from_json({"min_match": 2}) == HybridRule(2)  # records from before the guided rules
    assert rule.for_category("turn2/writing") == HybridRule(1, guide_min_ratio=0.1)
    assert "guided" in rule.describe() and rule.guided and not HybridRule(2).guided
    for bad in (0, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match="guide_min_ratio"):
            HybridRule(2, guide_min_ratio=bad)
    assert candidate_key(3, 0.1) != candidate_key(3) and candidate_key(None, 0.1) == "draft_only"


def point(pid: str, model: int, lookup: int, match: int, guided: int | None) -> RulePoint:
    return RulePoint(pid, "chat", 100, model, lookup, match,
                     {} if guided is None else {r: guided for r in GUIDE_MIN_RATIOS})


def test_a_guided_rule_is_chosen_only_where_it_accepts_more_and_only_when_scored():
    plain = [point(f"p{i}", 3, 4, 2, None) for i in range(8)]
    assert not measure_rules(plain)["chosen"]["guide_min_ratio"]  # unscored: the plain candidates only
    assert all(not c["guide_min_ratio"] for c in measure_rules(plain)["candidates"].values())
    better = [point(f"p{i}", 3, 4, 2, 6) for i in range(8)]
    record = measure_rules(better)
    assert HybridRule.from_json(record["chosen"]) == HybridRule(1, guide_min_ratio=GUIDE_MIN_RATIOS[0])
    assert record["reported"]["overall"]["chosen"]["mean_accepted"] == 6
    assert record["calibration"]["overall"][candidate_key(1, 0.1)]["mean_accepted"] == 6
    tie = [point(f"p{i}", 3, 4, 2, 4) for i in range(8)]
    assert choose_rule(tie) == HybridRule(1)  # a tie goes to the plain rule: lookup's draft costs no model call
    # more in sum, through one prompt of eight: within the prompts' noise, so the plain rule stays
    one = [point(f"p{i}", 3, 4, 2, 12 if i == 0 else 4) for i in range(8) for _ in range(2)]
    assert choose_rule(one) == HybridRule(1)
    assert measure_rules(one + [point(f"q{i}", 3, 4, 2, 4) for i in range(8)])["guided_against_plain"]["above"] is False
    assert measure_rules(better)["guided_against_plain"]["above"] is True
    assert point("x", 3, 4, 0, None).accepted(HybridRule(1, guide_min_ratio=0.1)) == 3  # no lookup draft: model


class Guided(Drafter):
    """Records what it is asked; drafts ``answer(context, its first guide)``."""

    name = "guided"
    follows_guides = True
    teacher_forced_paths = True

    def __init__(self, answer, probs=None):
        self.answer, self.probs, self.calls = answer, probs, []

    def draft(self, contexts, n):
        return [self.answer(c, [])[:n] for c in contexts]

    def draft_guided(self, contexts, n, guides, min_ratios):
        self.calls.append((list(map(list, contexts)), [[list(g) for g in gs] for gs in guides], list(min_ratios)))
        return [self.answer(c, gs[0] if gs else [])[:n] for c, gs in zip(contexts, guides)]

    def path_probs(self, context, continuation, settings):
        return [DraftDistributions.full([0] * len(continuation), self.probs(context, continuation))]


def test_the_hybrid_sends_lookups_copies_as_the_guides_only_where_the_rule_uses_it():
    repeated = [1, 2, 3, 4, 1, 2, 3, 5, 6, 1, 2, 3]  # lookup: match 3, copies 5 6 1 2 then 4 1 2 3
    fresh = [7, 8, 9]
    model = Guided(lambda c, g: (g or [0]) * 2)
    hybrid = HybridDrafter(model, rule=HybridRule(3, guide_min_ratio=0.3))
    assert hybrid.draft([repeated, fresh], 4) == [[5, 6, 1, 2], [0, 0]]
    assert model.calls == [([repeated, fresh], [[[5, 6, 1, 2], [4, 1, 2, 3]], []], [0.3, 0.3])]
    assert hybrid.lookup_used == 1 and hybrid.model_used == 1
    assert "guided0.3" in hybrid.name
    with pytest.raises(ValueError, match="guides"):
        HybridDrafter(Drafter.__new__(type("Plain", (Drafter,), {"draft": lambda self, c, n: []})),
                      rule=HybridRule(3, guide_min_ratio=0.3))
    with pytest.raises(DrafterError, match="does not follow guides"):
        Drafter.draft_guided(model, [[1]], 4, [[[2]]], [0.1])


def test_the_http_drafter_sends_the_guides_and_their_ratio():
    bodies = []

    def handle(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"draft_ids": [1, 2], "model": "m"})
    with HTTPDrafter("http://server", concurrency=2, transport=httpx.MockTransport(handle)) as http:
        assert http.draft_guided([[5, 6], [7], [8]], 2, [[[1, 2, 3], [4, 5, 6]], [], [[3]]], [0.2, 0.2, 0.5]) \
            == [[1, 2]] * 3
        http.draft([[5]], 2)
    by_context = {tuple(b["token_ids"]): b for b in bodies}
    assert by_context[(5, 6)]["guide_ids"] == [1, 2] and by_context[(5, 6)]["guide_min_ratio"] == 0.2
    assert by_context[(5, 6)]["guide_alternatives"] == [[4, 5]]  # each cut to num_tokens, as the first
    assert by_context[(8,)] == {"token_ids": [8], "num_tokens": 2, "guide_ids": [3], "guide_min_ratio": 0.5}
    assert set(by_context[(7,)]) == {"token_ids", "num_tokens"} == set(by_context[(5,)])  # no guide: today's body


def test_the_eval_record_reports_the_chosen_guided_rule_as_drafted_not_as_predicted():
    """Predicted: the guide carries every point through its first 3 tokens and the model's own top takes the 4th,
    where lookup's copy is wrong (lookup alone accepts 3, the model alone 0). Drafted: the reported points accept 2.
    The guided rule is chosen on the predictions and reported as drafted, with how often the two agreed."""
    target = [4, 5, 6, 9]  # lookup copies 4 5 6 1
    points = [ValidationPoint(f"p{i}", "chat", 0, [1, 2, 3, 4, 5, 6, 1, 2, 3], target) for i in range(8)]

    def probs(context, continuation):
        rows = torch.full((len(continuation), V), 0.01)
        rows[:, 0] = 0.5  # the model's own top: wrong everywhere
        for i, t in enumerate(continuation):
            rows[i, t] = 0.6 if i == 3 else 0.4  # the target: 0.8 of the top, then the top itself
        return rows
    drafter = Guided(lambda c, g: target[:2] + [0, 0], probs)
    report = {"per_point": [{"accepted": 0} for _ in points]}
    record = hybrid_rule_record(report, points, 4, drafter, drafter)
    assert HybridRule.from_json(record["chosen"]).guided
    assert record["calibration"]["overall"][candidate_key(1, 0.3)]["mean_accepted"] == 4
    assert record["calibration"]["overall"]["lookup_alone"]["mean_accepted"] == 3
    assert record["reported"]["overall"]["chosen"]["mean_accepted"] == 2  # as drafted
    assert record["guided_check"]["points"] == 4 and record["guided_check"]["predicted_equal"] == 0
    _, guides, _ = drafter.calls[0]
    assert guides == [lookup_continuations(p.context_ids, 4)[0] for p in points[1::2]]  # the reported points only
    assert report["per_point"][0]["lookup_match"] == 3
