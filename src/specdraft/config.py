"""One normalised description of a target model, read from a Hugging Face config.json.

Checkpoints spell the same idea several ways (`rope_theta` + `rope_scaling` in older files,
`rope_parameters` per layer type in newer ones, Gemma's `rope_local_base_freq`, Qwen's
`use_sliding_window`...). Each family's parser (`models/architectures/hf_config.py` for the Llama family
and Gemma 3, `models/architectures/gemma4_config.py` for Gemma 4) turns them into one set of fields, with
the shared helpers below, so the model code never has to look at a raw dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.errors import SpecdraftError

FULL = "full_attention"
SLIDING = "sliding_attention"

class ConfigError(SpecdraftError, ValueError):
    """A config.json we cannot run; the message says which field and why."""


@dataclass
class RopeParams:
    """How one attention type rotates q and k. `partial` is the rotated fraction of head_dim."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | yarn | proportional
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    partial: float = 1.0
    attention_factor: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RopeParams":
        kind = d.get("rope_type", d.get("type", "default")) or "default"
        supported = {"default", "linear", "llama3", "yarn", "proportional"}
        if kind not in supported:
            raise ConfigError(f"unsupported rope type {kind!r} (supported: {', '.join(sorted(supported))})")
        return cls(
            theta=float(d.get("rope_theta", 10000.0)),
            kind=kind,
            factor=float(d.get("factor", 1.0) or 1.0),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=d.get("original_max_position_embeddings"),
            beta_fast=float(d.get("beta_fast", 32.0) or 32.0),
            beta_slow=float(d.get("beta_slow", 1.0) or 1.0),
            partial=float(d.get("partial_rotary_factor", 1.0)),
            attention_factor=d.get("attention_factor"),
        )


@dataclass
class ModelConfig:
    family: str  # "llama" | "gemma3" | "gemma4"
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: list[str]
    rope: dict[str, RopeParams]
    sliding_window: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # softmax scale; 0 means head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_offset: bool = False  # Gemma norms scale by (1 + w)
    sandwich_norm: bool = False  # Gemma: extra norms after attention and MLP
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific fields (Gemma 4)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def require_fields(raw: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if raw.get(k) is None]
    if missing:
        raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")


def rope_params_by_type(raw: dict[str, Any], defaults: dict[str, float]) -> dict[str, RopeParams]:
    """Per-layer-type RoPE from either the new `rope_parameters` or the old `rope_theta`/`rope_scaling`.

    `defaults` maps layer type -> theta used when the file does not say (Gemma 3 files often
    omit the sliding-layer theta, which is 10000).
    """
    params = raw.get("rope_parameters")
    out: dict[str, RopeParams] = {}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        for kind, d in params.items():
            out[kind] = RopeParams.from_dict(d)
    elif isinstance(params, dict) and params:
        shared = RopeParams.from_dict(params)
        out = {kind: shared for kind in defaults}
    for kind, theta in defaults.items():
        if kind in out:
            continue
        d: dict[str, Any] = {"rope_theta": theta}
        if kind == FULL or len(defaults) == 1:
            d["rope_theta"] = raw.get("rope_theta", theta)
            d.update(raw.get("rope_scaling") or {})
            if "partial_rotary_factor" in raw:
                d["partial_rotary_factor"] = raw["partial_rotary_factor"]
        elif kind == SLIDING:
            d["rope_theta"] = raw.get("rope_local_base_freq", theta)
        out[kind] = RopeParams.from_dict(d)
    return out


def layer_types_of(raw: dict[str, Any], n: int, default_pattern: int | None) -> list[str]:
    """`layer_types` checked, else every `default_pattern`-th layer full, else all full."""
    types = raw.get("layer_types")
    if types:
        if len(types) != n:
            raise ConfigError(f"layer_types has {len(types)} entries for {n} layers")
        bad = set(types) - {FULL, SLIDING}
        if bad:
            raise ConfigError(f"unknown layer type(s) {sorted(bad)}")
        return list(types)
    if default_pattern:
        # Gemma 3 convention: every `pattern`-th layer is global.
        return [FULL if (i + 1) % default_pattern == 0 else SLIDING for i in range(n)]
    return [FULL] * n


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every family spells the same way."""
    require_fields(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    heads = int(raw["num_attention_heads"])
    return dict(
        model_type=raw["model_type"],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_list(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )
