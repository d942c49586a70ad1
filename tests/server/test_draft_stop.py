"""Drafts that stop paying stop: ``stop_confidence`` on ``POST /draft`` ends a draft after its first token whose
confidence is below the threshold (that token included; the last asked-for token is never judged), over a real
socket: the stopped draft is the full draft's prefix bit for bit (the full one computed on a prefix-cache miss, the
stopped one on a hit), in the short lane and in the long one (chunked prefill), batched as alone, greedy or sampled;
without the field the answer is today's; a stopped row leaves its slot at once; /metrics counts what was saved."""

import random

import httpx
import pytest
import torch

from servers import lanes_server, metric_samples, post_together
from specdraft.model.generation import DraftSampling
from specdraft.server.engine import load_engine, torch_lane
from specdraft.server.scheduler import Draft

BLOCK = 8
LONG_CONTEXT = 24  # beyond it the long lane, prefilled in pieces
NUM_DRAFT = 16
# A threshold this close to a token's confidence could fall on either side of it between the server's decode step and
# the test's own forward (different kernels round differently): such thresholds are not used.
MARGIN = 0.005


@pytest.fixture(scope="module")
def engine(packed_dir):
    return load_engine(packed_dir, None, "int4")


@pytest.fixture(scope="module")
def url(engine, packed_dir):
    with lanes_server(engine, packed_dir, BLOCK, LONG_CONTEXT) as srv:
        yield srv.url


