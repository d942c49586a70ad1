"""HTTPDrafter's sampled drafts against the real draft server (in process, uvicorn on port 0, the tiny model in
float32): the server's q is the draft's own warped distribution, seeded drafts repeat, and speculative sampling
runs through it."""

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.drafting.remote import HTTPDrafter
from specdraft.drafting.speculative import speculative_generate
from specdraft.model.sampling import SamplingParams, warp_probs
from specdraft.server.app import bind_socket, create_app, make_server, url_of
from specdraft.server.config import ServeConfig
from specdraft.server.engine import load_engine

PARAMS = SamplingParams(temperature=0.9, top_k=8)


@pytest.fixture(scope="module")
def server_url(tiny_qwen3_dir):
    config = ServeConfig(model_dir=str(tiny_qwen3_dir), compute="float32")
    app = create_app(config, load_engine(tiny_qwen3_dir, None, "float32"))
    sock = bind_socket("127.0.0.1", 0)
    server = make_server(config, app, sock, lambda: None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "in-process server did not start"
        time.sleep(0.01)
    yield url_of(sock)
    server.should_exit = True
    thread.join(30)
    sock.close()


@torch.inference_mode()
def test_the_servers_q_is_the_drafts_warped_distribution(server_url, tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    context = [5, 17, 42, 9, 100]
    with HTTPDrafter(server_url, concurrency=2) as drafter:
        first = drafter.draft_with_probs([context, context[:3]], 6, PARAMS, torch.Generator().manual_seed(1))
        again = drafter.draft_with_probs([context, context[:3]], 6, PARAMS, torch.Generator().manual_seed(1))
    assert [d.ids for d in first] == [d.ids for d in again]  # seeded from the generator
    got = first[0]
    want = warp_probs(model(input_ids=torch.tensor([context + got.ids[:-1]])).logits[0, -6:], PARAMS)
    assert torch.allclose(got.dense(model.config.vocab_size), want, atol=1e-4)  # top_k <= 64: q whole


def test_speculative_sampling_through_the_server(server_url, tiny_qwen3_dir):
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with HTTPDrafter(server_url, concurrency=1) as drafter:
        gens = [speculative_generate(target, drafter, [5, 17, 42], 12, 4, eos_ids=set(), sampling=PARAMS,
                                     generator=generator) for _ in range(3)]
    assert all(len(g.tokens) == 12 for g in gens)
    # the draft is the target itself: q = p, so every drafted token is kept
    assert sum(g.accepted for g in gens) == sum(g.drafted for g in gens) > 0
