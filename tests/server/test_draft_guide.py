"""``guide_ids`` and ``guide_alternatives`` on ``POST /draft`` over a real socket: a greedy draft that follows the
client's proposed continuations while the draft gives the token it takes ``guide_min_ratio`` of its top probability
-- the reference decoder's draft,
in the short lane and in the long one (chunked prefill), on a prefix-cache hit as on a miss, batched as alone;
without the field the answer is today's; a bad guide is a 422 naming its field."""

import random

import httpx
import pytest

from servers import lanes_server, post_together
from specdraft.drafting.hybrid import HybridDrafter
from specdraft.drafting.hybrid_rule import HybridRule
from specdraft.drafting.lookup import lookup_continuations
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
        noise = [rng.randrange(vocab) for _ in range(NUM_DRAFT)]
        for guides, ratio in (([plain["draft_ids"][:5] + noise[:11]], 0.3), ([noise], 0.01),
                              ([plain["draft_ids"]], 1.0), ([noise[:7], plain["draft_ids"][:9], noise[3:]], 0.01)):
            body = {"token_ids": context, "guide_ids": guides[0], "guide_min_ratio": ratio}
            if guides[1:]:
                body["guide_alternatives"] = guides[1:]
            got = post(url, body).json()
            ref = naive_draft(engine.model, context, NUM_DRAFT,
                              DraftSampling(guides=tuple(map(tuple, guides)), guide_min_ratio=ratio))
            assert got["draft_ids"] == ref.tokens and set(got) == {"draft_ids", "model"}
            followed += sum(a == b for a, b in zip(got["draft_ids"], guides[0] if len(guides) == 1 else guides[1]))
            bodies.append(body)
        again = post(url, bodies[-2]).json()  # a prefix-cache hit now
        assert again["draft_ids"] == post(url, bodies[-2]).json()["draft_ids"]
    # the plain draft as its guide is followed to the end, behind another guide through its 9 tokens: not vacuous
    assert followed >= 5 * (16 + 9)
    # guide_alternatives alone: guides as well
    last = bodies[-1]
    alone = {"token_ids": last["token_ids"], "guide_alternatives": [last["guide_ids"], *last["guide_alternatives"]],
             "guide_min_ratio": last["guide_min_ratio"]}
    assert post(url, alone).json() == post(url, last).json()
    bodies += [{"token_ids": bodies[i]["token_ids"]} for i in (0, 4, 8, 12)]  # plain rows beside them; 24: three
    # releases of 8 clients
    assert post_together(url, bodies) == [post(url, b).json() for b in bodies]


@pytest.mark.parametrize("extra,field", [
    ({"guide_ids": [1], "sampling": {"temperature": 0.7, "seed": 1}}, "guide_ids"),
    ({"guide_ids": [1], "return_probs": True, "top_alternatives": 2}, "guide_ids"),
    ({"guide_min_ratio": 0.5}, "guide_min_ratio"),
    ({"guide_ids": [1], "guide_min_ratio": 1.5}, "guide_min_ratio"),
    ({"guide_ids": []}, "guide_ids"),
    ({"guide_ids": list(range(NUM_DRAFT + 1))}, "guide_ids"),
    ({"guide_ids": [1, 10**9]}, "guide_ids[1]"),
    ({"guide_alternatives": [[1]], "sampling": {"temperature": 0.7, "seed": 1}}, "guide_alternatives"),
    ({"guide_ids": [1], "guide_alternatives": [[2]] * 8}, "guide_alternatives"),
    ({"guide_ids": [1], "guide_alternatives": [[2], []]}, "guide_alternatives[1]"),
    ({"guide_ids": [1], "guide_alternatives": [[2, -1]]}, "guide_alternatives[0][1]"),
    ({"guide_ids": [1], "guide_alternatives": [[2] * (NUM_DRAFT + 1)]}, "guide_alternatives[0]"),
])
def test_a_bad_guide_is_a_422_naming_its_field(url, extra, field):
    r = post(url, {"token_ids": [1, 2, 3], **extra})
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["details"]], r.json()


def test_the_hybrids_guided_rule_over_http_sends_lookups_copies_where_the_rule_uses_it(url, engine):
    """HybridDrafter with a guided rule: every context drafted by the server, with lookup's copies as the guides
    where its match reaches the threshold -- the answer the request with those guides gets."""
    rng = random.Random(8)
    vocab = engine.vocab_size
    phrase = [rng.randrange(vocab) for _ in range(12)]
    contexts = [phrase + [rng.randrange(vocab)] + phrase[:6] + [rng.randrange(vocab)] + phrase[:6],
                [rng.randrange(vocab) for _ in range(9)]]
    rule = HybridRule(3, guide_min_ratio=0.05)
    with HTTPDrafter(url, concurrency=2) as http:
        hybrid = HybridDrafter(http, rule=rule)
        drafts = hybrid.draft(contexts, NUM_DRAFT)
        assert hybrid.lookup_used == 1 and hybrid.model_used == 1
        guides, match = lookup_continuations(contexts[0], NUM_DRAFT)
        assert match >= 3 and len(guides) == 2
        assert drafts[0] == post(url, {"token_ids": contexts[0], "guide_ids": guides[0],
                                       "guide_alternatives": guides[1:], "guide_min_ratio": 0.05}).json()["draft_ids"]
        assert drafts[1] == post(url, {"token_ids": contexts[1]}).json()["draft_ids"]
