"""When prompt lookup drafts in front of a draft model: a rule measured on evaluation points, not fixed.

Lookup's copy is free and holds where the answer restates the context (a rewrite of an earlier turn, a
translation keeping names and numbers); the model wins where the answer is new text. The fixed rule (lookup
wherever the context's last ``DEFAULT_HYBRID_MIN_NGRAM`` tokens recur) is one candidate among several, all
thresholds on one signal lookup measures anyway, its match length (``lookup.lookup_match``):

- never: the model drafts everywhere;
- lookup where its match is at least n tokens long, for n in ``CANDIDATE_MIN_MATCH`` (the fixed rule is n = 2);
- guided: where lookup's match is at least n tokens long (n in ``GUIDED_MIN_MATCH``), the model drafts with lookup's
  copies as its guides (``lookup.lookup_continuations``), taking the likeliest proposed token while it has at least r
  of the model's top probability (r in ``GUIDE_MIN_RATIOS``; ``model.generation.GuideFollower``): a copy where the
  model finds it plausible, the model's own tokens from the first place it does not. Scored where the points carry
  the model's distributions along the target's tokens (``RulePoint.guided``, from ``guided_accepted``).

``choose_rule`` picks the best threshold on a calibration split of the points (``calibration_split``: every other
prompt of each category; a guided rule only where it beats the best plain one beyond its prompts' noise), and a
category's own only where it holds prompt by prompt: it beats the overall choice on most of the category's
calibration prompts and loses on none. A category's points come from a few prompts, and a
threshold that wins their sum through one of them tends to lose on the next few (docs/history.md, "A category's
own rule"). ``measure_rules`` scores every candidate and the chosen rule on the other prompts only, so a choice is
never reported on the points that made it, beside the better of the two at each point: the ceiling of any rule that
picks one of them per context, however it decides; and per group against the better of the model alone and lookup
alone there, with a 90% interval over prompts: a group of a few prompts falls short of it by noise alone. The
chosen ``HybridRule`` is data (``to_json`` / ``from_json``) that ``HybridDrafter`` applies: its overall threshold
wherever a context's category is unknown (a served request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from specdraft.core.records import ValidationPoint
from specdraft.drafting.lookup import MAX_NGRAM, lookup_match
from specdraft.drafting.metrics import (
    CONTEXT_BUCKETS,
    accepted_length,
    context_bucket,
    group_summary,
    paired_difference,
)
from specdraft.model.generation import GuideFollower

DEFAULT_HYBRID_MIN_NGRAM = 2
# The thresholds tried, most lookup first (a tie goes to the rule that drafts more for free); None: never lookup
CANDIDATE_MIN_MATCH: tuple[int | None, ...] = (1, 2, 3, 4, 8, 16, None)
# The guided rules tried: the weight a guide token needs against the model's top token, and the match lengths from
# which lookup's copies become the guides (fewer than for the plain thresholds: the model vets every guide token)
GUIDE_MIN_RATIOS: tuple[float, ...] = (0.03, 0.1, 0.3)
GUIDED_MIN_MATCH: tuple[int | None, ...] = (1, 3, 8, None)
# A category gets a threshold of its own only from this many calibration prompts (and only where that threshold
# wins on most of them and loses on none): fewer, and its choice would follow the noise of one or two prompts
MIN_CATEGORY_PROMPTS = 4
# The column of the better of the two at each point (``RulePoint.better_of_two``): how far from it a rule is
CEILING = "better_of_two"
# The chosen rule against the better of the model alone and lookup alone over a group (``against_better``)
AGAINST_BETTER = "against_better"
SPLIT_NOTE = ("calibration: every other prompt of each category (the 1st, 3rd, ... in the file's order); reported: "
              "the others. The rule is chosen on the calibration prompts alone and scored on the reported ones.")


@dataclass(frozen=True)
class HybridRule:
    """Lookup drafts in front of the model where its match length (``lookup_match``) is at least ``min_match``
    tokens (None: never); ``per_category`` overrides it for the categories a calibration found better served
    otherwise (used only where the caller knows a context's category). With ``guide_min_ratio`` r, lookup's copies
    are there the model's guides instead of its replacement: the model drafts, taking the likeliest proposed token
    while it has at least r of the model's top probability."""

    min_match: int | None = DEFAULT_HYBRID_MIN_NGRAM
    per_category: Mapping[str, int | None] = field(default_factory=dict)
    guide_min_ratio: float | None = None

    def __post_init__(self):
        for where, t in (("min_match", self.min_match), *self.per_category.items()):
            if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 1):
                raise ValueError(f"hybrid rule: {where} must be an integer >= 1 or null (never lookup), got {t!r}")
        r = self.guide_min_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1):
            raise ValueError(f"hybrid rule: guide_min_ratio must be a number in (0, 1] or null, got {r!r}")

    @property
    def guided(self) -> bool:
        return self.guide_min_ratio is not None

    def threshold(self, category: str | None = None) -> int | None:
        if category is not None and category in self.per_category:
            return self.per_category[category]
        return self.min_match

    def uses_lookup(self, match: int, category: str | None = None) -> bool:
        """Whether lookup's draft (of match length ``match``, 0: none) is proposed instead of the model's."""
        t = self.threshold(category)
        return t is not None and match >= t

    def for_category(self, category: str) -> "HybridRule":
        """The rule one category's contexts get, as a rule without categories."""
        return HybridRule(self.threshold(category), guide_min_ratio=self.guide_min_ratio)

    def describe(self) -> str:
        words = candidate_label(self.min_match, self.guide_min_ratio)
        if self.per_category:
            words += "; " + ", ".join(f"{c}: {candidate_label(t, self.guide_min_ratio)}"
                                      for c, t in sorted(self.per_category.items()))
        return words

    def to_json(self) -> dict[str, Any]:
        what = ("prompt lookup drafts in front of the model where its match length (the context's last tokens equal "
                "to those before the occurrence it copies) is >= min_match (null: never), per category where listed; "
                "elsewhere the model drafts")
        if self.guided:
            what = ("where prompt lookup's match length is >= min_match (null: never; per category where listed), "
                    "the model drafts guided by lookup's copies: it takes the likeliest token they propose while "
                    "that token has at least guide_min_ratio of the model's top probability, then its own; elsewhere "
                    "the model drafts")
        return {"min_match": self.min_match, "per_category": dict(sorted(self.per_category.items())),
                "guide_min_ratio": self.guide_min_ratio, "what": what}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "HybridRule":
        if not isinstance(obj, Mapping) or "min_match" not in obj:
            raise ValueError("hybrid rule: expected an object with 'min_match' (and optionally 'per_category', "
                             "'guide_min_ratio')")
        per_category = obj.get("per_category") or {}
        if not isinstance(per_category, Mapping):
            raise ValueError("hybrid rule: 'per_category' must be an object (category -> min_match)")
        return cls(obj["min_match"], {str(c): t for c, t in per_category.items()}, obj.get("guide_min_ratio"))


