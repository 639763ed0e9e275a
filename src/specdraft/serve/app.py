"""The OpenAI-compatible HTTP API over the step-wise engine (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus), GET /openapi.json, GET / (the
playground). Every error is OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}:
4xx for the client's mistakes, 429 when the batch and queue are full, 503 while loading, draining
or after the engine failed for good, never a traceback. With an API key, everything but /health
and the playground page needs it. Limits and their reasons: limits.py and docs/server.md.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import resources
from typing import Callable, Iterable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdraft.serve.limits import BODY_TIMEOUT_S, MAX_BODY_BYTES, ClientGone, Guard, disconnected, read_body
from specdraft.serve.metrics import Metrics
from specdraft.serve.prepare import Prepared, prepare, validation_message
from specdraft.serve.schemas import ChatRequest, CompletionRequest
from specdraft.serve.served import ServedModel
from specdraft.serve.shapes import FINISH, ApiError, Shaper, error, error_type, spec_stats, sse
from specdraft.serve.text import TextStream, longest_token_chars
from specdraft.serve.worker import EngineWorker, QueueFull, Sink, Unavailable

log = logging.getLogger("specdraft.serve")
CPU_THREADS = 2  # parsing and tokenizing; each holds a request's worth of CPU work at most
CLIENT_GONE = 499  # nginx's status for a request whose client hung up (nobody reads it)


class _State:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.served: ServedModel | None = None
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None
        self.draining = False
        self.on_fatal: Callable[[str], None] | None = None  # the process's reaction (serve/server.py)

    @property
    def fatal(self) -> str | None:
        return self.load_error or (self.worker.fatal if self.worker is not None else None)

    def health(self) -> tuple[int, dict]:
        if self.fatal is not None:
            return 503, {"status": "error", "error": self.fatal}
        if self.served is None:
            return 503, {"status": "loading"}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok", "model": self.served.name, "drafter": self.served.drafter}

    def ready(self) -> tuple[ServedModel, EngineWorker]:
        if self.fatal is not None:
            raise ApiError(503, f"the server cannot serve: {self.fatal}", code="engine_failed")
        if self.served is None or self.worker is None:
            raise ApiError(503, "model is loading; retry shortly", code="model_not_ready")
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry shortly", code="shutting_down")
        return self.served, self.worker

    def begin_drain(self, timeout: float) -> None:
        """Shutdown: no new requests; those in flight get `timeout` seconds, then fail with 503."""
        self.draining = True
        if self.worker is not None:
            self.worker.drain(timeout)

    def _fatal(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)


def create_app(load: Callable[[], ServedModel], max_queue: int = 64, api_key: str | None = None,
               allowed_hosts: Iterable[str] | None = None, max_body: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT_S) -> FastAPI:
    """`load` runs in a thread at startup; until it returns, /health and the API answer 503.
    `allowed_hosts`: Host header names served (default: localhost's; "*": any)."""
    state = _State(Metrics())
    pool = ThreadPoolExecutor(CPU_THREADS, thread_name_prefix="specdraft-cpu")

    def load_in_background() -> None:
        try:
            served = load()
            longest_token_chars(served.tokenizer)  # read the vocabulary now, not on the first request
            worker = EngineWorker(served.engine, max_queue, state.metrics, on_fatal=state._fatal)
            worker.start()
            state.served, state.worker = served, worker
            log.info("specdraft: %s ready (drafter %s)", served.name, served.drafter)
        except Exception as e:  # reported by /health, and logged with its traceback
            log.exception("loading the model failed")
            state.load_error = f"loading the model failed: {type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load_in_background, name="specdraft-load", daemon=True).start()
        yield
        if state.worker is not None:
            state.worker.stop()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specdraft = state
    app.add_middleware(Guard, metrics=state.metrics, allowed_hosts=allowed_hosts, max_body=max_body,
                       body_timeout=body_timeout)
    _install_error_handlers(app)
    authorize = _authorizer(api_key)
    open_api = _openapi_document(app)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        page = resources.files("specdraft.serve").joinpath("static", "playground.html").read_text()
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = state.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(open_api())

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        served, _ = state.ready()
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "specdraft",
                                            "max_model_len": served.engine.room,
                                            "specdraft": {"drafter": served.drafter, "draft_tokens": served.k}}]}

    async def generate(request: Request, chat: bool) -> Response:
        served, worker = state.ready()
        try:
            raw = await read_body(request.receive, max_body, body_timeout)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        job = await asyncio.get_running_loop().run_in_executor(pool, prepare, raw, chat, served)
        return await _run(request, job, chat, served, worker)

    @app.post("/v1/completions", dependencies=[Depends(authorize)],
              openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)], openapi_extra=_request_body(ChatRequest))
    async def chat(request: Request) -> Response:
        return await generate(request, chat=True)

    return app


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    key = api_key.encode() if api_key is not None else None

    def authorize(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Bytes, not str: compare_digest refuses non-ASCII text (headers arrive as latin-1).
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode("latin-1"), key):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    return authorize


