"""The OpenAI-compatible HTTP API over the step-wise engine (FastAPI).

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
not), GET /v1/models, GET /health, GET /metrics (Prometheus), GET / (the playground). Every
error is OpenAI's JSON shape, {"error": {"message", "type", "param", "code"}}: 4xx for the
client's mistakes, 429 when the batch and queue are full, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdraft.errors import SpecdraftError
from specdraft.sampling import SamplingParams
from specdraft.serve.metrics import Metrics
from specdraft.serve.schemas import ChatRequest, CompletionRequest, SamplingFields
from specdraft.serve.shapes import FINISH, Shaper, error, spec_stats, sse
from specdraft.serve.text import TextStream
from specdraft.serve.worker import EngineWorker, QueueFull, Sink
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request as EngineRequest
from specdraft.tokenizer import Tokenizer

log = logging.getLogger("specdraft.serve")
MAX_BODY_BYTES = 4 * 1024 * 1024  # far above any prompt that fits a context
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.25
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/"}


@dataclass
class ServedModel:
    name: str
    engine: Engine
    tokenizer: Tokenizer
    drafter: str  # the drafter kind actually used ("none" for plain decoding)
    k: int


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error(message, type_, code, param)


class _State:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.served: ServedModel | None = None
        self.worker: EngineWorker | None = None
        self.load_error: str | None = None

    def ready(self) -> tuple[ServedModel, EngineWorker]:
        if self.served is None or self.worker is None:
            why = f"model failed to load: {self.load_error}" if self.load_error else "model is loading; retry shortly"
            raise ApiError(503, why, "service_unavailable", "model_not_ready")
        return self.served, self.worker


def create_app(load: Callable[[], ServedModel], max_queue: int = 64, api_key: str | None = None) -> FastAPI:
    """`load` runs in a thread at startup; until it returns, /health and the API answer 503."""
    state = _State(Metrics())

    def load_in_background() -> None:
        try:
            served = load()
            worker = EngineWorker(served.engine, max_queue, state.metrics)
            worker.start()
            state.served, state.worker = served, worker
            log.info("specdraft: %s ready (drafter %s)", served.name, served.drafter)
        except Exception as e:  # reported by /health, and logged with its traceback
            log.exception("loading the model failed")
            state.load_error = f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load_in_background, name="specdraft-load", daemon=True).start()
        yield
        if state.worker is not None:
            state.worker.stop()

    app = FastAPI(title="specdraft", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.specdraft = state
    _install_error_handlers(app, state)

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", "invalid_api_key")

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        page = resources.files("specdraft.serve").joinpath("static", "playground.html").read_text()
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.served is None:
            status = {"status": "error", "error": state.load_error} if state.load_error else {"status": "loading"}
            return JSONResponse(status, status_code=503)
        return JSONResponse({"status": "ok", "model": state.served.name, "drafter": state.served.drafter})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        served, _ = state.ready()
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "specdraft",
                                            "specdraft": {"drafter": served.drafter, "draft_tokens": served.k}}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served, worker = state.ready()
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise ApiError(400, "prompt: send one prompt per request (a string)", param="prompt")
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
        ids = served.tokenizer.encode(prompt)
        return await _generate(request, body, ids, body.max_tokens, False, served, worker)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatRequest, request: Request) -> Response:
        served, worker = state.ready()
        tok = served.tokenizer
        if tok.chat_template is None:
            raise ApiError(400, f"model {served.name} has no chat template; use /v1/completions", param="messages")
        try:
            rendered = tok.render_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except SpecdraftError as e:
            raise ApiError(400, str(e), param="messages") from None
        ids = tok.encode(rendered, add_special_tokens=False)
        return await _generate(request, body, ids, body.max_completion_tokens or body.max_tokens, True, served, worker)

    return app


def _sampling(body: SamplingFields) -> tuple[SamplingParams, tuple[str, ...]]:
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    try:
        stops = body.stops()
        params = SamplingParams(body.temperature, max(0, body.top_k), body.top_p, body.seed)
    except (ValueError, SpecdraftError) as e:
        raise ApiError(400, str(e)) from None
    return params, stops


async def _generate(request: Request, body: SamplingFields, ids: list[int], max_tokens: int | None, chat: bool,
                    served: ServedModel, worker: EngineWorker) -> Response:
    if body.model is not None and body.model != served.name:
        raise ApiError(404, f"model {body.model!r} not found; this server serves {served.name!r}",
                       code="model_not_found", param="model")
    params, stops = _sampling(body)
    if max_tokens is None:  # chat: the rest of the context (OpenAI's default); completions: 16
        max_tokens = max(1, served.engine.room - len(ids)) if chat else DEFAULT_COMPLETION_TOKENS
    req = EngineRequest(ids, max_tokens, params, stops)
    try:
        served.engine.check(req)
    except SpecdraftError as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
    try:
        worker.submit(req, sink)
    except QueueFull as e:
        raise ApiError(429, str(e), "rate_limit_error", "queue_full") from None
    shaper = Shaper(served.name, chat)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        stream = _stream(sink, req, shaper, TextStream(served.tokenizer, stops), served, worker, usage)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    while True:
        try:
            event = await asyncio.wait_for(sink.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                worker.abort(req.id)  # nobody is listening: free the row
                return Response(status_code=499)
            continue
        if event[0] == "done":
            r = event[1]
            return JSONResponse(shaper.response(r, r.text, spec_stats(r, served.drafter, served.k)))
        if event[0] == "error":
            _, status, message = event
            raise ApiError(status, message, "invalid_request_error" if status < 500 else "server_error")


async def _stream(sink: Sink, req: EngineRequest, shaper: Shaper, text: TextStream, served: ServedModel,
                  worker: EngineWorker, usage: bool):
    finished = False
    try:
        if shaper.chat:
            yield sse(shaper.chunk(None, [], with_usage=usage))
        while True:
            event = await sink.events.get()
            if event[0] == "tokens":
                pieces = text.push(event[1], event[2])
                if pieces:
                    yield sse(shaper.chunk("".join(t for t, _ in pieces), pieces, with_usage=usage))
            elif event[0] == "done":
                finished = True
                r = event[1]
                pieces = text.finish(r.text)
                ext = spec_stats(r, served.drafter, served.k)
                yield sse(shaper.chunk("".join(t for t, _ in pieces), pieces, FINISH[r.finish_reason], usage,
                                       ext | {"pieces": pieces}))
                if usage:
                    yield sse(shaper.usage_chunk(r, ext))
                yield sse("[DONE]")
                return
            else:
                finished = True
                yield sse(error(event[2], "server_error" if event[1] >= 500 else "invalid_request_error"))
                yield sse("[DONE]")
                return
    finally:
        if not finished:  # the client went away mid-stream: free its row
            worker.abort(req.id)


def _install_error_handlers(app: FastAPI, state: _State) -> None:
    @app.middleware("http")
    async def count_and_limit(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            response = JSONResponse(error(f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large"), 413)
        else:
            try:
                response = await call_next(request)
            except Exception:  # an error in a handler that no handler caught: JSON, not a traceback
                log.exception("unhandled error")
                response = JSONResponse(error("internal server error", "server_error"), 500)
        path = request.url.path if request.url.path in ENDPOINTS else "other"
        state.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        if first.get("type") == "json_invalid":
            return JSONResponse(error(f"invalid JSON body: {first.get('ctx', {}).get('error', first['msg'])}"), 400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        message = f"{field or 'request body'}: {first['msg']}"
        return JSONResponse(error(message, param=field or None), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error(message, code=code), e.status_code)