def candidate_key(min_match: int | None, guide_min_ratio: float | None = None) -> str:
    if min_match is None:
        return "draft_only"
    if guide_min_ratio is not None:
        return f"guided_{guide_min_ratio:g}_match_{min_match}"
    return f"lookup_match_{min_match}"


def candidate_label(min_match: int | None, guide_min_ratio: float | None = None) -> str:
    if min_match is None:
        return "the model only"
    if guide_min_ratio is not None:
        return f"the model guided by lookup (ratio {guide_min_ratio:g}) where its match >= {min_match}"
    fixed = " (the fixed rule)" if min_match == DEFAULT_HYBRID_MIN_NGRAM else ""
    return f"lookup where its match >= {min_match}{fixed}"


def candidates(guide_ratios: Sequence[float] = ()) -> list[HybridRule]:
    """The rules scored: every plain threshold, then the guided ones for ``guide_ratios`` (those the points were
    scored under; none without the model's distributions)."""
    return ([HybridRule(t) for t in CANDIDATE_MIN_MATCH]
            + [HybridRule(t, guide_min_ratio=r) for r in guide_ratios for t in GUIDED_MIN_MATCH if t is not None])


def guided_accepted(probs: Any, target: Sequence[int], guides: Sequence[Sequence[int]], min_ratio: float) -> int:
    """The accepted length of the draft guided by ``guides`` (``model.generation.GuideFollower``) against
    ``target``, from the model's distributions along it (``probs`` [len(target), V], row i after the context and
    target[:i]): up to the first miss the draft's context is the target's, so the walk needs no decoding."""
    accepted, follower = 0, GuideFollower(guides, min_ratio)
    for i, want in enumerate(target):
        if follower.pick(probs[i], int(probs[i].argmax())) != want:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True)
class RulePoint:
    """One evaluation point as the rules see it: the model's accepted length there, lookup's, and lookup's match
    length (0: lookup has no draft)."""

    id: str
    category: str
    context_tokens: int
    model: int
    lookup: int
    match: int
    # the guided draft's accepted length by guide_min_ratio, where lookup has a draft here and it was scored
    guided: Mapping[float, int] = field(default_factory=dict)

    def accepted(self, rule: HybridRule | None) -> int:
        """The accepted length under ``rule`` (None: lookup alone, nothing where it has no draft)."""
        if rule is None:
            return self.lookup
        if not (self.match and rule.uses_lookup(self.match, self.category)):
            return self.model
        return self.guided[rule.guide_min_ratio] if rule.guided else self.lookup

    @property
    def better_of_two(self) -> int:
        """What a rule that always picked the better of the two here would accept."""
        return max(self.model, self.lookup)


