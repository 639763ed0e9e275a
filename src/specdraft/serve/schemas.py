"""Request bodies of the OpenAI-compatible API, validated strictly: a mistyped field ("5" for
an int, "yes" for a bool) is a 400, as it would be on OpenAI's side, not a silent coercion.
Text must be valid Unicode (a lone surrogate such as "\\ud800" is a 400), and parameters that
would change the output but are not implemented are refused unless at their neutral value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_STOPS = 4  # OpenAI's limit


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

# Parameters that change what is generated and that this server does not implement, with the
# values that mean "off" (sent by clients that fill every field in).
REFUSED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "top_logprobs": (None, 0),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "stop_token_ids": (None, []),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


def refused_parameter(body: dict) -> str | None:
    """The first parameter in `body` that would change the output and is not implemented."""
    for name, neutral in REFUSED.items():
        if name in body and not any(_same(body[name], n) for n in neutral):
            return name
    return None


def _same(value: Any, neutral: Any) -> bool:
    # Compared in type as well: True == 1 in Python, but `best_of: true` is no neutral value.
    return type(value) is type(neutral) and value == neutral


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send `user`, `metadata`, ...); known ones must be right.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # OpenAI's default is 1
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)  # extension (vLLM's name); 0 or -1: off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    presence_penalty: float = Field(0.0, ge=0, le=0)  # accepted only at their neutral value
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    logprobs: bool | int | None = None
    speculative: bool = True  # extension: false = this request never drafts (same output, plain speed)

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        return tuple(stops)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] = Field(min_length=1)
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
