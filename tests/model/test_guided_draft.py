"""A guided greedy draft (``DraftSampling.guides``): the row takes, of the tokens its guides still in play propose, the
one the draft finds most likely while it has at least ``guide_min_ratio`` of its top probability, then its own argmax.
The slot engine's rows equal the no-cache reference
(``naive_draft``), batched as alone; the in-process drafters (stateless, kept cache) give the same drafts; the
teacher-forced prediction (``guided_acceptance``) equals what decoding accepts."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.core.records import ValidationPoint
from specdraft.drafting.acceptance import guided_acceptance
from specdraft.drafting.batched import ModelDrafter
from specdraft.drafting.cached import CachedDraftModel
from specdraft.drafting.metrics import accepted_length
from specdraft.model.decode import draft_batch, draft_rows
from specdraft.model.generation import DraftSampling, GuideFollower
from specdraft.model.sampling import SamplingParams
from specdraft.model.simple_decode import naive_draft

N = 8


@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def probs_along(model, context, tokens):
    """The draft's plain softmax before each of ``tokens`` after ``context`` (one forward)."""
    logits = model(input_ids=torch.tensor([context + tokens[:-1]])).logits[0, len(context) - 1:]
    return torch.softmax(logits.float(), -1)


def guides_for(model, contexts, rng):
    """Per context its guides, of a kind each: the plain draft itself; its first tokens then the least likely token;
    the second most likely first token, then random tokens; random tokens; and several at once: random tokens
    before the plain draft, the plain draft with a wrong token before it and random tokens, the second most likely
    first token's guide before the one with a wrong token."""
    plain = draft_batch(model, contexts, N)
    vocab = model.config.vocab_size
    out = []
    for i, (c, p) in enumerate(zip(contexts, plain)):
        probs = probs_along(model, c, p)
        j = rng.randrange(N)
        wrong = p[:j] + [int(probs[j].argmin())] + p[j + 1:]
        second = [int(probs[0].topk(2).indices[1])] + [rng.randrange(vocab) for _ in range(N - 1)]
        noise = [rng.randrange(vocab) for _ in range(N)]
        kinds = [[p], [wrong], [second], [noise], [noise, p], [wrong, p, noise], [second, wrong]]
        out.append(kinds[i % len(kinds)])
    return plain, out


def test_guided_rows_equal_the_reference_batched_as_alone(model):
    rng = random.Random(5)
    vocab = model.config.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 9, 9, 20, 1, 6, 12, 4)]
    plain, guides = guides_for(model, contexts, rng)
    for ratio in (0.05, 0.5, 1.0):
        sampling = [DraftSampling(guides=as_tuples(g), guide_min_ratio=ratio) for g in guides]
        rows = draft_rows(model, contexts, N, sampling)
        alone = [draft_rows(model, [c], N, [s])[0] for c, s in zip(contexts, sampling)]
        for c, s, row, single, p in zip(contexts, sampling, rows, alone, plain):
            ref = naive_draft(model, c, N, s)
            assert row.tokens == ref.tokens == single.tokens
            if ratio == 1.0:  # only the model's own argmax is ever taken: the plain draft
                assert row.tokens == p
    # the plain draft as its own guide is followed to the end; a zero-weight token is refused
    assert draft_rows(model, contexts[:1], N, [DraftSampling(guides=(tuple(plain[0]),), guide_min_ratio=0.9)])[0] \
        .tokens == plain[0]
    assert draft_rows(model, contexts[1:2], N, [DraftSampling(guides=as_tuples(guides[1]), guide_min_ratio=0.01)])[0] \
        .tokens == plain[1]
    # the plain draft behind a wrong guide: the draft takes, where they part, the token it finds likelier
    assert draft_rows(model, contexts[5:6], N, [DraftSampling(guides=as_tuples(guides[5]), guide_min_ratio=0.01)])[0] \
        .tokens == plain[5]


def as_tuples(guides):
    return tuple(tuple(g) for g in guides)


