"""The app served in process for tests: uvicorn in a thread on a port-0 socket, and its /metrics as samples."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specdraft.server.app import bind_socket, make_server, url_of
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


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}
