"""The draft server as a drafter: ``POST /draft`` over HTTP (httpx), several requests in flight.

Sampled drafts (``draft_with_probs``) use the request's optional fields: ``sampling`` {temperature, top_p, top_k,
seed}, ``return_probs`` and ``top_alternatives`` (at most ``MAX_TOP_ALTERNATIVES``); the answer then carries
``draft_probs`` (q of each drafted token) and ``top_ids`` / ``top_probs`` (q's most likely tokens at each
position). Without those fields a request is today's greedy one.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx
import torch

from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError
from specdraft.model.sampling import SamplingParams

# The most alternatives per token the server answers: q is known whole (and speculative sampling with the server's
# drafts lossless) only when top_k is at most this.
MAX_TOP_ALTERNATIVES = 64


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prob_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, (int, float)) and not isinstance(p, bool)
                                           and math.isfinite(p) and 0 <= p <= 1 for p in value)


def sampling_request(context: Sequence[int], num_tokens: int, params: SamplingParams, seed: int | None) -> dict:
    """The ``POST /draft`` body for a draft sampled under ``params``, with every alternative the server gives."""
    alternatives = params.top_k if 0 < params.top_k <= MAX_TOP_ALTERNATIVES else MAX_TOP_ALTERNATIVES
    return {"token_ids": [int(t) for t in context], "num_tokens": int(num_tokens),
            "sampling": {"temperature": float(params.temperature), "top_p": float(params.top_p), "top_k": params.top_k,
                         "seed": seed},
            "return_probs": True, "top_alternatives": 0 if params.greedy else alternatives}


def parse_sampled(answer: dict, where: str) -> DraftDistributions:
    """A sampled draft's answer as ``DraftDistributions``: at each position its top alternatives, plus the drafted
    token where it is not among them. q is whole where the alternatives cover the draft's support (top_k <=
    top_alternatives); elsewhere what they leave out counts as q = 0."""
    ids, probs = answer.get("draft_ids"), answer.get("draft_probs")
    if not _int_list(ids):
        raise DrafterError(f"{where}: 'draft_ids' is not a list of ints: {str(answer)[:200]}")
    if not _prob_list(probs) or len(probs) != len(ids):
        raise DrafterError(f"{where}: 'draft_probs' is not one probability per drafted token: {str(answer)[:200]}")
    top_ids, top_probs = answer.get("top_ids"), answer.get("top_probs")
    if top_ids is None and top_probs is None:
        top_ids, top_probs = [[] for _ in ids], [[] for _ in ids]
    if (not isinstance(top_ids, list) or not isinstance(top_probs, list) or len(top_ids) != len(ids)
            or len(top_probs) != len(ids) or not all(_int_list(r) for r in top_ids)
            or not all(_prob_list(r) and len(r) == len(i) for r, i in zip(top_probs, top_ids))):
        raise DrafterError(f"{where}: 'top_ids' / 'top_probs' are not one list of alternatives per drafted token: "
                           f"{str(answer)[:200]}")
    rows = []
    for token, p, alt_ids, alt_probs in zip(ids, probs, top_ids, top_probs):
        row = dict(zip(alt_ids, alt_probs))
        row.setdefault(token, p)
        rows.append(row)
    width = max((len(r) for r in rows), default=1)
    support = torch.zeros(len(rows), width, dtype=torch.long)  # padding: id 0 with q = 0 adds nothing
    q = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        support[i, : len(row)] = torch.tensor(list(row.keys()), dtype=torch.long)
        q[i, : len(row)] = torch.tensor(list(row.values()), dtype=torch.float32)
    return DraftDistributions(list(ids), support, q)


class HTTPDrafter(Drafter):
    """Drafts from the draft server: one ``POST /draft`` per context, ``concurrency`` requests in flight.

    Keeps each request's latency (seconds); ``take_latencies()`` returns and clears them.
    """

    def __init__(self, url: str, concurrency: int = 8, timeout: float = 120.0, name: str | None = None,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self.name = name or self.url
        self._named = name is not None
        self._client = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="http-drafter")
        self._latencies: list[float] = []
        self._lock = threading.Lock()

    def _post(self, body: dict) -> dict:
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
        if not isinstance(answer, dict):
            raise DrafterError(f"{self.url}/draft: 'draft_ids' is not a list of ints: {str(answer)[:200]}")
        with self._lock:
            self._latencies.append(elapsed)
            if not self._named and isinstance(answer.get("model"), str):
                self.name, self._named = answer["model"], True
        return answer

    def draft_one(self, context: Sequence[int], num_tokens: int) -> list[int]:
        answer = self._post({"token_ids": [int(t) for t in context], "num_tokens": int(num_tokens)})
        ids = answer.get("draft_ids")
        if not _int_list(ids):
            raise DrafterError(f"{self.url}/draft: 'draft_ids' is not a list of ints: {str(answer)[:200]}")
        return ids

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        if len(contexts) == 1:
            return [self.draft_one(contexts[0], num_tokens)]
        return list(self._pool.map(lambda c: self.draft_one(c, num_tokens), contexts))

    def draft_with_probs(self, contexts, num_tokens, params, generator=None):
        """The server samples (seeded from ``generator``: the same generator state, the same drafts) and answers
        q of each drafted token and its top alternatives (``parse_sampled``)."""
        if params.greedy:
            return super().draft_with_probs(contexts, num_tokens, params, generator)
        # seeds drawn here, in the contexts' order, so concurrency does not change which context gets which
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) for _ in contexts]
        bodies = [sampling_request(c, num_tokens, params, s) for c, s in zip(contexts, seeds)]
        answers = (list(self._pool.map(self._post, bodies)) if len(bodies) > 1
                   else [self._post(b) for b in bodies])
        return [parse_sampled(a, f"{self.url}/draft") for a in answers]

    def path_probs(self, context, continuation, settings):
        if all(params.greedy for params in settings):
            return super().path_probs(context, continuation, settings)
        raise DrafterError(f"{self.url}: the server answers sampled drafts, not its distribution along a given "
                           "continuation; load the pack it serves in process for acceptance at temperature")

    def take_latencies(self) -> list[float]:
        with self._lock:
            out, self._latencies = self._latencies, []
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()
