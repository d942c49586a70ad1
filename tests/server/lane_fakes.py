"""``fakes.FakeLane`` and ``fakes.FakeEngine`` on the lane protocol that carries sampling settings and returns
``scheduler.Draft``s: the fake's tokens are greedy-like (a function of the context), so it records the settings
each row was admitted with and answers with plain drafts."""

import fakes
from fakes import expected  # noqa: F401  (the tests take it from here with the lanes)
from specdraft.server.scheduler import Draft


def _drafts(tokens: dict) -> dict:
    return {key: Draft(list(toks)) for key, toks in tokens.items()}


class FakeLane(fakes.FakeLane):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sampling: dict = {}  # key -> the DraftSampling its row was admitted with

    def admit(self, keys, contexts, sampling):
        assert len(sampling) == len(keys)
        self.sampling.update(zip(keys, sampling))
        return _drafts(super().admit(keys, contexts))

    def prefill_chunk(self, key, context, start, size, sampling):
        self.sampling[key] = sampling
        return _drafts(super().prefill_chunk(key, context, start, size))

    def step(self):
        return _drafts(super().step())


class FakeEngine(fakes.FakeEngine):
    def lane(self, slots, capacity, num_draft):
        lane = FakeLane(slots, capacity, num_draft, self.vocab_size, self.delay, self.gate, self.fail_when)
        self.lanes.append(lane)
        return lane