def rule_points(points: Sequence[ValidationPoint], model_accepted: Sequence[int], k: int,
                lookups: Sequence[tuple[list[int], int]] | None = None) -> list[RulePoint]:
    """Each point with the model's accepted length (``model_accepted``, from its own evaluation) and lookup's:
    ``lookups`` (each point's ``lookup_match``, where the caller has them), else measured here (lookup as
    ``HybridDrafter`` runs it under a rule: n = 4 down to 1)."""
    if len(points) != len(model_accepted):
        raise ValueError(f"{len(model_accepted)} accepted lengths for {len(points)} points")
    if lookups is None:
        lookups = [lookup_match(p.context_ids, k, MAX_NGRAM, 1) for p in points]
    return [RulePoint(p.id, p.category, len(p.context_ids), int(a), accepted_length(draft[:k], p.target_ids[:k]),
                      match) for p, a, (draft, match) in zip(points, model_accepted, lookups)]


def calibration_split(points: Sequence[RulePoint]) -> list[bool]:
    """True for the calibration points: those of every other prompt of each category, in order of first
    appearance (so each category with two prompts or more is on both sides, and a prompt is on one side)."""
    seen: dict[str, dict[str, int]] = {}
    for p in points:
        order = seen.setdefault(p.category, {})
        order.setdefault(p.id, len(order))
    return [seen[p.category][p.id] % 2 == 0 for p in points]


def _score(points: Sequence[RulePoint], rule: HybridRule | None) -> dict[str, Any]:
    return group_summary([p.accepted(rule) for p in points], [p.id for p in points])


def _best(points: Sequence[RulePoint], guide_min_ratio: float | None = None) -> int | None:
    """The candidate threshold with the most accepted over ``points`` (the first of a tie, in candidate order), the
    plain ones or those guided at ``guide_min_ratio``."""
    thresholds = CANDIDATE_MIN_MATCH if guide_min_ratio is None else GUIDED_MIN_MATCH
    totals = [sum(p.accepted(HybridRule(t, guide_min_ratio=guide_min_ratio)) for p in points) for t in thresholds]
    return thresholds[totals.index(max(totals))]


def scored_ratios(points: Sequence[RulePoint]) -> list[float]:
    """The guide ratios every point with a lookup draft was scored under (none where any lacks them)."""
    found = [set(p.guided) for p in points if p.match]
    return sorted(set.intersection(*found)) if found else []


def _gains_per_prompt(points: Sequence[RulePoint], rule: HybridRule, against: HybridRule) -> list[int]:
    """Per prompt of ``points``: what ``rule`` accepts over its points minus what ``against`` does."""
    gains: dict[str, int] = {}
    for p in points:
        gains[p.id] = gains.get(p.id, 0) + p.accepted(rule) - p.accepted(against)
    return list(gains.values())


def choose_rule(calibration: Sequence[RulePoint]) -> HybridRule:
    """The best threshold over the calibration points, and a category's own best where that category has
    ``MIN_CATEGORY_PROMPTS`` calibration prompts and its best beats the overall choice on more than half of them
    and loses on none: among the plain thresholds, or among the guided ones at the best ratio where those beat the
    plain choice beyond noise (``guided_against_plain``)."""
    return _chosen(*guided_against_plain(calibration))


def _chosen(plain: HybridRule, guided: HybridRule | None, gain: Mapping[str, Any]) -> HybridRule:
    return guided if guided is not None and gain["above"] else plain


def guided_against_plain(calibration: Sequence[RulePoint]) -> tuple[HybridRule, HybridRule | None, dict[str, Any]]:
    """(the best plain rule, the best guided one or None where none was scored, the guided one's gain over the plain
    one per calibration point with its 90% interval over prompts). ``choose_rule`` takes the guided rule only where
    that whole interval is above zero: it calls the model on every context lookup would have answered for free, so
    a gain within its prompts' noise does not pay for it (docs/history.md, "Lookup as the draft's guide")."""
    if not calibration:
        raise ValueError("no calibration points to choose a hybrid rule on")
    plain = _choose_for(calibration, None)
    guided, best_total = None, -1
    for ratio in scored_ratios(calibration):
        rule = _choose_for(calibration, ratio)
        total = sum(p.accepted(rule) for p in calibration)
        if total > best_total:
            guided, best_total = rule, total
    if guided is None:
        return plain, None, {"above": False}
    gain = paired_difference([p.accepted(guided) - p.accepted(plain) for p in calibration],
                             [p.id for p in calibration])
    return plain, guided, gain