def _request_body(model) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_document(app: FastAPI) -> Callable[[], dict]:
    """FastAPI's document, with the request bodies' nested schemas where their references point."""
    def document() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest):
                schemas.update(model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
            app.openapi_schema = doc
        return app.openapi_schema

    return document


async def _run(request: Request, job: Prepared, chat: bool, served: ServedModel, worker: EngineWorker) -> Response:
    sink = Sink(asyncio.get_running_loop(), asyncio.Queue(), stream=job.stream)
    try:
        worker.submit(job.request, sink)
    except QueueFull as e:
        raise ApiError(429, str(e), code="queue_full") from None
    except Unavailable as e:
        raise ApiError(503, str(e), code="shutting_down" if worker.fatal is None else "engine_failed") from None
    shaper = Shaper(served.name, chat)
    if job.stream:
        stream = _stream(sink, job, shaper, TextStream(served.tokenizer, job.stops), served, worker)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    gone = asyncio.ensure_future(disconnected(request.receive))
    answered = False
    try:
        while True:
            getter = asyncio.ensure_future(sink.events.get())
            await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                return Response(status_code=CLIENT_GONE)
            event = getter.result()
            if event[0] == "done":
                answered = True
                r = event[1]
                return JSONResponse(shaper.response(r, r.text, spec_stats(r, served.drafter, served.k)))
            if event[0] == "error":
                answered = True
                _, status, message, code = event
                raise ApiError(status, message, code=code)
    finally:
        gone.cancel()
        if not answered:  # the client hung up (or the server cancelled the handler): free the row
            worker.abort(job.request.id)


async def _stream(sink: Sink, job: Prepared, shaper: Shaper, text: TextStream, served: ServedModel,
                  worker: EngineWorker):
    finished = False
    try:
        if shaper.chat:
            yield sse(shaper.chunk(None, [], with_usage=job.usage))
        while True:
            event = await sink.events.get()
            if event[0] == "tokens":
                pieces = text.push(event[1], event[2])
                if pieces:
                    yield sse(shaper.chunk("".join(t for t, _ in pieces), pieces, with_usage=job.usage))
            elif event[0] == "done":
                finished = True
                r = event[1]
                pieces = text.finish(r.text)
                ext = spec_stats(r, served.drafter, served.k)
                yield sse(shaper.chunk("".join(t for t, _ in pieces), pieces, FINISH[r.finish_reason], job.usage,
                                       ext | {"pieces": pieces}))
                if job.usage:
                    yield sse(shaper.usage_chunk(r, ext))
                yield sse("[DONE]")
                return
            else:
                finished = True
                _, status, message, code = event
                yield sse(error(message, error_type(status), code))
                yield sse("[DONE]")
                return
    except Exception as e:  # turning tokens into text failed: an error event, not a cut connection
        log.exception("streaming a response failed")
        yield sse(error(f"internal error while streaming the response ({type(e).__name__}); the request was "
                        "not completed", "server_error", "internal_error"))
        yield sse("[DONE]")
    finally:
        if not finished:  # the client went away mid-stream: free its row
            worker.abort(job.request.id)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        # 408 and 413 leave part of the body unread: the connection cannot serve another request.
        return JSONResponse(e.body, e.status, headers={"Connection": "close"} if e.status in (408, 413) else None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        field, message = validation_message(e.errors())
        return JSONResponse(error(message, param=field), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error(message, code=code), e.status_code)
