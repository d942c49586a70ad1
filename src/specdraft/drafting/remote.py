"""The draft server as a drafter: ``POST /draft`` over HTTP (httpx), several requests in flight."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import httpx

from specdraft.drafting.base import Drafter, DrafterError


class HTTPDrafter(Drafter):
    """Drafts from the draft server: one ``POST /draft`` per context, ``concurrency`` requests in flight.

    Keeps each request's latency (seconds); ``take_latencies()`` returns and clears them.
    """

    def __init__(self, url: str, concurrency: int = 8, timeout: float = 120.0, name: str | None = None):
        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self.name = name or self.url
        self._named = name is not None
        self._client = httpx.Client(base_url=self.url, timeout=timeout,
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="http-drafter")
        self._latencies: list[float] = []
        self._lock = threading.Lock()

    def draft_one(self, context: Sequence[int], num_tokens: int) -> list[int]:
        body = {"token_ids": [int(t) for t in context], "num_tokens": int(num_tokens)}
        started = time.perf_counter()
        try:
            response = self._client.post("/draft", json=body)
        except httpx.HTTPError as e:
            raise DrafterError(f"{self.url}/draft: request failed ({e.__class__.__name__}: {e})") from e
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise DrafterError(f"{self.url}/draft answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            answer = response.json()
        except ValueError as e:
            raise DrafterError(f"{self.url}/draft answered non-JSON: {response.text[:200]!r}") from e
        ids = answer.get("draft_ids") if isinstance(answer, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise DrafterError(f"{self.url}/draft: 'draft_ids' is not a list of ints: {str(answer)[:200]}")
        with self._lock:
            self._latencies.append(elapsed)
            if not self._named and isinstance(answer.get("model"), str):
                self.name, self._named = answer["model"], True
        return ids

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        if len(contexts) == 1:
            return [self.draft_one(contexts[0], num_tokens)]
        return list(self._pool.map(lambda c: self.draft_one(c, num_tokens), contexts))

    def take_latencies(self) -> list[float]:
        with self._lock:
            out, self._latencies = self._latencies, []
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
