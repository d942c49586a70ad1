"""The HTTP layer: FastAPI app, edge checks, and `specdraft serve` (uvicorn on a pre-bound socket).

Handlers only validate, enqueue and await (LitServe's split): the model runs in the scheduler's worker
thread, so the event loop never waits on torch. A handler whose client goes away, or whose deadline passes,
cancels its request, and the scheduler drops it before computing anything more for it. Every error is JSON
``{"error", "message", "details": [{"field", "reason"}]}``; bad input is always a 4xx and never reaches the queue.
"""

# No `from __future__ import annotations` here: FastAPI must see the per-app DraftRequest class itself.

import asyncio
import logging
import math
import os
import signal
import socket
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdraft import __version__
from specdraft.model.loader import ModelLoadError
from specdraft.model.specs import architecture_facts, load_config
from specdraft.server.config import ServeConfig
from specdraft.server.engine import DraftEngine, PrefixStore, engine_hint, heap_trimming
from specdraft.server.engine_choice import load_serving_engine
from specdraft.server.metrics import ServerMetrics
from specdraft.server.scheduler import (
    ANSWERED,
    CANCELLED,
    FAILED,
    REFUSED_OVERLOAD,
    REFUSED_QUEUE_FULL,
    REFUSED_SHUTDOWN,
    TIMED_OUT,
    Draft,
    DraftFailedError,
    Overloaded,
    QueueFullError,
    Scheduler,
    ShuttingDownError,
    retry_after_header,
)
from specdraft.server.scheduler import Request as QueuedRequest
from specdraft.server.schema import (
    DraftResponse,
    ErrorDetail,
    ErrorResponse,
    Health,
    PrefixCacheHealth,
    draft_request_model,
    draft_sampling,
    integral_bounds,
    validation_details,
)

log = logging.getLogger(__name__)


JSON_ROUTES = {("POST", "/draft")}
# the errors ``POST /draft`` may answer, for the OpenAPI schema
DRAFT_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse, "description": text} for code, text in (
    (400, "malformed JSON"), (413, "body too large"), (415, "body is not application/json"),
    (422, "a field is invalid (named in details)"), (500, "the model failed on this request's iteration"),
    (503, "not loaded yet, overloaded (the work ahead misses the deadline), queue full, shutting down or timed out "
          "(Retry-After)"))}
RETRY_AFTER_S = 1
# seconds uvicorn waits for handlers beyond --shutdown-timeout-s: time to send the refusals of what was not answered
SHUTDOWN_MARGIN_S = 3


