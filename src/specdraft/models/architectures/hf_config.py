"""config.json -> ModelConfig, for every family specdraft runs: a table from `model_type` to
its parser. The Llama family (Llama 3, Qwen2/2.5/3, Mistral, SmolLM2) and Gemma 3 are read
here, Gemma 4 in gemma4_config.py.

The table lives above config.py, not in it, so config.py stays a leaf every layer can import.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from specdraft.config import (FULL, SLIDING, ConfigError, ModelConfig, common_fields, layer_types_of,
                              rope_params_by_type)
from specdraft.models.architectures.gemma4_config import gemma4_config

LLAMA_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def read_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Build from a config.json dict (a multimodal wrapper's `text_config` is used when present)."""
    if "text_config" in raw and raw.get("model_type") not in LLAMA_TYPES:
        text = dict(raw["text_config"])
        text.setdefault("model_type", raw.get("model_type", "") + "_text")
        # (Gemma 4 wrappers also name the media placeholder tokens, which embed as padding.)
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings",
                    "image_token_id", "video_token_id", "audio_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        raw = text
    model_type = raw.get("model_type", "")
    parser = PARSERS.get(model_type)
    if parser is None:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(PARSERS))})")
    return parser(raw)


def llama_family_config(raw: dict[str, Any]) -> ModelConfig:
    """Llama 3, Qwen2/2.5/3, Mistral, SmolLM2: the plain pre-norm decoder and its switches."""
    common = common_fields(raw)
    n = common["num_layers"]
    model_type = raw["model_type"]
    sliding = raw.get("sliding_window")
    types = raw.get("layer_types")
    if not types:
        if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window") and sliding:
            # Qwen: layers from max_window_layers on use the window.
            start = int(raw.get("max_window_layers", n))
            types = [SLIDING if i >= start else FULL for i in range(n)]
        elif model_type == "mistral" and sliding:
            types = [SLIDING] * n
    layer_types = layer_types_of({"layer_types": types}, n, None)
    if SLIDING not in layer_types:
        sliding = None
    rope = rope_params_by_type(raw, {t: 10000.0 for t in sorted(set(layer_types))})
    is_qwen2 = model_type == "qwen2"
    return ModelConfig(
        family="llama",
        layer_types=layer_types,
        rope=rope,
        sliding_window=int(sliding) if sliding else None,
        hidden_act=raw.get("hidden_act", "silu"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        **common,
    )


def gemma3_config(raw: dict[str, Any]) -> ModelConfig:
    """Gemma 3: (1 + w) sandwich norms, q/k norms, scaled embeddings, sliding/full layers."""
    common = common_fields(raw)
    layer_types = layer_types_of(raw, common["num_layers"], int(raw.get("sliding_window_pattern", 6)))
    rope = rope_params_by_type(raw, {SLIDING: 10000.0, FULL: 1_000_000.0})
    return ModelConfig(
        family="gemma3",
        layer_types=layer_types,
        rope=rope,
        sliding_window=int(raw.get("sliding_window") or 4096),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=math.sqrt(common["hidden_size"]),
        attn_scale=float(raw.get("query_pre_attn_scalar", common["head_dim"])) ** -0.5,
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        norm_offset=True,
        sandwich_norm=True,
        **common,
    )


PARSERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    **dict.fromkeys(LLAMA_TYPES, llama_family_config),
    **dict.fromkeys(("gemma3_text", "gemma3"), gemma3_config),
    **dict.fromkeys(("gemma4_text", "gemma4"), gemma4_config),
}
