"""Where a kept-cache draft stops a step's draft short of k: a threshold on the draft's own probability, or on
the estimated probability that the whole draft so far is accepted, learnt during the run."""

from __future__ import annotations

from typing import Sequence

# Where an in-process draft stops a step's draft, per rule (``SpeculateConfig.draft_stop``). "probability": the
# token's own top probability, the rule and threshold of transformers' assisted generation; "calibrated": the
# estimated probability that the whole draft so far is accepted (``AcceptanceCalibration``), a threshold chosen
# by replaying both rules on real drafts (bench/bench_draft_stop.py; docs/history.md, "8. Speculate").
DEFAULT_DRAFT_CONFIDENCE = {"probability": 0.4, "calibrated": 0.6}


class AcceptanceCalibration:
    """How often the target keeps a drafted token, by the draft's own probability for it: per bin of that
    probability, P(kept | every earlier token of its draft kept), counted over the run.

    A draft's probability alone says little about acceptance: a draft close to the target has most of its
    low-probability tokens accepted, a weak one few (docs/history.md). Each bin starts from its own probability,
    as if the draft were calibrated, worth ``prior_weight`` tokens.
    """

    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.kept = [(b + 0.5) / bins * prior_weight for b in range(bins)]
        self.seen = [prior_weight] * bins

    def _bin(self, probability: float) -> int:
        return min(int(probability * len(self.seen)), len(self.seen) - 1)

    def estimate(self, probability: float) -> float:
        b = self._bin(probability)
        return self.kept[b] / self.seen[b]

    def observe(self, probabilities: Sequence[float], kept: int, refused: bool) -> None:
        """One draft's outcome: its first ``kept`` tokens accepted, and the next one refused when ``refused``.
        Tokens after a refused one tell nothing: the target never saw their context."""
        for i, p in enumerate(probabilities[: kept + int(refused)]):
            b = self._bin(p)
            self.seen[b] += 1
            self.kept[b] += i < kept
