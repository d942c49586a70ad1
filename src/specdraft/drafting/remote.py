"""The draft server as a drafter: ``POST /draft`` over HTTP (httpx), several requests in flight.

Sampled drafts (``draft_with_probs``) use the request's optional fields: ``sampling`` {temperature, top_p, top_k,
seed}, ``return_probs`` and ``top_alternatives`` (at most ``MAX_TOP_ALTERNATIVES``); the answer then carries
``draft_probs`` (q of each drafted token) and ``top_ids`` / ``top_probs`` (q's most likely tokens at each
position). Without those fields a request is today's greedy one.

``stop_confidence`` t asks the server to end each draft after the first token whose confidence is below t (the
"probability" stop rule of an in-process draft): the draft may then be shorter than asked, which a speculative
loop takes as it takes any short draft, and the server spends no decode steps on the rest.

A server that cannot keep up answers 503 with ``Retry-After`` (overloaded, queue full, timed out, still loading).
The client honours it: it waits as told and sends the request again, and halves how many requests it keeps in
flight (``AdaptiveLimit``, additive increase after successes, as TCP's congestion window), so a slow server makes
an evaluation slower, never failed. Only a server still refusing after ``patience_s`` is an error, one that names
the server, the waits and what to change.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx
import torch

from specdraft.core.wire import MAX_GUIDES, MAX_TOP_ALTERNATIVES
from specdraft.drafting.base import DraftDistributions, Drafter, DrafterError, check_guided
from specdraft.model.sampling import SamplingParams

log = logging.getLogger(__name__)

# 503 answers worth another try after Retry-After: the server is busy or still loading, not going away
RETRYABLE_ERRORS = ("overloaded", "queue_full", "timeout", "not_ready")
DEFAULT_PATIENCE_S = 600.0  # how long one request keeps retrying before the client gives up
MAX_RETRY_WAIT_S = 30.0  # the longest single wait, whatever Retry-After says


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prob_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, (int, float)) and not isinstance(p, bool)
                                           and math.isfinite(p) and 0 <= p <= 1 for p in value)


def draft_request(context: Sequence[int], num_tokens: int, stop_confidence: float | None = None,
                  guides: Sequence[Sequence[int]] = (), guide_min_ratio: float | None = None) -> dict:
    """The ``POST /draft`` body for a greedy draft; ``stop_confidence`` only when set (absent: num_tokens always),
    ``guides`` (their first num_tokens; the first ``MAX_GUIDES``) only when there are any: the first as guide_ids,
    the others as guide_alternatives, with ``guide_min_ratio``."""
    body: dict[str, Any] = {"token_ids": [int(t) for t in context], "num_tokens": int(num_tokens)}
    if stop_confidence is not None:
        body["stop_confidence"] = float(stop_confidence)
    sent = [[int(t) for t in guide][:num_tokens] for guide in guides if len(guide)][:MAX_GUIDES]
    if sent:
        body["guide_ids"] = sent[0]
        if sent[1:]:
            body["guide_alternatives"] = sent[1:]
        if guide_min_ratio is not None:
            body["guide_min_ratio"] = float(guide_min_ratio)
    return body


def sampling_request(context: Sequence[int], num_tokens: int, params: SamplingParams, seed: int | None,
                     stop_confidence: float | None = None) -> dict:
    """The ``POST /draft`` body for a draft sampled under ``params``, with every alternative the server gives."""
    alternatives = params.top_k if 0 < params.top_k <= MAX_TOP_ALTERNATIVES else MAX_TOP_ALTERNATIVES
    return {**draft_request(context, num_tokens, stop_confidence),
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


class AdaptiveLimit:
    """How many requests may be in flight: at most ``ceiling``, halved when the server refuses one (at most once
    per ``cooldown_s``, so one burst of refusals halves it once), one more after each ``limit`` answers in a row."""

    def __init__(self, ceiling: int, cooldown_s: float = 1.0, clock=time.monotonic):
        self.ceiling, self.limit, self.lowest = ceiling, ceiling, ceiling
        self.cooldown_s, self._clock = cooldown_s, clock
        self._in_flight, self._answered, self._last_cut = 0, 0, -math.inf
        self._cond = threading.Condition()

    def acquire(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight < self.limit)
            self._in_flight += 1

    def release(self, refused: bool) -> None:
        with self._cond:
            self._in_flight -= 1
            now = self._clock()
            if refused:
                self._answered = 0
                if now - self._last_cut >= self.cooldown_s and self.limit > 1:
                    self.limit, self._last_cut = max(1, self.limit // 2), now
                    self.lowest = min(self.lowest, self.limit)
            else:
                self._answered += 1
                if self._answered >= self.limit and self.limit < self.ceiling:
                    self.limit, self._answered = self.limit + 1, 0
            self._cond.notify_all()


def retry_after_seconds(response: httpx.Response, default: float = 1.0) -> float:
    """The wait a 503 asks for: its Retry-After in seconds (integer or decimal), ``default`` without one."""
    try:
        return max(0.0, float(response.headers.get("retry-after", default)))
    except ValueError:  # an HTTP date, which this server never sends
        return default


class HTTPDrafter(Drafter):
    """Drafts from the draft server: one ``POST /draft`` per context, up to ``concurrency`` requests in flight,
    fewer while the server refuses work (``AdaptiveLimit``); a refused request is sent again after its Retry-After
    for up to ``patience_s`` seconds.

    Keeps each request's latency (seconds; of the answered attempt); ``take_latencies()`` returns and clears them.
    ``backpressure`` counts the retries, the seconds waited and the lowest concurrency reached.
    ``stop_confidence`` (in (0, 1]; None: every draft as long as asked) goes with every request.
    """

    def __init__(self, url: str, concurrency: int = 8, timeout: float = 120.0, name: str | None = None,
                 transport: httpx.BaseTransport | None = None, patience_s: float = DEFAULT_PATIENCE_S,
                 stop_confidence: float | None = None):
        if stop_confidence is not None and not 0 < stop_confidence <= 1:
            raise ValueError(f"stop_confidence must be in (0, 1] (None: no stop), got {stop_confidence!r}")
        self.url = url.rstrip("/")
        self.concurrency = concurrency
        self.name = name or self.url
        self.patience_s = patience_s
        self.stop_confidence = stop_confidence
        self._named = name is not None
        self._client = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                    limits=httpx.Limits(max_connections=concurrency,
                                                        max_keepalive_connections=concurrency))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="http-drafter")
        self._latencies: list[float] = []
        self._lock = threading.Lock()
        self._limit = AdaptiveLimit(concurrency)
        self._retries, self._waited = 0, 0.0

    @property
    def backpressure(self) -> dict[str, Any]:
        """What the server's refusals cost so far: retries, seconds waited, the concurrency now and its lowest."""
        with self._lock:
            return {"retries": self._retries, "waited_s": round(self._waited, 3), "concurrency": self.concurrency,
                    "concurrency_now": self._limit.limit, "concurrency_lowest": self._limit.lowest}

    def health(self) -> dict:
        """The server's ``GET /health`` answer (what it serves, and its compute and why)."""
        try:
            answer = self._client.get("/health").json()
        except (httpx.HTTPError, ValueError) as e:
            raise DrafterError(f"{self.url}/health: no usable answer ({e.__class__.__name__}: {e})") from e
        if not isinstance(answer, dict):
            raise DrafterError(f"{self.url}/health: not a JSON object: {str(answer)[:200]}")
        return answer

    def _post(self, body: dict) -> dict:
        """One answered ``POST /draft``: refusals (503 + Retry-After) waited out and retried within the patience."""
        first_refusal, waits = None, []
        while True:
            self._limit.acquire()
            started = time.perf_counter()
            try:
                response = self._client.post("/draft", json=body)
            except httpx.HTTPError as e:
                self._limit.release(refused=False)
                raise DrafterError(f"{self.url}/draft: request failed ({e.__class__.__name__}: {e})") from e
            elapsed = time.perf_counter() - started
            refused = response.status_code == 503 and _error_name(response) in RETRYABLE_ERRORS
            self._limit.release(refused)
            if not refused:
                break
            now = time.monotonic()
            first_refusal = first_refusal or now
            wait = min(MAX_RETRY_WAIT_S, retry_after_seconds(response)) * random.uniform(1.0, 1.25)  # de-synchronise
            if now + wait - first_refusal > self.patience_s:
                raise DrafterError(
                    f"{self.url}/draft: the server still refused after {len(waits) + 1} tries over "
                    f"{now - first_refusal:.0f}s (waits {', '.join(f'{w:.1f}s' for w in waits) or 'none'}; last "
                    f"answer HTTP 503 {response.text[:200]}). It cannot keep up: lower the client's concurrency "
                    f"(now {self._limit.limit} of {self.concurrency}), raise its patience, raise the server's "
                    "--request-timeout-s, or serve a faster --compute (auto measures it) or more --threads")
            if not waits:
                log.info("%s/draft busy (HTTP 503 %s): retrying after %.1fs; %d requests in flight at most now",
                         self.url, _error_name(response), wait, self._limit.limit)
            waits.append(wait)
            with self._lock:
                self._retries, self._waited = self._retries + 1, self._waited + wait
            time.sleep(wait)
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

    def draft_one(self, context: Sequence[int], num_tokens: int, guides: Sequence[Sequence[int]] = (),
                  guide_min_ratio: float | None = None) -> list[int]:
        answer = self._post(draft_request(context, num_tokens, self.stop_confidence, guides, guide_min_ratio))
        ids = answer.get("draft_ids")
        if not _int_list(ids) or len(ids) > num_tokens:
            raise DrafterError(f"{self.url}/draft: 'draft_ids' is not a list of at most {num_tokens} ints: "
                               f"{str(answer)[:200]}")
        return ids

    def draft(self, contexts: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        # no guides: the plain request
        return self.draft_guided(contexts, num_tokens, [()] * len(contexts), [None] * len(contexts))

    follows_guides = True

    def draft_guided(self, contexts, num_tokens, guides, min_ratios):
        """One request per context (its guides only where it has any), up to ``concurrency`` in flight."""
        check_guided(contexts, guides, min_ratios)
        if len(contexts) == 1:
            return [self.draft_one(contexts[0], num_tokens, guides[0], min_ratios[0])]
        return list(self._pool.map(lambda row: self.draft_one(row[0], num_tokens, row[1], row[2]),
                                   zip(contexts, guides, min_ratios)))

    def draft_with_probs(self, contexts, num_tokens, params, generator=None):
        """The server samples (seeded from ``generator``: the same generator state, the same drafts) and answers
        q of each drafted token and its top alternatives (``parse_sampled``)."""
        if params.greedy:
            return super().draft_with_probs(contexts, num_tokens, params, generator)
        # seeds drawn here, in the contexts' order, so concurrency does not change which context gets which
        seeds = [int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) for _ in contexts]
        bodies = [sampling_request(c, num_tokens, params, s, self.stop_confidence) for c, s in zip(contexts, seeds)]
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


def _error_name(response: httpx.Response) -> str | None:
    """The ``error`` field of a specdraft error body (None for any other body)."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None