def test_a_guide_is_taken_exactly_where_its_token_has_the_ratio(model):
    """The second most likely first token is taken below its ratio to the top and refused above it; after it the
    draft continues as the model's plain draft of the context extended by it."""
    context = [5, 9, 11, 30, 2]
    probs = probs_along(model, context, [0])[0]
    top, second = probs.topk(2).values.tolist()
    token = int(probs.topk(2).indices[1])
    after = draft_batch(model, [context + [token]], N - 1)[0]
    taken = draft_rows(model, [context], N, [DraftSampling(guides=((token,),), guide_min_ratio=second / top / 2)])[0]
    assert taken.tokens == [token] + after
    refused = draft_rows(model, [context], N, [DraftSampling(guides=((token,),),
                                                             guide_min_ratio=min(1.0, 2 * second / top))])[0]
    assert refused.tokens == draft_batch(model, [context], N)[0]
    best = int(probs.argmax())
    assert GuideFollower([[token]], second / top / 2).pick(probs, best) == token
    refusing = GuideFollower([[token, token]], min(1.0, 2 * second / top))
    assert refusing.pick(probs, best) == best and not refusing.on
    assert refusing.pick(probs, best) == best  # off the guide for good, though its token is proposed again
    assert GuideFollower([[model.config.vocab_size + 3]], 0.01).pick(probs, best) == best  # outside the vocabulary


def test_of_several_guides_the_draft_takes_the_likeliest_and_keeps_those_that_proposed_it():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    follower = GuideFollower([[2, 0], [1, 3], [1, 2], [3, 3]], 0.2)
    assert follower.pick(probs, 0) == 1  # 0.3 of 0.5: the likeliest proposal, above the ratio
    assert follower.guides == [(1, 3), (1, 2)]
    assert follower.pick(probs, 0) == 2 and follower.guides == [(1, 2)]  # 0.15 >= 0.2 * 0.5; token 3 is not
    assert follower.pick(probs, 0) == 0 and not follower.on  # past every guide's end: the argmax
    assert GuideFollower([[1], [0]], 0.2).pick(probs, 0) == 0  # the argmax proposed: taken before a first guide's
    assert GuideFollower([[3], [2]], 0.2).pick(probs, 0) == 2  # the likelier proposal, wherever it comes
    tie = torch.tensor([0.4, 0.3, 0.3])
    assert GuideFollower([[2], [1]], 0.5).pick(tie, 0) == 2  # equal weight: the earlier guide's
    ended = GuideFollower([[1], [1, 2]], 0.2)
    assert [ended.pick(probs, 0), ended.pick(probs, 0)] == [1, 2]  # a longer guide carries on past a shorter one
    refused = GuideFollower([[3], [3, 1]], 0.2)
    assert refused.pick(probs, 0) == 0 and not refused.on and refused.pick(probs, 0) == 0


def test_in_process_drafters_and_the_prediction_agree_with_the_rows(model):
    rng = random.Random(9)
    vocab = model.config.vocab_size
    contexts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (4, 11, 7, 16, 5, 9, 3)]
    plain, guides = guides_for(model, contexts, rng)
    ratio = 0.2
    rows = [r.tokens for r in draft_rows(model, contexts, N, [DraftSampling(guides=as_tuples(g), guide_min_ratio=ratio)
                                                             for g in guides])]
    ratios = [ratio] * len(contexts)
    assert ModelDrafter(model, max_batch_size=3).draft_guided(contexts, N, guides, ratios) == rows
    cached = CachedDraftModel(model, lean=False)
    assert cached.draft_guided(contexts, N, guides, ratios) == rows
    assert cached.draft_guided(contexts[:1], N, [[]], [ratio]) == [plain[0]]  # no guide: the plain draft
    with pytest.raises(ValueError, match="ratios"):
        cached.draft_guided(contexts, N, guides, [ratio])
    # the prediction from the distributions along a reference: what the drafted rows accept of it
    references = [[row[0]] + [rng.randrange(vocab) for _ in range(N - 1)] if i % 2 else row
                  for i, row in enumerate(rows)]
    points = [ValidationPoint(f"p{i}", "all", 0, c, r) for i, (c, r) in enumerate(zip(contexts, references))]
    predicted = guided_acceptance(ModelDrafter(model), points, guides, [ratio], N)
    assert [p[ratio] for p in predicted] == [accepted_length(row, ref) for row, ref in zip(rows, references)]
    assert guided_acceptance(ModelDrafter(model), points, [[]] * len(points), [ratio], N) == [{}] * len(points)


def test_a_guide_only_for_greedy_rows():
    with pytest.raises(ValueError, match="greedy"):
        DraftSampling(SamplingParams(temperature=0.7), guides=((1, 2),))
    with pytest.raises(ValueError, match="guide_min_ratio"):
        DraftSampling(guides=((1,),), guide_min_ratio=0.0)
    assert not DraftSampling(guides=((1,),)).plain and DraftSampling().plain