def post(url: str, body: dict) -> dict:
    r = httpx.post(url + "/draft", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@torch.inference_mode()
def confidences(model, context: list[int], draft: list[int]) -> list[float]:
    """The draft's top probability before each drafted token, from one teacher-forced forward of its own (not the
    server's decode steps)."""
    logits = model(input_ids=torch.tensor([context + draft[:-1]])).logits[0, len(context) - 1:]
    return torch.softmax(logits.float(), -1).max(-1).values.tolist()


def expected_length(conf: list[float], num_tokens: int, threshold: float) -> int:
    """The in-process rule (``CachedDraftModel``, "probability"): stop after the first of the first num_tokens - 1
    tokens whose confidence is below the threshold."""
    return next((i + 1 for i, c in enumerate(conf[:num_tokens - 1]) if c < threshold), num_tokens)


def clear_thresholds(conf: list[float]) -> list[float]:
    """Thresholds at least MARGIN away from every confidence: midpoints of the gaps between them, and one below all."""
    values = sorted(conf)
    mids = [(a + b) / 2 for a, b in zip(values, values[1:]) if b - a > 2 * MARGIN]
    low = [values[0] - MARGIN] if values[0] > 2 * MARGIN else []
    return low + mids


def test_a_stopped_draft_is_the_full_drafts_prefix_to_its_first_unconfident_token(url, engine):
    rng = random.Random(52)
    vocab = engine.vocab_size
    cases = 0
    reasons = set()
    for length in (1, 5, 17, 40, 70):  # 40 and 70: the long lane, prefilled in chunks
        context = [rng.randrange(vocab) for _ in range(length)]
        full = post(url, {"token_ids": context, "num_tokens": NUM_DRAFT})
        assert set(full) == {"draft_ids", "model"} and len(full["draft_ids"]) == NUM_DRAFT  # absent: today's answer
        conf = confidences(engine.model, context, full["draft_ids"])
        thresholds = clear_thresholds(conf)
        assert thresholds, conf
        for threshold in rng.sample(thresholds, min(4, len(thresholds))):
            first_below = next((i for i, c in enumerate(conf) if c < threshold), None)
            # num_tokens ending at the first unconfident token: the last token is never judged, a full answer
            for num_tokens in {NUM_DRAFT, rng.randint(1, NUM_DRAFT), min(NUM_DRAFT, (first_below or 0) + 1)}:
                got = post(url, {"token_ids": context, "num_tokens": num_tokens, "stop_confidence": threshold})
                n = expected_length(conf, num_tokens, threshold)
                reason = "confidence" if n < num_tokens else "length"
                assert got == {"draft_ids": full["draft_ids"][:n], "model": full["model"], "stop_reason": reason}, (
                    length, threshold, num_tokens, conf)
                reasons.add(reason)
                cases += 1
    assert reasons == {"confidence", "length"} and cases >= 20


def test_batched_with_and_without_the_field_equals_alone_greedy_and_sampled(url, engine):
    """Requests with and without stop_confidence, greedy and seeded sampled, short and long contexts: concurrently
    the same answers as alone; a sampled draft stops at its first token whose q (its draft_probs) is below the
    threshold, and is the same request's unstopped draft's prefix."""
    rng = random.Random(7)
    vocab = engine.vocab_size
    requests = []
    for i in range(16):
        r = {"token_ids": [rng.randrange(vocab) for _ in range(rng.choice([2, 9, 30, 33]))],
             "num_tokens": rng.choice([NUM_DRAFT, rng.randint(2, NUM_DRAFT)])}
        if i % 4 in (1, 2):
            r["sampling"] = {"temperature": rng.choice([0.7, 1.0]), "top_k": rng.choice([0, 40]), "seed": 500 + i}
            r["return_probs"] = True
        if i % 2:
            r["stop_confidence"] = rng.choice([0.15, 0.2, 0.3])
        requests.append(r)
    with httpx.Client(base_url=url, timeout=60) as client:
        single = [client.post("/draft", json=r).json() for r in requests]
        unstopped = [client.post("/draft", json={k: v for k, v in r.items() if k != "stop_confidence"}).json()
                     for r in requests]
    assert post_together(url, requests) == single
    stopped = 0
    for r, s, full in zip(requests, single, unstopped):
        if "stop_confidence" not in r:
            assert s == full and "stop_reason" not in s
            continue
        n = len(s["draft_ids"])
        assert s["draft_ids"] == full["draft_ids"][:n] and s["stop_reason"] == ("confidence" if n < r["num_tokens"]
                                                                               else "length")
        if "sampling" in r:
            assert s["draft_probs"] == full["draft_probs"][:n]
            assert n == expected_length(full["draft_probs"], r["num_tokens"], r["stop_confidence"])
        stopped += n < r["num_tokens"]
    assert stopped >= 2  # the thresholds stop some drafts: the comparison above is not vacuous


def test_metrics_count_the_stopped_drafts_and_the_tokens_they_did_not_draft(url, engine):
    rng = random.Random(11)
    bodies = [{"token_ids": [rng.randrange(engine.vocab_size) for _ in range(6)], "num_tokens": n,
               "stop_confidence": 0.3} for n in (16, 16, 9, 4)]
    before = metric_samples(url)
    answers = [post(url, b) for b in bodies]
    after = metric_samples(url)

    def grew(name):
        return after[(name, ())] - before[(name, ())]

    stopped = [(b["num_tokens"], len(a["draft_ids"])) for b, a in zip(bodies, answers)
               if a["stop_reason"] == "confidence"]
    assert stopped and all(n < asked for asked, n in stopped)
    assert grew("specdraft_drafts_stopped_total") == len(stopped)
    assert grew("specdraft_draft_tokens_not_drafted_total") == sum(asked - n for asked, n in stopped)
    assert grew("specdraft_draft_tokens_total") == sum(len(a["draft_ids"]) for a in answers)


def test_a_stopped_row_leaves_its_slot_at_once(engine):
    """A row whose first token already stops it (every confidence is below 1) is answered at its admission and frees
    its slot; the row beside it decodes on alone."""
    lane = torch_lane(engine.model, 2, 64, NUM_DRAFT)
    drafts = lane.admit([0, 1], [[3, 4, 5], [6, 7, 8]], [DraftSampling(stop_confidence=1.0), DraftSampling()])
    assert drafts[0].stopped and len(drafts[0].tokens) == 1 and not drafts[1].stopped
    assert lane.free == 1 and lane.decoder.index == [1]
    assert list(lane.step()) == [1]  # only the unstopped row is computed


def test_a_stop_at_the_last_asked_token_is_a_full_answer():
    draft = Draft([1, 2, 3], stopped=True)
    assert draft.head(3).stopped is False and draft.head(2).stopped is False
    assert draft.head(4).stopped is True and draft.head(16).tokens == [1, 2, 3]
