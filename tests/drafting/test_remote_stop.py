"""HTTPDrafter's stop_confidence: sent with every request when set and never otherwise; `specdraft speculate --draft
http://...` passes the probability rule's threshold and nothing for the calibrated rule; against the real server
(in process, the tiny model as its own draft) speculative decoding stays lossless and drafts fewer tokens."""

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from servers import ThreadServer, metric_samples
from specdraft.drafting.base import DrafterError
from specdraft.drafting.remote import HTTPDrafter
from specdraft.drafting.speculative import speculative_generate
from specdraft.model.sampling import SamplingParams
from specdraft.model.simple_decode import naive_greedy
from specdraft.server.app import create_app
from specdraft.server.config import ServeConfig
from specdraft.server.engine import load_engine
from specdraft.stages.speculate import SpeculateConfig, build_drafters, server_stop_confidence


def recording_transport(bodies: list[dict], draft_ids=(1, 2)) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        n = len(draft_ids)
        return httpx.Response(200, json={"draft_ids": list(draft_ids), "model": "m", "draft_probs": [0.5] * n,
                                         "top_ids": [[t] for t in draft_ids], "top_probs": [[0.5]] * n})
    return httpx.MockTransport(handle)


def test_the_field_goes_with_every_request_when_set_and_never_otherwise():
    bodies: list[dict] = []
    with HTTPDrafter("http://server", concurrency=2, transport=recording_transport(bodies)) as plain:
        plain.draft([[5, 6], [7]], 4)
    assert bodies and all(set(b) == {"token_ids", "num_tokens"} for b in bodies)  # today's request
    bodies.clear()
    with HTTPDrafter("http://server", concurrency=2, transport=recording_transport(bodies),
                     stop_confidence=0.4) as stopping:
        assert stopping.draft([[5, 6], [7]], 4) == [[1, 2], [1, 2]]
        stopping.draft_with_probs([[5, 6]], 4, SamplingParams(temperature=0.8, top_k=4), torch.Generator())
    assert len(bodies) == 3 and all(b["stop_confidence"] == 0.4 for b in bodies)
    assert bodies[-1]["sampling"]["temperature"] == 0.8  # the sampled request carries it too


def test_a_bad_threshold_or_a_draft_longer_than_asked_is_refused():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="stop_confidence"):
            HTTPDrafter("http://server", stop_confidence=bad)
    with HTTPDrafter("http://server", transport=recording_transport([], draft_ids=(1, 2, 3))) as drafter:
        with pytest.raises(DrafterError, match="at most 2"):
            drafter.draft_one([5], 2)


def test_speculate_passes_the_probability_rules_threshold_to_the_server():
    def config(**kw):
        return SpeculateConfig(draft="http://127.0.0.1:9", prompts="p", **kw)

    assert server_stop_confidence(config(draft_stop="probability")) == 0.4  # the rule's default
    assert server_stop_confidence(config(draft_stop="probability", draft_confidence=0.7)) == 0.7
    assert server_stop_confidence(config(draft_stop="probability", draft_confidence=0)) is None  # 0: always k
    assert server_stop_confidence(config()) is None  # calibrated: the server never sees what the target kept
    assert server_stop_confidence(config(draft_stop="both")) is None
    for stop, want in (("probability", 0.4), ("calibrated", None)):
        built = build_drafters(config(draft_stop=stop), None)
        try:
            server = next(b for b in built if b.spec.role == "server" and not b.spec.behind_lookup)
            assert isinstance(server.drafter, HTTPDrafter) and server.drafter.stop_confidence == want
            assert server.source == {"kind": "http", "url": "http://127.0.0.1:9", "stop_confidence": want}
        finally:
            for b in built:
                b.drafter.close()


@torch.inference_mode()
def test_speculation_through_a_stopping_server_is_lossless_and_drafts_less(tiny_qwen3_dir):
    config = ServeConfig(model_dir=str(tiny_qwen3_dir), compute="float32", threads=1)
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    prompts = [[5, 17, 42], [100, 3, 9, 250, 7]]
    drafted = {}
    with ThreadServer(create_app(config, load_engine(tiny_qwen3_dir, None, "float32")), config) as srv:
        for stop in (None, 0.3):
            with HTTPDrafter(srv.url, concurrency=1, stop_confidence=stop) as drafter:
                gens = [speculative_generate(target, drafter, p, 24, 16, eos_ids=set()) for p in prompts]
            for p, g in zip(prompts, gens):
                assert g.tokens == naive_greedy(target, p, 24, stop_at_eos=False).tokens
            drafted[stop] = sum(g.drafted for g in gens)
        stopped = metric_samples(srv.url)[("specdraft_drafts_stopped_total", ())]
    assert stopped > 0 and drafted[0.3] < drafted[None]
