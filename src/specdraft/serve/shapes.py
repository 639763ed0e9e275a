"""OpenAI's JSON shapes: responses, stream chunks, usage, errors; plus the `specdraft`
extension object with what speculative decoding did for the request."""

from __future__ import annotations

import json
import time
import uuid

from specdraft.speculative.request import GenerationResult

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error(message: str, type_: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
            503: "service_unavailable"}.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(Exception):
    """An error answered in OpenAI's shape with this status."""

    def __init__(self, status: int, message: str, type_: str | None = None, code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error(message, type_ or error_type(status), code, param)


def usage(r: GenerationResult) -> dict:
    n_prompt, n_new = len(r.prompt_ids), len(r.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new,
            "prompt_tokens_details": {"cached_tokens": r.stats.cached_tokens}}  # as OpenAI reports its cache


def spec_stats(r: GenerationResult, drafter: str, k: int) -> dict:
    """The extension object: mean accepted length (tau), acceptance by position, the drafter."""
    return {
        "drafter": drafter,
        "draft_tokens": k,
        **r.stats.summary(),
        "seed": r.seed,
        "ttft": round(r.ttft, 4),
        "seconds": round(r.seconds, 4),
    }


class Shaper:
    """Builds one request's response objects; `chat` picks the chat-completions shapes."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, r: GenerationResult, text: str, extension: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": FINISH[r.finish_reason], "logprobs": None}
            out = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "finish_reason": FINISH[r.finish_reason], "logprobs": None}
            out = self._base("text_completion")
        return out | {"choices": [choice], "usage": usage(r), "specdraft": extension}

    def chunk(self, text: str | None, pieces: list, finish: str | None = None, with_usage: bool = False,
              extension: dict | None = None) -> dict:
        """A stream chunk. Chat: the first one (text None) carries the assistant role."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            out = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            out = self._base("text_completion")
        out["choices"] = [choice]
        out["specdraft"] = extension if extension is not None else {"pieces": pieces}
        if with_usage:
            out["usage"] = None  # OpenAI: every chunk carries usage null until the last one
        return out

    def usage_chunk(self, r: GenerationResult, extension: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(obj) | {"choices": [], "usage": usage(r), "specdraft": extension}


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