def _choose_for(calibration: Sequence[RulePoint], ratio: float | None) -> HybridRule:
    """``choose_rule`` among the plain thresholds (``ratio`` None) or those guided at ``ratio``."""
    overall = _best(calibration, ratio)
    per_category: dict[str, int | None] = {}
    for category in sorted({p.category for p in calibration}):
        mine = [p for p in calibration if p.category == category]
        best = _best(mine, ratio)
        gains = _gains_per_prompt(mine, HybridRule(best, guide_min_ratio=ratio),
                                  HybridRule(overall, guide_min_ratio=ratio))
        if (len(gains) >= MIN_CATEGORY_PROMPTS and sum(g > 0 for g in gains) > len(gains) / 2
                and min(gains) >= 0):
            per_category[category] = best
    return HybridRule(overall, per_category, ratio)


def against_better(points: Sequence[RulePoint], rule: HybridRule) -> dict[str, Any]:
    """``rule`` against the better of the model alone and lookup alone over ``points`` (the one with more
    accepted; the model on a tie): the mean difference per point and its 90% interval over prompts
    (``metrics.paired_difference``), so that a group's shortfall can be told from its few prompts' noise."""
    model, lookup = sum(p.model for p in points), sum(p.lookup for p in points)
    better = "lookup_alone" if lookup > model else "draft_only"
    other = HybridRule(None) if better == "draft_only" else None
    return {"better": better, **paired_difference([p.accepted(rule) - p.accepted(other) for p in points],
                                                  [p.id for p in points])}


def against_better_groups(reported: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """A record's ``against_better`` cell for every reported category and context length, by group."""
    return {name: row[AGAINST_BETTER] for name, row in {**reported["per_category"],
                                                         **reported["per_context_length"]}.items()}


def _table(points: Sequence[RulePoint], chosen: HybridRule | None, rules: Sequence[HybridRule]) -> dict[str, Any]:
    """Every candidate of ``rules``, lookup alone and (given) the chosen rule, the ceiling and the chosen rule
    against the better of the two over ``points``: overall, per category and per context-length bucket."""
    def row(group: Sequence[RulePoint]) -> dict[str, Any]:
        out = {"lookup_alone": _score(group, None)}
        out.update({candidate_key(r.min_match, r.guide_min_ratio): _score(group, r) for r in rules})
        if chosen is not None:
            out["chosen"] = _score(group, chosen)
            out[CEILING] = group_summary([p.better_of_two for p in group], [p.id for p in group])
            out[AGAINST_BETTER] = against_better(group, chosen)
        return out
    categories = sorted({p.category for p in points})
    buckets = [label for label, _ in CONTEXT_BUCKETS if any(context_bucket(p.context_tokens) == label for p in points)]
    return {"overall": row(points),
            "per_category": {c: row([p for p in points if p.category == c]) for c in categories},
            "per_context_length": {b: row([p for p in points if context_bucket(p.context_tokens) == b])
                                   for b in buckets}}


def measure_rules(points: Sequence[RulePoint]) -> dict[str, Any]:
    """The record of a measured rule: the split, every candidate on the calibration points, the rule chosen there,
    and every candidate with the chosen rule and the ceiling on the reported points (never the ones it was chosen
    on)."""
    side = calibration_split(points)
    calibration = [p for p, c in zip(points, side) if c]
    reported = [p for p, c in zip(points, side) if not c]
    plain, guided, gain = guided_against_plain(calibration)
    chosen = _chosen(plain, guided, gain)  # choose_rule's choice, its comparison kept for the record
    rules = candidates(scored_ratios(points))
    return {
        "candidates": {candidate_key(r.min_match, r.guide_min_ratio): {
            "min_match": r.min_match, "guide_min_ratio": r.guide_min_ratio,
            "label": candidate_label(r.min_match, r.guide_min_ratio)} for r in rules},
        "fixed": candidate_key(DEFAULT_HYBRID_MIN_NGRAM),
        "ceiling": {"key": CEILING, "label": "the better of the two at each point (the most any rule choosing "
                                             "between them per context could accept)"},
        "min_category_prompts": MIN_CATEGORY_PROMPTS,
        "split": {"how": SPLIT_NOTE,
                  "calibration": {"points": len(calibration), "prompts": len({p.id for p in calibration})},
                  "reported": {"points": len(reported), "prompts": len({p.id for p in reported})}},
        "chosen": chosen.to_json(),
        "chosen_words": chosen.describe(),
        "guided_against_plain": None if guided is None else {
            "plain": plain.describe(), "guided": guided.describe(), **gain,
            "what": "on the calibration points: the best guided rule minus the best plain one, per point, with its "
                    "90% interval over prompts; the guided rule is chosen only where the interval is above zero"},
        "calibration": _table(calibration, None, rules),
        "reported": _table(reported, chosen, rules) if reported else None,
    }