class ApiError(Exception):
    def __init__(self, status: int, error: str, message: str, details: list[ErrorDetail] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.details, self.headers = details or [], headers


def error_response(status: int, error: str, message: str, details: list[ErrorDetail] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=error, message=message, details=details or []).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


# ------------------------------------------------------------------------------------------------ state

class ServerState:
    """What the handlers share: the engine and scheduler once loaded, the status, the metrics."""

    def __init__(self, config: ServeConfig, metrics: ServerMetrics, vocab_size: int, max_context: int):
        self.config, self.metrics, self.max_context = config, metrics, max_context
        self.vocab_size = vocab_size  # config.json's: the request schema's, which a loaded draft must match
        self.engine: DraftEngine | None = None  # None until the weights are loaded
        self.scheduler: Scheduler | None = None
        self.prefix_cache: PrefixStore | None = None  # shared by both lanes; None when --prefix-cache-mb is 0
        self.loader: threading.Thread | None = None
        self.status = "loading"
        self.error: str | None = None
        self._stop_lock = threading.Lock()
        self._stopper: threading.Thread | None = None

    def open(self, engine: DraftEngine | None, on_load_failed: Callable[[BaseException], None] | None) -> None:
        """Serve ``engine`` at once, or load the weights in a thread (``/health`` says 503 until they are in)."""
        if engine is not None:
            self.start(engine)
            return
        self.loader = threading.Thread(target=self.load, args=(on_load_failed,), name="specdraft-loader", daemon=True)
        self.loader.start()

    def load(self, on_load_failed: Callable[[BaseException], None] | None = None) -> None:
        """Load the draft named by the config and serve it; on failure, say so in ``/health`` and tell the caller."""
        cfg = self.config
        try:
            loaded = load_serving_engine(cfg)
            if loaded.vocab_size != self.vocab_size:
                raise ValueError(f"loaded vocab {loaded.vocab_size} != config.json vocab {self.vocab_size}")
            if cfg.gguf is None and engine_hint() is not None:
                log.info("%s", engine_hint())
            self.start(loaded)
        except BaseException as e:
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("could not load the draft: %s", self.error)
            if on_load_failed is not None:
                on_load_failed(e)

    def start(self, engine: DraftEngine) -> None:
        cfg = self.config
        after_iteration = heap_trimming(cfg.trim_heap)  # trims once now, before the lanes take their memory
        short_context = min(cfg.long_context_tokens, self.max_context)
        budget = cfg.prefix_cache_bytes()
        self.prefix_cache = engine.prefix_cache(cfg.prefix_block_tokens, budget) if budget else None
        if self.prefix_cache is not None:
            self.metrics.watch_prefix_cache(self.prefix_cache.stats)
        log.info("prefix cache: %s", f"{budget / 2**20:.0f} MiB in blocks of {cfg.prefix_block_tokens} tokens"
                 if budget else "off (--prefix-cache-mb 0): every context prefilled whole")
        short = engine.lane(cfg.max_batch_size, short_context + cfg.num_draft, cfg.num_draft, self.prefix_cache)
        long = (engine.lane(cfg.long_slots, self.max_context + cfg.num_draft, cfg.num_draft, self.prefix_cache)
                if self.max_context > short_context else None)
        self.scheduler = Scheduler(short, long, num_draft=cfg.num_draft, long_context_tokens=short_context,
                                   prefill_tokens=cfg.prefill_tokens, chunk_tokens=cfg.prefill_chunk_tokens,
                                   long_share=cfg.long_share, max_queue=cfg.max_queue,
                                   max_wait_s=cfg.max_wait_ms / 1000, observer=self.metrics,
                                   after_iteration=after_iteration).start()
        self.engine = engine
        self.status = "ok"
        self.metrics.ready.set(1)

    def health(self) -> tuple[Health, bool]:
        """``/health``'s body, and whether the draft is being served."""
        engine = self.engine
        if engine is None:  # loading, or the load failed: no model to describe yet
            body = Health(status=self.status, detail=self.error)
        else:
            body = Health(status=self.status, model=engine.name, compute=engine.compute, detail=self.error,
                          compute_choice=engine.compute_choice, prefix_cache=self._prefix_cache_health())
        return body, self.status == "ok" and self.scheduler is not None and self.scheduler.running

    def _prefix_cache_health(self) -> PrefixCacheHealth | None:
        if self.prefix_cache is None:
            return None
        s = self.prefix_cache.stats()
        return PrefixCacheHealth(block_tokens=s.block_tokens, budget_bytes=s.budget_bytes, used_bytes=s.used_bytes,
                                 blocks=s.blocks)

    def begin_stop(self, timeout: float) -> threading.Thread:
        """Start stopping, once, in a thread of its own: called as soon as the server begins to shut down, so the
        requests it cannot answer within ``timeout`` are refused (503) while uvicorn still waits for their
        handlers, rather than cancelled by uvicorn (a 500)."""
        with self._stop_lock:
            if self._stopper is None:
                self._stopper = threading.Thread(target=self._stop, args=(timeout,), name="specdraft-stop",
                                                 daemon=True)
                self._stopper.start()
            return self._stopper

    def stop(self, timeout: float) -> None:
        """Answer what can be answered within ``timeout``, refuse the rest, and wait for the worker threads (a
        thread still inside torch at interpreter exit aborts the process)."""
        self.begin_stop(timeout).join()

    def _stop(self, timeout: float) -> None:
        self.status = "stopping"
        self.metrics.ready.set(0)
        if self.loader is not None:
            self.loader.join(timeout)
        if self.scheduler is not None:
            self.scheduler.close(timeout)
            log.info("scheduler stopped after %d iterations", self.scheduler.iterations)
        if self.engine is not None and (self.scheduler is None or not self.scheduler.running):
            self.engine.close()  # the worker is done with it


def resolve_limits(config: ServeConfig, vocab_size: int, max_positions: int | None) -> int:
    """The longest context a request may send: --max-context, at most the model's positions - num_draft."""
    room = None if max_positions is None else max_positions - config.num_draft
    if room is not None and room < 1:
        raise ValueError(f"the model has {max_positions} positions: no room for num_draft={config.num_draft}")
    if config.max_context is None:
        if room is None:
            raise ValueError("the model config has no max_position_embeddings: give --max-context")
        return room
    if room is not None and config.max_context > room:
        raise ValueError(f"max_context {config.max_context} + num_draft {config.num_draft} exceeds the model's "
                         f"{max_positions} positions (at most {room})")
    return config.max_context


def _model_facts(config: ServeConfig) -> tuple[int, int | None]:
    """vocab size and positions from config.json, without loading weights (for the request schema)."""

    if not (Path(config.model_dir) / "config.json").is_file():
        raise ModelLoadError(f"{config.model_dir}: not a model dir (no config.json)")
    try:
        cfg = load_config(config.model_dir)
    except ValueError as e:
        raise ModelLoadError(f"{config.model_dir}: cannot read the model config ({e})") from e
    facts = architecture_facts(cfg)
    return int(facts["vocab"]), facts["max_positions"]


# -------------------------------------------------------------------------------------------------- app

def create_app(config: ServeConfig, engine: DraftEngine | None = None,
               on_load_failed: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app. With ``engine`` it serves at once; without, a thread loads the weights at start-up
    and ``/health`` says 503 until they are in."""
    if engine is not None:
        vocab_size, max_positions = engine.vocab_size, engine.max_positions
    else:
        vocab_size, max_positions = _model_facts(config)
    max_context = resolve_limits(config, vocab_size, max_positions)
    state = ServerState(config, ServerMetrics(), vocab_size, max_context)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.open(engine, on_load_failed)
        yield
        await asyncio.to_thread(state.stop, config.shutdown_timeout_s)

    app = FastAPI(title="specdraft draft server", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None,
                  description="Drafts from a small model for speculative decoding: greedy, or sampled with "
                              "the draft's probabilities for speculative sampling.")
    app.state.server = state
    app.state.max_context = max_context
    _add_draft_route(app, state, draft_request_model(vocab_size, max_context, config.num_draft))
    _add_health_route(app, state)
    _add_metrics_route(app, state)
    _integral_schema_bounds(app)
    _install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, metrics=state.metrics, max_body_bytes=config.max_body_bytes)
    return app


# ----------------------------------------------------------------------------------------------- routes

def _add_draft_route(app: FastAPI, state: ServerState, DraftRequest: type[BaseModel]) -> None:
    @app.post("/draft", response_model=DraftResponse, responses=DRAFT_ERRORS,
              summary="the draft model's next num_tokens tokens after token_ids (greedy, or sampled), with "
                      "their probabilities when asked")
    async def draft(body: DraftRequest, request: Request) -> Any:  # type: ignore[valid-type]
        engine, scheduler = state.engine, state.scheduler
        if state.status != "ok" or engine is None or scheduler is None:
            raise ApiError(503, "not_ready", f"the draft is not being served (status: {state.status})",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        pending = _submit(scheduler, body, state)
        drafted = await _wait_for_draft(pending, request, state)
        if drafted is None:  # the client went away
            return Response(status_code=499)  # nginx's "client closed request"
        state.metrics.outcome(ANSWERED, len(drafted.tokens))
        payload: dict[str, Any] = {"draft_ids": drafted.tokens, "model": engine.name}
        if body.return_probs:  # fields a request did not ask for stay absent: the greedy answer is unchanged
            payload["draft_probs"] = drafted.probs
        if body.top_alternatives:
            payload["top_ids"], payload["top_probs"] = drafted.top_ids, drafted.top_probs
        if body.stop_confidence is not None:
            payload["stop_reason"] = "confidence" if drafted.stopped else "length"
            if drafted.stopped:
                state.metrics.stopped(body.num_tokens - len(drafted.tokens))
        return JSONResponse(payload)


def _add_health_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "not ready"}})
    async def health() -> Any:
        body, ok = state.health()
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


def _add_metrics_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics_endpoint() -> Response:
        if state.scheduler is not None:
            state.metrics.queue_depth.set(state.scheduler.queue_depth())
        return Response(state.metrics.render(), media_type=state.metrics.content_type)


def _unavailable(state: ServerState, outcome: str, error: str, message: str,
                 retry_after: float = RETRY_AFTER_S) -> ApiError:
    """A 503 with Retry-After, counted under ``outcome``."""
    state.metrics.outcome(outcome)
    return ApiError(503, error, message, headers={"Retry-After": retry_after_header(retry_after)})


def _submit(scheduler: Scheduler, body: Any, state: ServerState) -> QueuedRequest:
    """Queue a validated request, or refuse it at once (503): overloaded, queue full, or shutting down."""
    try:
        return scheduler.submit(body.token_ids, body.num_tokens, state.config.request_timeout_s, draft_sampling(body))
    except Overloaded as e:
        raise _unavailable(state, REFUSED_OVERLOAD, "overloaded", str(e), e.retry_after) from None
    except QueueFullError as e:
        raise _unavailable(state, REFUSED_QUEUE_FULL, "queue_full", str(e)) from None
    except ShuttingDownError as e:
        raise _unavailable(state, REFUSED_SHUTDOWN, "shutting_down", str(e)) from None


async def _wait_for_draft(pending: QueuedRequest, request: Request, state: ServerState) -> Draft | None:
    """The request's draft; None when its client went away first (the request is then dropped). A deadline
    passed, a shutdown or a failed model call is an ApiError."""
    timeout_s = state.config.request_timeout_s
    answer = asyncio.wrap_future(pending.future)
    gone = asyncio.ensure_future(_client_gone(request))
    done, _ = await asyncio.wait({answer, gone}, timeout=max(0.0, pending.deadline - time.monotonic()),
                                 return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if answer not in done:
        if gone in done:  # nobody will read the answer: stop computing it
            pending.cancel(CANCELLED)
            state.metrics.outcome(CANCELLED)
            return None
        pending.cancel(TIMED_OUT)
        raise _unavailable(state, TIMED_OUT, "timeout", f"no draft within {timeout_s}s")
    try:
        return answer.result()
    except (TimeoutError, asyncio.CancelledError):
        raise _unavailable(state, TIMED_OUT, "timeout", f"no draft within {timeout_s}s") from None
    except ShuttingDownError as e:
        raise _unavailable(state, REFUSED_SHUTDOWN, "shutting_down", str(e)) from None
    except DraftFailedError as e:
        state.metrics.outcome(FAILED)
        raise ApiError(500, "draft_failed", f"the model failed on this request's iteration: {e}") from None


async def _client_gone(request: Request, poll_s: float = 0.1) -> None:
    """Returns once the client has closed its connection (an ASGI http.disconnect)."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


def _integral_schema_bounds(app: FastAPI) -> None:
    """FastAPI's OpenAPI model writes integer bounds as floats (maximum: 319.0); write them as integers."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            integral_bounds(original())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error, exc.message, exc.details, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad_json is not None:
            reason = f"{(bad_json.get('ctx') or {}).get('error', 'invalid JSON')} at character {bad_json['loc'][-1]}"
            return error_response(400, "malformed_json", f"the body is not valid JSON: {reason}",
                                  [ErrorDetail(field="body", reason=reason)])
        details = validation_details(errors)
        summary = "; ".join(f"{d.field}: {d.reason}" for d in details[:3])
        return error_response(422, "validation_error", f"invalid request: {summary}", details)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        names = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        detail = str(exc.detail)
        return error_response(exc.status_code, names.get(exc.status_code, "http_error"), detail,
                              [ErrorDetail(field="body" if exc.status_code in (400, 413) else "path", reason=detail)],
                              exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------------- middleware

class EdgeMiddleware:
    """Pure ASGI: count responses by route and status; for JSON routes check the content type and cap the
    body size (Content-Length or streamed) before any parsing."""

    def __init__(self, app: Any, metrics: ServerMetrics, max_body_bytes: int):
        self.app, self.metrics, self.max_body_bytes = app, metrics, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status_seen: list[int] = []
        started = time.perf_counter()

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            if (scope.get("method"), path) in JSON_ROUTES:
                rejection, receive = await self._check_body(scope, receive)
                if rejection is not None:
                    await rejection(scope, receive, send_counting)
                    return
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.request_done(path, status_seen[0] if status_seen else 500, time.perf_counter() - started)

    async def _check_body(self, scope: dict, receive: Callable) -> tuple[Response | None, Callable]:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        ctype = headers.get("content-type")
        if not _is_json(ctype):
            got = f"got {ctype!r}" if ctype else "the header is missing"
            return error_response(415, "unsupported_media_type", f"the body must be application/json ({got})",
                                  [ErrorDetail(field="headers.content-type",
                                               reason=f"expected application/json, {got}")]), receive
        limit = self.max_body_bytes
        too_large = error_response(413, "body_too_large", f"the body exceeds {limit} bytes",
                                   [ErrorDetail(field="body", reason=f"larger than the {limit}-byte limit")])
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            return too_large, receive
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return Response(status_code=400), receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large, receive
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return None, replay


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# ---------------------------------------------------------------------------------------------- serving

class _Server:
    """uvicorn.Server that logs the real bound address once it listens (port 0 included), and ends a
    SIGINT/SIGTERM shutdown normally (uvicorn re-raises the signal after draining, so the process would die
    of it; here the drained server returns and `serve` exits 0)."""

    def __new__(cls, config: Any, on_started: Callable[[], None], on_stopping: Callable[[], Any]):
        class Server(uvicorn.Server):
            async def startup(self, sockets: list[socket.socket] | None = None) -> None:
                await super().startup(sockets=sockets)
                if self.started:
                    on_started()

            async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
                on_stopping()
                await super().shutdown(sockets=sockets)

            @contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                signals = (signal.SIGINT, signal.SIGTERM)
                original = {sig: signal.signal(sig, self._on_signal) for sig in signals}
                try:
                    yield
                finally:
                    for sig, handler in original.items():
                        signal.signal(sig, handler)

            def _on_signal(self, sig: int, frame: Any) -> None:
                if not self.should_exit:
                    log.info("%s: stopping (in-flight and queued requests are answered first)",
                             signal.Signals(sig).name)
                self.handle_exit(sig, frame)

        return Server(config)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of a socket
    # that says it is TCP; with it on, a response's body waited for the client's delayed ACK of its headers
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted connections on Linux
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(config: ServeConfig, app: FastAPI, sock: socket.socket, on_started: Callable[[], None]):
    # uvicorn cancels the handlers still running after its graceful timeout (the client gets a 500): it waits
    # longer than the scheduler, which answers or refuses every request within shutdown_timeout_s
    uv_config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                               timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s) + SHUTDOWN_MARGIN_S,
                               backlog=max(2048, config.max_queue))
    state: ServerState = app.state.server
    return _Server(uv_config, on_started, lambda: state.begin_stop(config.shutdown_timeout_s))


def run_server(config: ServeConfig) -> int:
    """`specdraft serve`: bind, start loading the weights, serve until SIGINT/SIGTERM; drain on the way out."""

    threads = config.threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    log.info("torch threads: %d", threads)
    server_box: list[Any] = []

    def load_failed(_: BaseException) -> None:
        if server_box:
            server_box[0].should_exit = True

    try:
        app = create_app(config, on_load_failed=load_failed)
        sock = bind_socket(config.host, config.port)
    except (ValueError, OSError) as e:  # unreadable model dir, impossible limits, port taken
        log.error("cannot serve: %s", e)
        return 2
    url = url_of(sock)
    server = make_server(config, app, sock, lambda: log.info("listening on %s", url))
    server_box.append(server)
    started = time.time()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    state: ServerState = app.state.server
    log.info("server stopped after %.1fs", time.time() - started)
    return 1 if state.error else 0
