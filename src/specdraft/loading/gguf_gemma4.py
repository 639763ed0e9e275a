"""A Gemma 4 GGUF's config (`gemma4` targets and `gemma4-assistant` drafters) read from its keys
and tensors, in the Hugging Face spelling specdraft's config readers take (see gguf_file.py for
the tensor names and what llama.cpp's converter changes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specdraft.config import FULL, SLIDING
from specdraft.errors import SpecdraftError

GEMMA4_ASSISTANT = "gemma4-assistant"
_UNROTATED = 1e29
GEMMA4_STOP_TOKENS = ("<turn|>", "<|tool_response>", "<end_of_turn>")


def float32_values(path: Path, tensor) -> np.ndarray:
    from gguf import quants

    try:
        return quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    except Exception as e:
        raise SpecdraftError(f"{path}: cannot dequantise {tensor.name} ({e}); is the file truncated or corrupt?") from None


def _decimal(value: Any) -> float | None:
    """A float32 key as the decimal it was written from (1e-06, not 9.99999997e-07): the shortest
    text that rounds to the same float32, so the config reads as the original one."""
    return None if value is None else float(str(np.float32(value)))


def _per_layer(path: Path, reader, key: str, n: int, default: Any = None) -> list[int]:
    """A key llama.cpp writes either as one number or as an array with one entry per layer."""
    value = reader.value(key, default)
    if value is None:
        raise SpecdraftError(f"{path}: GGUF lacks {key}")
    if isinstance(value, list):
        if len(value) != n:
            raise SpecdraftError(f"{path}: GGUF {key} has {len(value)} entries for {n} layers")
        return [int(v) for v in value]
    return [int(value)] * n


def _by_type(path: Path, key: str, values: list[int], types: list[str]) -> dict[str, int]:
    """Per-layer values -> one per layer type (specdraft runs one shape per type)."""
    out: dict[str, int] = {}
    for i, (v, t) in enumerate(zip(values, types)):
        if out.setdefault(t, v) != v:
            raise SpecdraftError(f"{path}: GGUF {key} differs between {t} layers ({out[t]} and {v} at layer {i}); "
                                 "not supported")
    return out


def _gemma4_attention(path: Path, reader, arch: str, tensors: dict, n: int) -> dict[str, Any]:
    """The Gemma 4 text-config fields of a gemma4 or gemma4-assistant GGUF's attention: layer
    types, per-type head dims and KV heads, window, RoPE (the full layers' from rope_freqs)."""
    def a(key: str, default: Any = None) -> Any:
        return reader.value(f"{arch}.{key}", default)

    pattern = a("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise SpecdraftError(f"{path}: GGUF needs {arch}.attention.sliding_window_pattern, one bool per layer")
    types = [SLIDING if bool(x) else FULL for x in pattern]
    heads = _by_type(path, "attention.head_count", _per_layer(path, reader, f"{arch}.attention.head_count", n), types)
    if len(set(heads.values())) != 1:
        raise SpecdraftError(f"{path}: GGUF head_count differs between layer types ({heads}); not supported")
    kv = _by_type(path, "attention.head_count_kv", _per_layer(path, reader, f"{arch}.attention.head_count_kv", n), types)
    full_dim = int(a("attention.key_length"))
    sliding_dim = int(a("attention.key_length_swa", full_dim))
    for key, want in (("attention.value_length", full_dim), ("attention.value_length_swa", sliding_dim)):
        if a(key) is not None and int(a(key)) != want:
            raise SpecdraftError(f"{path}: GGUF {arch}.{key} {a(key)} differs from the key length {want}; not supported")
    if int(a("rope.dimension_count_swa", sliding_dim)) != sliding_dim:
        raise SpecdraftError(f"{path}: GGUF rotates {a('rope.dimension_count_swa')} of {sliding_dim} sliding head dims; "
                             "not supported")
    if int(a("rope.dimension_count", full_dim)) != full_dim:
        raise SpecdraftError(f"{path}: GGUF rope.dimension_count {a('rope.dimension_count')} differs from the full "
                             f"layers' head dim {full_dim}; not supported")
    if reader.value(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise SpecdraftError(f"{path}: GGUF rope scaling {reader.value(f'{arch}.rope.scaling.type')!r} on Gemma 4 is "
                             "not supported")
    rotated = full_dim // 2  # the full layers' proportional RoPE: freq factor 1 rotates, 1e30 does not
    if "rope_freqs.weight" in tensors:
        factors = float32_values(path, tensors["rope_freqs.weight"]).reshape(-1)
        rotated = int((factors < _UNROTATED).sum())
        if len(factors) != full_dim // 2 or not (np.all(factors[:rotated] == 1.0) and np.all(factors[rotated:] >= _UNROTATED)):
            raise SpecdraftError(f"{path}: GGUF rope_freqs are not proportional RoPE's (1 for the first pairs, 1e30 for "
                                 "the rest); not supported")
    out: dict[str, Any] = {
        "num_attention_heads": next(iter(heads.values())),
        "layer_types": types,
        "head_dim": sliding_dim,
        "global_head_dim": full_dim,
        "num_key_value_heads": kv.get(SLIDING, kv.get(FULL)),
        "sliding_window": int(a("attention.sliding_window", 512)),
        "rms_norm_eps": _decimal(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(a("context_length", 131072)),
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": _decimal(a("rope.freq_base_swa", 10000.0))},
            FULL: {"rope_type": "proportional", "rope_theta": _decimal(a("rope.freq_base", 1_000_000.0)),
                   "partial_rotary_factor": 2 * rotated / full_dim},
        },
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if FULL in kv and kv[FULL] != out["num_key_value_heads"]:
        out["num_global_key_value_heads"] = kv[FULL]
    return out


def gemma4_config(path: Path, reader, tensors: dict, vocab: int) -> dict[str, Any]:
    arch = "gemma4"

    def a(key: str, default: Any = None) -> Any:
        return reader.value(f"{arch}.{key}", default)

    n = int(a("block_count"))
    hidden = int(a("embedding_length"))
    cfg = _gemma4_attention(path, reader, arch, tensors, n)
    shared = int(a("attention.shared_kv_layers", 0) or 0)
    first_shared = n - shared
    full_layers = [i for i, t in enumerate(cfg["layer_types"]) if t == FULL and i < first_shared]
    # Full layers that store K/V but have no attn_v use the K projection as V.
    k_eq_v = bool(full_layers) and all(f"blk.{i}.attn_v.weight" not in tensors for i in full_layers)
    if "num_global_key_value_heads" in cfg and not k_eq_v:
        # Only per_layer_config states the full layers' KV heads without k_eq_v (transformers
        # ignores num_global_key_value_heads then), and where it is present it states their head
        # dim too (readers fall back to the sliding head_dim, not to global_head_dim): both, as
        # transformers writes it and as llama.cpp's converter reads it back.
        full_kv = cfg.pop("num_global_key_value_heads")
        cfg["per_layer_config"] = {str(i): {"head_dim": cfg["global_head_dim"], "num_key_value_heads": full_kv}
                                   for i, t in enumerate(cfg["layer_types"]) if t == FULL}
    ff = _per_layer(path, reader, f"{arch}.feed_forward_length", n)
    double = [2 * ff[0] if i >= first_shared else ff[0] for i in range(n)]
    if ff != [ff[0]] * n and ff != double:
        raise SpecdraftError(f"{path}: GGUF feed_forward_length {ff} is neither one width nor double-wide KV-shared "
                             "layers; not supported")
    ple = int(a("embedding_length_per_layer_input", 0) or 0)
    experts = int(a("expert_count", 0) or 0)
    moe = experts > 0 and "blk.0.ffn_gate_inp.weight" in tensors
    names = reader.value("tokenizer.ggml.tokens") or []
    stops = [names.index(t) for t in GEMMA4_STOP_TOKENS if t in names]
    eos = reader.value("tokenizer.ggml.eos_token_id")
    cfg.update(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ff[0],
        num_hidden_layers=n,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=ff != [ff[0]] * n,
        attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"].shape[-1])
        if ple and "per_layer_token_embd.weight" in tensors else 0,
        enable_moe_block=moe,
        num_experts=experts if moe else None,
        top_k_experts=int(a("expert_used_count", 0)) if moe else None,
        moe_intermediate_size=int(a("expert_feed_forward_length", 0)) if moe else None,
        final_logit_softcapping=_decimal(a("final_logit_softcapping")),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=reader.value("tokenizer.ggml.bos_token_id"),
        eos_token_id=list(dict.fromkeys(([eos] if eos is not None else []) + stops)) or None,
        pad_token_id=reader.value("tokenizer.ggml.padding_token_id"),
        torch_dtype="float32",
    )
    if ple and "per_layer_token_embd.weight" not in tensors:
        raise SpecdraftError(f"{path}: GGUF states per-layer inputs but has no per_layer_token_embd.weight")
    return {k: v for k, v in cfg.items() if v is not None}


def assistant_config(path: Path, reader, tensors: dict, vocab: int) -> dict[str, Any]:
    """The Gemma 4 assistant config.json of a gemma4-assistant GGUF: the drafter's own widths in
    the keys, the target's width in embedding_length_out, every layer KV-shared."""
    arch = GEMMA4_ASSISTANT

    def a(key: str, default: Any = None) -> Any:
        return reader.value(f"{arch}.{key}", default)

    n = int(a("block_count"))
    text = _gemma4_attention(path, reader, arch, tensors, n)
    backbone = a("embedding_length_out")
    if backbone is None:
        raise SpecdraftError(f"{path}: GGUF lacks {arch}.embedding_length_out (the target's hidden size)")
    ff = _per_layer(path, reader, f"{arch}.feed_forward_length", n)
    if ff != [ff[0]] * n:
        raise SpecdraftError(f"{path}: GGUF feed_forward_length differs between layers ({ff}); not supported")
    kv_full = text.pop("num_global_key_value_heads", None)
    text.update(
        model_type="gemma4_text",
        vocab_size=vocab,
        hidden_size=int(a("embedding_length")),
        intermediate_size=ff[0],
        num_hidden_layers=n,
        num_kv_shared_layers=n,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        enable_moe_block=False,
        use_double_wide_mlp=False,
    )
    if kv_full is not None:  # transformers reads the full layers' KV heads only with this flag
        text.update(num_global_key_value_heads=kv_full, attention_k_eq_v=True)
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": int(backbone),
        "use_ordered_embeddings": False,  # no clustered head in this layout: a dense one over token_embd
        "tie_word_embeddings": True,
        "text_config": text,
    }
