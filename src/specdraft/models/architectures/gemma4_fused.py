"""Gemma 4's short forwards (decode, verify) as one C call for all layers (kernels/gemma4_layer.c).

Eager, a 35-layer E2B step makes some 2,000 Python-level calls (norms of six ops each, per-head
RoPE, a kernel call per projection), a fifth of its time over the memory floor. Where every layer
is made of parts the C kernels read (packed projections, float32 norm scales, a GeGLU/SwiGLU MLP,
no routed experts) and the cache is float32 or float16, the layers run in one call; the embeddings, the PLE
inputs and the final norm stay in PyTorch (a handful of ops a step). Prompts (wider forwards) stay
eager.
"""

from __future__ import annotations

import ctypes

import torch

from specdraft.kv_cache import SHORT_FORWARD, AttentionSpan, KVCache
from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.decoder_layer import (Linear, LayerStep, Snapshot, kernel_linear, layer_step,
                                                    linear_weights, pointer, reads_cache)
from specdraft.models.kernels.gated_act import KINDS as NATIVE_ACTIVATIONS
from specdraft.models.kernels.gemma4_layer import Gemma4Weights, gemma4_stack
from specdraft.models.kernels.qk_rope import MAX_HEAD_DIM


def _projections(layer) -> list:
    attn, mlp = layer.self_attn, layer.mlp
    own_kv = [] if attn.shared else [attn.k_proj] + ([] if attn.v_proj is None else [attn.v_proj])
    ple = [layer.per_layer_input_gate, layer.per_layer_projection] if layer.ple else []
    return [attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj] + own_kv + ple


def _norms(layer) -> list:
    attn = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm, attn.q_norm]
    if not attn.shared:
        norms += [attn.k_norm, attn.v_norm]
    return norms + ([layer.post_per_layer_input_norm] if layer.ple else [])


def layer_fusable(layer) -> bool:
    """Whether gemma4_layer.c computes this layer: no routed experts, gate and up apart (as loaded),
    every projection one the kernels read, float32 norm scales (V's: none) under one eps."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.moe or mlp.gate_up_proj is not None or mlp.act_name not in NATIVE_ACTIVATIONS:
        return False
    if attn.head_dim > MAX_HEAD_DIM or attn.head_dim % 2:
        return False
    norms = _norms(layer)
    scaled = [n for n in norms if n is not getattr(attn, "v_norm", None)]
    return (all(kernel_linear(m) for m in _projections(layer)) and all(n.native_ready() for n in norms)
            and all(n.weight is not None for n in scaled) and len({n.eps for n in norms}) == 1)


def _absent() -> Linear:
    return Linear()


def layer_weights(layer) -> Gemma4Weights:
    attn, mlp, ple = layer.self_attn, layer.mlp, layer.ple
    own_kv = not attn.shared
    return Gemma4Weights(
        hidden=attn.o_proj.out_features, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        inter=mlp.down_proj.in_features, ple=ple, act=NATIVE_ACTIVATIONS[mlp.act_name],
        eps=layer.input_layernorm.eps, layer_scalar=float(layer.layer_scalar.detach().float()),
        norm_in=pointer(layer.input_layernorm.native_scale()),
        norm_post_attn=pointer(layer.post_attention_layernorm.native_scale()),
        norm_pre_mlp=pointer(layer.pre_feedforward_layernorm.native_scale()),
        norm_post_mlp=pointer(layer.post_feedforward_layernorm.native_scale()),
        norm_ple=pointer(layer.post_per_layer_input_norm.native_scale()) if ple else None,
        q_norm=pointer(attn.q_norm.native_scale()), k_norm=pointer(attn.k_norm.native_scale()) if own_kv else None,
        q=linear_weights(attn.q_proj), k=linear_weights(attn.k_proj) if own_kv else _absent(),
        v=linear_weights(attn.v_proj) if own_kv and attn.v_proj is not None else _absent(),
        o=linear_weights(attn.o_proj), gate=linear_weights(mlp.gate_proj), up=linear_weights(mlp.up_proj),
        down=linear_weights(mlp.down_proj),
        ple_gate=linear_weights(layer.per_layer_input_gate) if ple else _absent(),
        ple_proj=linear_weights(layer.per_layer_projection) if ple else _absent())


class FusedLayers:
    """Every layer's Gemma4Weights, built once and kept while a Snapshot of the layers shows nothing
    replaced or written (~1 ms a step at E2B's 35 layers, their objects cold after a step's weights)."""

    def __init__(self) -> None:
        self._built = None  # (Snapshot, weights array or None, [(cache slot, head dim)] per layer)
        self._cache_checked = (None, False)  # (the K list of the cache last checked, whether the kernel reads it)

    def weights(self, model, x: torch.Tensor, kv) -> ctypes.Array | None:
        """The layers' weights when this forward takes gemma4_layer.c, else None."""
        if x.shape[1] > SHORT_FORWARD or not isinstance(kv, KVCache) or not kernels_apply(x):
            return None
        if self._built is None or not self._built[0].unchanged():
            layers = list(model.layers)
            fused = None
            if all(layer_fusable(layer) for layer in layers):
                fused = (Gemma4Weights * len(layers))(*[layer_weights(layer) for layer in layers])
            slots = [(model.cache_slot(i), layer.self_attn.head_dim) for i, layer in enumerate(layers)]
            self._built = (Snapshot(model.layers), fused, slots)
            self._cache_checked = (None, False)
        fused = self._built[1]
        if fused is None or not self._reads(kv):
            return None
        return fused

    def _reads(self, kv: KVCache) -> bool:
        """Whether the kernel reads every layer's cache slot. A cache's K and V lists are made
        with it and never reassigned, so the verdict is kept per list instead of asked of every slot
        each step; holding the list keeps another cache's list from ever being it."""
        checked, verdict = self._cache_checked
        if checked is not kv.k:
            verdict = all(reads_cache(kv.k[slot], kv.v[slot], d, takes_half=True) for slot, d in self._built[2])
            self._cache_checked = (kv.k, verdict)
        return verdict


