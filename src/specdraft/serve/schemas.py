"""Request bodies of the OpenAI-compatible API, validated strictly: a mistyped field ("5" for
an int, "yes" for a bool) is a 400, as it would be on OpenAI's side, not a silent coercion."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOPS = 4  # OpenAI's limit


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send `user`, `metadata`, ...); known ones must be right.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # OpenAI's default is 1
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # extension (vLLM's name); 0 or -1: off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    presence_penalty: float = Field(0.0, ge=0, le=0)  # accepted only at their neutral value
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    logprobs: bool | int | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        return tuple(stops)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
