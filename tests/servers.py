"""The app served in process for tests: uvicorn in a thread on a port-0 socket, and its /metrics as samples."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specdraft.server.app import bind_socket, create_app, make_server, url_of
from specdraft.server.config import ServeConfig


class ThreadServer:
    """uvicorn in a thread on a pre-bound port-0 socket (the app's lifespan runs as in `serve`)."""

    def __init__(self, app, config: ServeConfig):
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self.server = make_server(config, app, self.sock, lambda: None)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "in-process server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def lanes_server(engine, model_dir, block: int, long_context: int) -> ThreadServer:
    """The packed draft served with small pieces, so that a few dozen tokens reach every path: its prefix cache in
    ``block``-token blocks, contexts past ``long_context`` tokens in the long lane, prefilled ``block`` at a time."""
    cfg = ServeConfig(model_dir=str(model_dir), max_wait_ms=30, max_batch_size=8, prefix_cache_mb=64,
                      prefix_block_tokens=block, long_context_tokens=long_context, prefill_chunk_tokens=block,
                      threads=1)
    return ThreadServer(create_app(cfg, engine), cfg)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def post_together(url: str, requests: list[dict], clients: int = 8) -> list[dict]:
    """``requests`` sent to ``/draft`` by ``clients`` threads, released together ``clients`` at a time, their answers
    in order; fails the test when the server answered none of them in a batch of more than one row (the comparison
    with single requests would then prove nothing)."""
    if len(requests) % clients:  # the last release would wait for clients that never come
        raise ValueError(f"{len(requests)} requests: post_together needs a multiple of {clients}")
    barrier = threading.Barrier(clients)

    def send(request: dict) -> dict:
        with httpx.Client(base_url=url, timeout=60) as client:
            barrier.wait()
            return client.post("/draft", json=request).json()

    before = metric_samples(url)
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(send, requests))
    after = metric_samples(url)
    count, one_row = ("specdraft_iteration_rows_count", ()), ("specdraft_iteration_rows_bucket", (("le", "1.0"),))
    assert (after[count] - before[count]) - (after[one_row] - before[one_row]) > 0, "no batch of more than one"
    return answers