def stack_steps(model, x: torch.Tensor, rope: dict, kv: KVCache, spans: dict[str, AttentionSpan],
                keep: list) -> ctypes.Array:
    """Each layer's LayerStep: its type's rope rows, span and mask; its cache slot (the producer's for
    KV-shared layers) and the slots it writes (positions mod the ring for ring slots)."""
    b, t, _ = x.shape
    cfg = model.config
    by_type, writes = {}, {}
    for kind, (cos, sin) in rope.items():
        span = spans[kind]
        d = model.params.head_dim[kind]
        by_type[kind] = layer_step(b, t, d, cos, sin, None, kv.k[0], kv.v[0], span.lo, span.hi, span.mask, keep)
    steps = (LayerStep * len(model.layers))()
    for i, kind in enumerate(cfg.layer_types):
        slot = model.cache_slot(i)
        ring = kv.rings[slot]
        if ring not in writes:
            writes[ring] = (kv.positions if ring is None else kv.positions % ring).contiguous()
            keep.append(writes[ring])
        steps[i] = by_type[kind]
        k, v = kv.k[slot], kv.v[slot]
        steps[i].positions = writes[ring].data_ptr()
        steps[i].k_cache, steps[i].v_cache = k.data_ptr(), v.data_ptr()
        steps[i].cache_sb, steps[i].cache_sh = k.stride(0), k.stride(1)
        steps[i].kv_half = int(k.dtype == torch.float16)
    return steps


def run_fused(model, weights: ctypes.Array, x: torch.Tensor, ple: torch.Tensor | None, rope: dict, kv: KVCache,
              spans: dict[str, AttentionSpan]) -> torch.Tensor:
    """x [B, T, hidden] through every layer in one C call (the last norm not applied)."""
    keep: list = []  # what the steps point into, alive until the call returns
    steps = stack_steps(model, x, rope, kv, spans, keep)
    return gemma4_stack(weights, steps, x, None if ple is None else ple.float().contiguous())
