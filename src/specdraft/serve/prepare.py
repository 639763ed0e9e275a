"""What a request costs before the engine sees it: JSON parsing, validation, the chat
template, tokenization and the context check. The server runs all of it in a worker thread,
never on the event loop, and refuses a prompt too long to fit before tokenizing it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from specdraft.errors import SpecdraftError
from specdraft.sampling import MIN_SCALED_TEMPERATURE, SamplingParams
from specdraft.serve.schemas import ChatRequest, CompletionRequest, SamplingFields, refused_parameter
from specdraft.serve.served import ServedModel
from specdraft.serve.shapes import ApiError
from specdraft.serve.text import encode, longest_token_chars
from specdraft.speculative.request import Request as EngineRequest


DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
# Pydantic names union members and validators in error locations; only field names help a user.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "model"}
M = TypeVar("M", bound=BaseModel)


@dataclass
class Prepared:
    request: EngineRequest
    stops: tuple[str, ...]
    stream: bool
    usage: bool  # streamed: end with a usage chunk


def prepare(raw: bytes, chat: bool, served: ServedModel) -> Prepared:
    """The engine request for a raw body, or ApiError (4xx) saying what is wrong with it."""
    body = parse(raw, ChatRequest if chat else CompletionRequest)
    if body.model is not None and body.model != served.name:
        raise ApiError(404, f"model {body.model!r} not found; this server serves {served.name!r}",
                       code="model_not_found", param="model")
    params, stops = sampling(body)
    if chat:
        text, max_tokens = render(body, served), body.max_completion_tokens or body.max_tokens
    else:
        text, max_tokens = completion_prompt(body), body.max_tokens
    room = served.engine.room
    chars = longest_token_chars(served.tokenizer)
    if chars is not None and len(text) > 2 * chars * room:
        raise ApiError(400, f"prompt of {len(text)} characters cannot fit the context of {room} tokens (no token "
                            f"is longer than {chars} characters)", code="context_length_exceeded", param="prompt")
    ids = encode(served.tokenizer, text, add_special_tokens=not chat)  # a template writes its own BOS
    if max_tokens is None:  # chat: the rest of the context (OpenAI's default); completions: 16
        max_tokens = max(1, room - len(ids)) if chat else DEFAULT_COMPLETION_TOKENS
    req = EngineRequest(ids, max_tokens, params, stops, speculative=body.speculative)
    try:
        served.engine.check(req)
    except SpecdraftError as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None
    usage = body.stream_options is not None and body.stream_options.include_usage
    return Prepared(req, stops, body.stream, usage)


def parse(raw: bytes, model: type[M]) -> M:
    if not raw.strip():
        raise ApiError(400, "request body: a JSON object is required")
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply") from None
    except ValueError as e:  # bad JSON, bad UTF-8, an integer of too many digits
        raise ApiError(400, f"invalid JSON body: {e}") from None
    if isinstance(obj, dict):
        name = refused_parameter(obj)
        if name is not None:
            raise ApiError(400, f"{name} is not supported by this server (it would change the output)",
                           code="unsupported_parameter", param=name)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        field, message = validation_message(e.errors())
        raise ApiError(400, message, param=field) from None


def validation_message(errors: list) -> tuple[str | None, str]:
    """(field, "field: what is wrong") for the first of pydantic's errors; of a union's, the one
    our own checks raised (a lone surrogate in a list says more than "not a string")."""
    ours = [e for e in errors if e.get("type") == "value_error"]
    first = (ours or errors or [{"msg": "invalid request", "loc": ()}])[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    loc = [p for p in loc if p.isdigit() or (p.isidentifier() and p not in _TYPE_TAGS)]
    field = ".".join(loc) or None
    return field, f"{field or 'request body'}: {first['msg']}"


def sampling(body: SamplingFields) -> tuple[SamplingParams, tuple[str, ...]]:
    if body.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    try:
        stops = body.stops()
    except ValueError as e:
        raise ApiError(400, str(e), param="stop") from None
    # Sampling runs in float32, where smaller values underflow or overflow: their limit is greedy.
    greedy = body.temperature < MIN_SCALED_TEMPERATURE or body.top_p < MIN_SCALED_TEMPERATURE
    try:
        params = SamplingParams(0.0 if greedy else body.temperature, max(0, body.top_k), body.top_p, body.seed)
    except SpecdraftError as e:
        raise ApiError(400, str(e)) from None
    return params, stops


def completion_prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, list) and len(body.prompt) != 1:
        raise ApiError(400, "prompt: send one prompt per request (a string)", param="prompt")
    if body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    return body.prompt if isinstance(body.prompt, str) else body.prompt[0]


def render(body: ChatRequest, served: ServedModel) -> str:
    tok = served.tokenizer
    if tok.chat_template is None:
        raise ApiError(400, f"model {served.name} has no chat template; use /v1/completions", param="messages")
    try:
        return tok.render_chat([{"role": m.role, "content": m.text()} for m in body.messages])
    except SpecdraftError as e:
        raise ApiError(400, str(e), param="messages") from None
    except Exception as e:  # the template choked on these messages
        raise ApiError(400, f"chat template failed: {type(e).__name__}: {e}", param="messages") from None
