"""Text <-> token ids from local tokenizer files (tokenizer.json + tokenizer_config.json).

The chat template (when the model has one) is rendered with a sandboxed Jinja environment,
as Hugging Face does, so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecdraftError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(config, dict):
        raise SpecdraftError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


class Tokenizer:
    def __init__(self, folder: Path, eos_token_ids: list[int] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.exists():
            raise SpecdraftError(f"{folder}: no tokenizer.json (specdraft reads tokenizers from local files only)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise SpecdraftError(f"{path}: cannot read tokenizer ({e})") from None
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.exists() else {}
        self.chat_template: str | None = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if self.chat_template is None and template_file.exists():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = set(eos_token_ids or [])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = sorted(eos)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def render_chat(self, prompt: str | list[dict[str, str]]) -> str:
        """The prompt as a single user turn (or a list of {"role", "content"} messages, as the
        OpenAI chat API sends them) in the model's chat template, ready for generation."""
        if self.chat_template is None:
            raise SpecdraftError("this model has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:
            raise SpecdraftError(f"chat template failed: {e}") from None

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """Token ids for a prompt: through the chat template when asked (the template writes its
        own BOS, so no second one is added), else plain text with the tokenizer's specials."""
        if chat:
            return self.encode(self.render_chat(prompt), add_special_tokens=False)
        return self.encode(prompt)


class StreamDecoder:
    """Turns a growing list of token ids into text increments without splitting characters.

    Decoding token by token breaks multi-byte characters and SentencePiece spaces (a decoder
    drops the leading space of the first token it sees). So each push decodes a short window,
    the ids of the previous increment (context) followed by the new ones, and emits what the
    new ids add to the context's text; an incomplete UTF-8 sequence waits for more ids. The
    work per push is bounded by the window, never by the length of the output so far.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.window: list[int] = []  # context ids, then ids whose text is not out yet
        self.context = 0  # window[:context] were emitted already

    def push(self, new_ids: list[int]) -> str:
        self.window.extend(new_ids)
        before = self.tokenizer.decode(self.window[: self.context])
        text = self.tokenizer.decode(self.window)
        if text.endswith("\ufffd") or len(text) <= len(before):  # incomplete bytes, or only specials
            return ""
        self.window = self.window[self.context :]
        self.context = len(self.window)
        return text[len(before) :]
