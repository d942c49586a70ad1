"""``guide_ids`` on ``POST /draft`` over a real socket: a greedy draft that follows the client's proposed continuation
while the draft gives each of its tokens ``guide_min_ratio`` of its top probability -- the reference decoder's draft,
in the short lane and in the long one (chunked prefill), on a prefix-cache hit as on a miss, batched as alone;
without the field the answer is today's; a bad guide is a 422 naming its field."""

import random

import httpx
import pytest

from servers import lanes_server, post_together
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.hybrid_rule import HybridRule
from specdraft.drafting.lookup import lookup_match
from specdraft.drafting.remote import HTTPDrafter
from specdraft.model.generation import DraftSampling
from specdraft.model.simple_decode import naive_draft
from specdraft.server.engine import load_engine

BLOCK = 8
LONG_CONTEXT = 24  # beyond it the long lane, prefilled in pieces
NUM_DRAFT = 16


@pytest.fixture(scope="module")
def engine(packed_dir):
    return load_engine(packed_dir, None, "float32")


@pytest.fixture(scope="module")
def url(engine, packed_dir):
    with lanes_server(engine, packed_dir, BLOCK, LONG_CONTEXT) as srv:
        yield srv.url


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/draft", json=body, timeout=60)


def test_a_guided_draft_is_the_reference_decoders(url, engine):
    rng = random.Random(3)
    vocab = engine.vocab_size
    followed = 0
    bodies = []
    for length in (2, 7, 19, 40, 70):  # 40 and 70: past LONG_CONTEXT
        context = [rng.randrange(vocab) for _ in range(length)]
        plain = post(url, {"token_ids": context}).json()
        assert set(plain) == {"draft_ids", "model"}  # without the field: today's answer
        for guide, ratio in ((plain["draft_ids"][:5] + [rng.randrange(vocab) for _ in range(11)], 0.3),
                             ([rng.randrange(vocab) for _ in range(NUM_DRAFT)], 0.01),
                             (plain["draft_ids"], 1.0)):
            body = {"token_ids": context, "guide_ids": guide, "guide_min_ratio": ratio}
            got = post(url, body).json()
            ref = naive_draft(engine.model, context, NUM_DRAFT,
                              DraftSampling(guide=tuple(guide), guide_min_ratio=ratio))
            assert got["draft_ids"] == ref.tokens and set(got) == {"draft_ids", "model"}
            followed += sum(a == b for a, b in zip(got["draft_ids"], guide))
            bodies.append(body)
        again = post(url, bodies[-2]).json()  # a prefix-cache hit now
        assert again["draft_ids"] == post(url, bodies[-2]).json()["draft_ids"]
    assert followed >= 5 * 16  # the plain draft as its guide is followed to the end, and more: not vacuous
    bodies.append({"token_ids": bodies[0]["token_ids"]})  # a plain row beside them; 16: two releases of 8 clients
    assert post_together(url, bodies) == [post(url, b).json() for b in bodies]


@pytest.mark.parametrize("extra,field", [
    ({"guide_ids": [1], "sampling": {"temperature": 0.7, "seed": 1}}, "guide_ids"),
    ({"guide_ids": [1], "return_probs": True, "top_alternatives": 2}, "guide_ids"),
    ({"guide_min_ratio": 0.5}, "guide_min_ratio"),
    ({"guide_ids": [1], "guide_min_ratio": 1.5}, "guide_min_ratio"),
    ({"guide_ids": []}, "guide_ids"),
    ({"guide_ids": list(range(NUM_DRAFT + 1))}, "guide_ids"),
    ({"guide_ids": [1, 10**9]}, "guide_ids[1]"),
])
def test_a_bad_guide_is_a_422_naming_its_field(url, extra, field):
    r = post(url, {"token_ids": [1, 2, 3], **extra})
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["details"]], r.json()


def test_the_hybrids_guided_rule_over_http_sends_lookups_draft_where_the_rule_uses_it(url, engine):
    """HybridDrafter with a guided rule: every context drafted by the server, with lookup's draft as the guide where
    its match reaches the threshold -- the answer the request with that guide gets."""
    rng = random.Random(8)
    vocab = engine.vocab_size
    phrase = [rng.randrange(vocab) for _ in range(12)]
    contexts = [phrase + [rng.randrange(vocab)] + phrase[:6], [rng.randrange(vocab) for _ in range(9)]]
    rule = HybridRule(3, guide_min_ratio=0.05)
    with HTTPDrafter(url, concurrency=2) as http:
        hybrid = HybridDrafter(http, rule=rule)
        drafts = hybrid.draft(contexts, NUM_DRAFT)
        assert hybrid.lookup_used == 1 and hybrid.model_used == 1
        guide, match = lookup_match(contexts[0], NUM_DRAFT)
        assert match >= 3
        assert drafts[0] == post(url, {"token_ids": contexts[0], "guide_ids": guide, "guide_min_ratio": 0.05}) \
            .json()["draft_ids"]
        assert drafts[1] == post(url, {"token_ids": contexts[1]}).json()["draft_ids"]
