"""Reading a Gemma 4 text config (`gemma4_text`, or the `text_config` of a `gemma4` wrapper).

Gemma 4 adds to the Gemma 3 recipe: per-type head shapes (full layers use `global_head_dim`,
and with `attention_k_eq_v` their own KV head count), K/V shared by the last layers, per-layer
input embeddings (PLE), a mixture-of-experts block beside the MLP (26B-A4B), and a double-wide
MLP in the KV-shared layers. Those live in `Gemma4Params`, stored as a dict in
`ModelConfig.extra` (so `ModelConfig.to_dict` stays plain JSON); `gemma4_params(cfg)` reads it
back typed.

Two spellings of the per-type head shapes exist: the files Google publishes say
`global_head_dim` / `num_global_key_value_heads`; transformers 5 rewrites them on save as a
`per_layer_config` {layer index: {head_dim, num_key_value_heads}}. Both are read, with the
defaults transformers applies (global_head_dim 512; the global KV head count only counts when
`attention_k_eq_v` is set).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.config import FULL, SLIDING, ConfigError, ModelConfig, RopeParams, common_fields, layer_types_of

# transformers' Gemma4TextConfig defaults for fields a config.json may leave out.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass
class Gemma4Params:
    head_dim: dict[str, int]  # per layer type
    num_kv_heads: dict[str, int]  # per layer type
    attention_k_eq_v: bool = False  # full layers: V is the raw K projection (no v_proj)
    num_kv_shared_layers: int = 0  # the last N layers reuse K/V of earlier layers
    hidden_size_per_layer_input: int = 0  # PLE width per layer; 0 = no PLE
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False  # KV-shared layers have a 2x intermediate MLP
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    kv_producer: list[int] = field(default_factory=list)  # per layer: the layer whose K/V it uses
    # Multimodal wrappers: image/video/audio placeholder ids, embedded as the pad token (as
    # transformers' Gemma4Model does when no media fill them). Empty for text-only checkpoints.
    placeholder_token_ids: list[int] = field(default_factory=list)

    @property
    def first_shared_layer(self) -> int:
        return len(self.kv_producer) - self.num_kv_shared_layers

    def is_shared(self, layer: int) -> bool:
        return layer >= self.first_shared_layer


def gemma4_params(cfg: ModelConfig) -> Gemma4Params:
    return Gemma4Params(**cfg.extra["gemma4"])


def head_shapes(raw: dict[str, Any], layer_types: list[str], k_eq_v_gates_kv: bool = True
                ) -> tuple[dict[str, int], dict[str, int]]:
    """(head_dim, KV heads) per layer type, from `per_layer_config` or the global_* fields.

    Both must be uniform within a type, since one RoPE table per type serves every layer of it.
    `k_eq_v_gates_kv=False` reads `num_global_key_value_heads` even without `attention_k_eq_v`
    (drafter configs written by specdraft, which state the KV heads of the layers they read).
    """
    heads = int(raw["num_attention_heads"])
    base_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    base_kv = int(raw.get("num_key_value_heads") or heads)
    per_layer: list[dict[str, int]] = [{"head_dim": base_dim, "num_key_value_heads": base_kv} for _ in layer_types]
    overrides = raw.get("per_layer_config")
    # The key's presence decides the spelling, as in transformers: it writes an empty
    # per_layer_config when full layers have the sliding layers' shapes (no default 512 then).
    if overrides is not None:
        for key, values in overrides.items():
            idx = int(key)
            if not 0 <= idx < len(layer_types):
                raise ConfigError(f"per_layer_config names layer {idx}, but there are {len(layer_types)} layers")
            unknown = set(values) - PER_LAYER_KEYS
            if unknown:
                raise ConfigError(f"per_layer_config layer {idx} overrides {sorted(unknown)}; only "
                                  f"{sorted(PER_LAYER_KEYS)} are supported")
            per_layer[idx].update({k: int(v) for k, v in values.items() if v is not None})
    else:
        global_dim = raw.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM) or base_dim
        global_kv = raw.get("num_global_key_value_heads")
        if k_eq_v_gates_kv and not raw.get("attention_k_eq_v"):
            global_kv = None
        for i, t in enumerate(layer_types):
            if t == FULL:
                per_layer[i]["head_dim"] = int(global_dim)
                if global_kv is not None:
                    per_layer[i]["num_key_value_heads"] = int(global_kv)
    dims: dict[str, int] = {}
    kvs: dict[str, int] = {}
    for i, t in enumerate(layer_types):
        d, kv = per_layer[i]["head_dim"], per_layer[i]["num_key_value_heads"]
        if dims.setdefault(t, d) != d or kvs.setdefault(t, kv) != kv:
            raise ConfigError(f"layer {i} ({t}) has head_dim {d} / {kv} KV heads, unlike earlier {t} layers "
                              f"({dims[t]} / {kvs[t]}); mixed shapes within a layer type are not supported")
        if heads % kv:
            raise ConfigError(f"{heads} attention heads are not a multiple of {kv} KV heads (layer {i})")
    for t in (SLIDING, FULL):  # a type the model lacks still gets a shape (drafter configs ask for both)
        dims.setdefault(t, base_dim if t == SLIDING else int(raw.get("global_head_dim") or base_dim))
        kvs.setdefault(t, base_kv)
    return dims, kvs


def kv_producers(layer_types: list[str], num_shared: int) -> list[int]:
    """For each layer, the layer whose K/V it attends over (itself unless KV-shared).

    As transformers: the last `num_shared` layers reuse the K/V of the last earlier,
    non-shared layer of their own type.
    """
    n = len(layer_types)
    first = n - num_shared
    if not 0 <= num_shared < n:
        raise ConfigError(f"num_kv_shared_layers {num_shared} must be in [0, {n}) for a target model")
    out = list(range(first))
    for i in range(first, n):
        owners = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not owners:
            raise ConfigError(f"layer {i} ({layer_types[i]}) shares K/V, but no earlier non-shared layer has that type")
        out.append(owners[-1])
    return out


def _rope(raw: dict[str, Any], layer_types: list[str]) -> dict[str, RopeParams]:
    params = raw.get("rope_parameters") or {}
    out = {}
    for t in sorted(set(layer_types) | {SLIDING, FULL}):
        d = params.get(t) or DEFAULT_ROPE[t]
        out[t] = RopeParams.from_dict(d)
    return out


def gemma4_config(raw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig (family "gemma4") from a gemma4_text config dict."""
    common = common_fields(raw)
    n = common["num_layers"]
    layer_types = layer_types_of(raw, n, 6)
    # transformers forces the last layer to full attention (with a warning); so do we.
    layer_types[-1] = FULL
    if raw.get("use_bidirectional_attention") == "all":
        raise ConfigError("use_bidirectional_attention='all' (non-causal text attention) is not supported")
    dims, kvs = head_shapes(raw, layer_types)
    shared = int(raw.get("num_kv_shared_layers") or 0)
    moe = bool(raw.get("enable_moe_block", False))
    ple = int(raw.get("hidden_size_per_layer_input") or 0)
    params = Gemma4Params(
        head_dim=dims,
        num_kv_heads=kvs,
        attention_k_eq_v=bool(raw.get("attention_k_eq_v", False)),
        num_kv_shared_layers=shared,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input") or 0) if ple else 0,
        use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)),
        enable_moe_block=moe,
        num_experts=int(raw.get("num_experts") or 0) if moe else 0,
        top_k_experts=int(raw.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0) if moe else 0,
        kv_producer=kv_producers(layer_types, shared),
        placeholder_token_ids=[int(raw[k]) for k in ("image_token_id", "video_token_id", "audio_token_id")
                               if raw.get(k) is not None],
    )
    if params.placeholder_token_ids and raw.get("pad_token_id") is None:
        raise ConfigError("a Gemma 4 multimodal config needs pad_token_id (media placeholders embed as padding)")
    if moe and not (params.num_experts and params.top_k_experts and params.moe_intermediate_size):
        raise ConfigError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    if ple and not params.vocab_size_per_layer_input:
        raise ConfigError("hidden_size_per_layer_input is set but vocab_size_per_layer_input is not")
    common.update(head_dim=dims[SLIDING], num_kv_heads=kvs[SLIDING])
    return ModelConfig(
        family="gemma4",
        layer_types=layer_types,
        rope=_rope(raw, layer_types),
        sliding_window=int(raw.get("sliding_window") or 512),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        embed_scale=math.sqrt(common["hidden_size"]),
        attn_scale=1.0,  # q and k are RMS-normalised; no 1/sqrt(d)
        final_softcap=raw.get("final_logit_softcapping"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        norm_offset=False,  # Gemma 4 norms scale by w, not (1 + w)
        sandwich_norm=True,
        extra={"gemma4": asdict(params)},
        **common,
    )
