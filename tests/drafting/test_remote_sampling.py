"""HTTPDrafter's sampled drafts: the request it builds and the answer it parses, against a fake server
(httpx.MockTransport) that speaks the wire contract of POST /draft."""

import json

import httpx
import pytest
import torch

from specdraft.drafting.base import DrafterError
from specdraft.drafting.remote import MAX_TOP_ALTERNATIVES, HTTPDrafter, parse_sampled
from specdraft.model.sampling import SamplingParams


def fake(answer_for):
    """A transport answering each POST /draft with ``answer_for(body)``; the bodies it saw in ``.bodies``."""
    bodies = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        return httpx.Response(200, json=answer_for(body))

    transport = httpx.MockTransport(handle)
    transport.bodies = bodies
    return transport


def sampled_answer(body):
    n = body["num_tokens"]
    k = body.get("top_alternatives", 0)
    answer = {"draft_ids": [10 + i for i in range(n)], "draft_probs": [0.5] * n, "model": "fake"}
    if k:
        answer["top_ids"] = [[10 + i] + [20 + j for j in range(k - 1)] for i in range(n)]
        answer["top_probs"] = [[0.5] + [0.5 / (k - 1)] * (k - 1) for _ in range(n)]
    return answer


def test_sampled_request_carries_the_settings_a_seed_and_asks_for_probabilities():
    transport = fake(sampled_answer)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=4)
    with HTTPDrafter("http://draft", concurrency=2, transport=transport) as drafter:
        got = drafter.draft_with_probs([[1, 2, 3], [4, 5]], 3, params, torch.Generator().manual_seed(0))
        again = drafter.draft_with_probs([[1, 2, 3], [4, 5]], 3, params, torch.Generator().manual_seed(0))
    first, second = transport.bodies[:2]
    assert first["token_ids"] == [1, 2, 3] and first["num_tokens"] == 3
    assert first["sampling"]["temperature"] == 0.7 and first["sampling"]["top_p"] == 0.9
    assert first["sampling"]["top_k"] == 4 and first["return_probs"] is True
    assert first["top_alternatives"] == 4  # top_k of them cover the draft's whole support
    assert first["sampling"]["seed"] != second["sampling"]["seed"]  # one seed per context
    seeds = [b["sampling"]["seed"] for b in transport.bodies]
    assert seeds[:2] == seeds[2:]  # the same generator state, the same seeds
    assert got[0].ids == [10, 11, 12] and [d.ids for d in got] == [d.ids for d in again]
    q = got[0].dense(32)
    assert torch.allclose(q.sum(-1), torch.ones(3))
    assert q[0, 10] == 0.5 and q[0, 20] == pytest.approx(0.5 / 3)


def test_without_top_k_it_asks_for_the_most_alternatives():
    transport = fake(sampled_answer)
    with HTTPDrafter("http://draft", transport=transport) as drafter:
        drafter.draft_with_probs([[1]], 2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert transport.bodies[0]["top_alternatives"] == MAX_TOP_ALTERNATIVES


def test_greedy_stays_todays_request():
    transport = fake(lambda body: {"draft_ids": [7] * body["num_tokens"]})
    with HTTPDrafter("http://draft", transport=transport) as drafter:
        got = drafter.draft_with_probs([[1, 2]], 2, SamplingParams(), None)[0]
    assert transport.bodies == [{"token_ids": [1, 2], "num_tokens": 2}]
    assert got.ids == [7, 7] and torch.equal(got.dense(8)[:, 7], torch.ones(2))


def test_a_drafted_token_outside_its_alternatives_keeps_its_own_probability():
    got = parse_sampled({"draft_ids": [3, 9], "draft_probs": [0.25, 0.1],
                         "top_ids": [[3, 4], [4, 5]], "top_probs": [[0.25, 0.2], [0.6, 0.3]]}, "x")
    q = got.dense(10)
    assert q[0].tolist()[3:5] == [0.25, pytest.approx(0.2)]
    assert q[1, 9] == pytest.approx(0.1) and q[1, 4] == pytest.approx(0.6)


@pytest.mark.parametrize("answer, what", [
    ({"draft_ids": [1, 2]}, "draft_probs"),
    ({"draft_ids": [1, 2], "draft_probs": [0.5]}, "draft_probs"),
    ({"draft_ids": [1], "draft_probs": [1.5]}, "draft_probs"),
    ({"draft_ids": [1], "draft_probs": [0.5], "top_ids": [[1, 2]], "top_probs": [[0.5]]}, "top_ids"),
    ({"draft_ids": [1], "draft_probs": [0.5], "top_ids": [[1]]}, "top_ids"),
    ({"draft_ids": ["a"], "draft_probs": [0.5]}, "draft_ids"),
])
def test_malformed_answers_are_drafter_errors(answer, what):
    transport = fake(lambda body: answer)
    with HTTPDrafter("http://draft", transport=transport) as drafter:
        with pytest.raises(DrafterError, match=what):
            drafter.draft_with_probs([[1]], 1, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))


def test_path_probs_at_temperature_is_refused_with_what_to_do():
    with HTTPDrafter("http://draft", transport=fake(sampled_answer)) as drafter:
        with pytest.raises(DrafterError, match="load the pack it serves in process"):
            drafter.path_probs([1, 2], [3, 4], [SamplingParams(temperature=0.7)])
