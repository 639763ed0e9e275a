"""The decoder-only transformer for Gemma 3 and the Llama family (Llama 3, Qwen2/2.5/3, SmolLM2).

One implementation; the differences are config switches (see `ModelConfig`):
Gemma uses (1 + w) norms, sandwich norms around attention and MLP, q/k norms, scaled
embeddings, query_pre_attn_scalar and GeGLU; Llama uses plain pre-norms and SwiGLU; Qwen2
adds q/k/v biases; Qwen3 adds q/k norms. Parameter names follow the Hugging Face checkpoints
(minus the leading "model."), so weights load without renaming.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from specdraft.config import SLIDING, ModelConfig
from specdraft.kv_cache import SHORT_FORWARD, AttentionSpan, KVCache
from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.build import enabled as kernels_enabled
from specdraft.models.kernels.decoder_layer import (LayerStep, LayerWeights, Snapshot, decoder_layer, decoder_stack,
                                                    fusable, layer_step, linear_weights, parts_key, pointer,
                                                    reads_cache)
from specdraft.models.kernels.gated_act import KINDS as NATIVE_ACTIVATIONS
from specdraft.models.kernels.qk_rope import MAX_HEAD_DIM, qk_rope_write
from specdraft.models.kernels.rms_norm import residual_norms
from specdraft.models.formats.q8_act_linear import Q8ActLinear
from specdraft.models.architectures.layers import GatedMLP, RMSNorm, attend, stack_linears
from specdraft.models.architectures.rope import RopeTable, apply_rope
from specdraft.models.architectures.target import AttentionLayout, CachedDecoder


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer_type = layer_type
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        self.scale = cfg.softmax_scale
        self.softcap = cfg.attn_softcap
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, offset=cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections: q, k, v in one matmul

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one linear over their stacked weights. A packed
        kernel call has a fixed cost (~40 us here) on top of reading its weights; a decode step
        makes 18 x 3 of these calls for Gemma 3 270M."""
        parts = (self.q_proj, self.k_proj, self.v_proj) if self.qkv_proj is None else ()
        if not parts or not all(type(p) is nn.Linear for p in parts):  # fused, or compacted while loading
            return
        self.qkv_proj = stack_linears(parts)
        self.qkv_split = [p.out_features for p in parts]
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, T, H*D], k and v [B, T, Hkv*D]."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.qkv_proj(x).split(self.qkv_split, dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, slot: int, span: AttentionSpan
    ) -> torch.Tensor:
        b, t, _ = x.shape
        if self._native(x, cache, slot):
            return self._forward_native(x, cos, sin, cache, slot, span)
        q, k, v = self.project(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(slot, k, v)
        keys = cache.k[slot][:, :, span.lo : span.hi]
        values = cache.v[slot][:, :, span.lo : span.hi]
        out = attend(q, keys, values, span.mask, self.scale, self.softcap)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _native(self, x: torch.Tensor, cache: KVCache, slot: int) -> bool:
        """Whether this forward takes the C kernels: a short float32 CPU forward (decode, verify,
        drafting) over a KVCache laid out as they read it."""
        if x.shape[1] > SHORT_FORWARD or not isinstance(cache, KVCache) or not kernels_apply(x):
            return False
        k = cache.k[slot]
        norms_ok = self.q_norm is None or (self.q_norm.weight is not None and self.q_norm.native_ready()
                                          and self.k_norm.weight is not None and self.k_norm.native_ready())
        return (k.dtype == torch.float32 and k.stride(-1) == 1 and k.stride(-2) == self.head_dim
                and self.head_dim <= MAX_HEAD_DIM and norms_ok)

    def _forward_native(self, x, cos, sin, cache: KVCache, slot: int, span: AttentionSpan) -> torch.Tensor:
        """forward() in three C calls around the two projections: q/k norms, RoPE and the cache
        write (qk_rope.c); attention (attention.c)."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x) if self.qkv_proj is not None else torch.cat(self.project(x), dim=-1)
        q_scale = k_scale = None
        if self.q_norm is not None:
            q_scale, k_scale = self.q_norm.native_scale(), self.k_norm.native_scale()
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        q = qk_rope_write(qkv, self.num_heads, self.num_kv_heads, self.head_dim, q_scale, k_scale, eps, cos, sin,
                          cache.positions, cache.k[slot], cache.v[slot])
        keys = cache.k[slot][:, :, span.lo : span.hi]
        values = cache.v[slot][:, :, span.lo : span.hi]
        out = attend(q.transpose(1, 2), keys, values, span.mask, self.scale, self.softcap)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.self_attn = Attention(cfg, layer_type)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self._fused = None  # (key, LayerWeights or None, what it points into): see _fused_weights

    def forward(self, x, cos, sin, cache, slot, span):
        weights = self._fused_weights(x, cache, slot)
        if weights is not None:  # the whole layer in one C call (kernels/decoder_layer.c)
            return decoder_layer(weights, x, cos, sin, cache.positions, cache.k[slot], cache.v[slot], span.lo,
                                 span.hi, span.mask)
        if self._native(x):  # the two norms between attention and MLP in one C call
            a = self.self_attn(self.input_layernorm(x), cos, sin, cache, slot, span)
            first = self.post_attention_layernorm if self.sandwich else None
            second = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
            x, h = residual_norms(a, first is not None, None if first is None else first.native_scale(), x,
                                  second.native_scale(), second.eps)
            m = self.mlp(h)
            return self.post_feedforward_layernorm(m, x) if self.sandwich else x + m
        if self.sandwich:
            x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache, slot, span), x)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)), x)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slot, span)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _norms(self) -> list[RMSNorm]:
        extra = [self.pre_feedforward_layernorm, self.post_feedforward_layernorm] if self.sandwich else []
        return [self.input_layernorm, self.post_attention_layernorm] + extra

    def _fused_weights(self, x: torch.Tensor, cache, slot: int) -> LayerWeights | None:
        """The layer's weights for decoder_layer.c when this forward can take it: a short float32
        CPU forward over a KVCache, every projection fp16 tiles or GGUF blocks. Built once and kept
        until a projection is replaced or a norm's weight changes (a decode step makes 18 calls)."""
        if x.shape[1] > SHORT_FORWARD or not isinstance(cache, KVCache) or not kernels_apply(x):
            return None
        attn = self.self_attn
        linears, qk_norms = self._projections(), self._qk_norms()
        key, tiles = parts_key(linears, self._norms() + qk_norms)
        if self._fused is None or self._fused[0] != key:
            self._fused = (key, self._layer_weights() if self._fusable() else None, linears, tiles, qk_norms)
        weights = self._fused[1]
        return weights if weights is not None and reads_cache(cache.k[slot], cache.v[slot], attn.head_dim) else None

    def _fusable(self) -> bool:
        """Whether decoder_layer.c computes this layer (see kernels.decoder_layer.fusable)."""
        return fusable(self._projections(), self._norms(), self.mlp.act_name, self._qk_norms(), self.self_attn.head_dim)

    def _projections(self) -> tuple:
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def _qk_norms(self) -> list[RMSNorm]:
        attn = self.self_attn
        return [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []

    def _layer_weights(self) -> LayerWeights:
        attn, mlp, sandwich = self.self_attn, self.mlp, self.sandwich
        q_norm = attn.q_norm
        pre_mlp = self.pre_feedforward_layernorm if sandwich else self.post_attention_layernorm
        return LayerWeights(
            hidden=attn.o_proj.out_features, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, inter=mlp.down_proj.in_features, qkv_kv_heads=attn.num_kv_heads,
            sandwich=int(sandwich), act=NATIVE_ACTIVATIONS[mlp.act_name], eps=self.input_layernorm.eps,
            qk_eps=q_norm.eps if q_norm is not None else 0.0, scale=attn.scale, softcap=attn.softcap or 0.0,
            layer_scalar=1.0,
            norm_in=pointer(self.input_layernorm.native_scale()),
            norm_post_attn=pointer(self.post_attention_layernorm.native_scale()) if sandwich else None,
            norm_pre_mlp=pointer(pre_mlp.native_scale()),
            norm_post_mlp=pointer(self.post_feedforward_layernorm.native_scale()) if sandwich else None,
            q_norm=pointer(q_norm.native_scale()) if q_norm is not None else None,
            k_norm=pointer(attn.k_norm.native_scale()) if q_norm is not None else None,
            qkv=linear_weights(attn.qkv_proj), o=linear_weights(attn.o_proj),
            gate_up=linear_weights(mlp.gate_up_proj), down=linear_weights(mlp.down_proj))

    def _native(self, x: torch.Tensor) -> bool:
        norms = [self.post_attention_layernorm] + ([self.pre_feedforward_layernorm] if self.sandwich else [])
        return (x.shape[1] <= SHORT_FORWARD and kernels_apply(x) and all(n.native_ready() for n in norms)
                and (not self.sandwich or self.post_attention_layernorm.eps == self.pre_feedforward_layernorm.eps))


class Transformer(CachedDecoder):
    """forward(tokens, cache) -> final-normed hidden states; logits(hidden) -> vocabulary scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ropes = {t: RopeTable(p, cfg.head_dim, cfg.max_position_embeddings) for t, p in cfg.rope.items()}
        self.windows = {t: cfg.sliding_window if t == SLIDING else None for t in self.ropes}
        self._stack = None  # (Snapshot of the layers, their LayerWeights or None): see _layer_stack

    # --- what the engine and the drafters use (models.architectures.target.TargetModel) -------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings with the model's own scaling (Gemma: sqrt(hidden), rounded to the weight dtype)."""
        e = self.embed_tokens(tokens)
        if e.dtype != self.dtype:  # an fp16-stored table: widen the rows first (exact)
            e = e.to(self.dtype)
        if self.config.embed_scale != 1.0:
            e = e * torch.tensor(self.config.embed_scale, dtype=e.dtype)
        return e

    def new_cache(self, batch_size: int, capacity: int, max_forward: int | None = None,
                  reads_window: int | None = None) -> KVCache:
        """Every layer keeps the whole context (no rings): the fused C layers index keys by position."""
        cfg = self.config
        p = self.embed_tokens.weight
        for table in self.ropes.values():
            table.ensure(capacity, p.device)
        shapes = [(cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers
        return KVCache(shapes, batch_size, capacity, self.dtype, p.device)

    def cache_slot(self, layer: int) -> int:
        """Which cache slot holds layer `layer`'s K/V (identity here; Gemma 4 shares slots)."""
        return layer

    def kv_layers(self) -> list[int]:
        return list(range(self.config.num_layers))

    def attention_layout(self, layer: int) -> AttentionLayout:
        cfg = self.config
        t = cfg.layer_types[layer]
        return AttentionLayout(
            layer=layer, slot=self.cache_slot(layer), layer_type=t, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, scale=cfg.softmax_scale, window=cfg.sliding_window if t == SLIDING else None,
            rope=self.ropes[t], q_norm=cfg.qk_norm,
        )

    def fuse_projections(self) -> None:
        """q/k/v and gate/up as one linear each (before packing weights: fewer kernel calls)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def prefill_rows_alone(self, cache: KVCache) -> bool:
        """True where every piece of a forward computes each position alone, in the same order
        whatever the forward's width or first position: int8-activation linears (their kernel
        sums each (output, row) pair in one fixed order at every width, q8_act_linear.py), the
        norm and activation kernels (one row at a time), and the attention kernel over a float32
        cache (fixed key chunks from position 0, kv_cache.attention_span). Other formats take a
        GEMM or another dtype for wide chunks, and a float16 cache takes the prompt kernel's
        online softmax: there a chunk's width changes the bits. A compiled step is its own
        arithmetic."""
        if (self.dtype != torch.float32 or self.embed_tokens.weight.device.type != "cpu" or not kernels_enabled()
                or self.compiled_step is not None or self.config.hidden_act not in NATIVE_ACTIVATIONS):
            return False
        if not all(k.dtype == torch.float32 and v.dtype == torch.float32 for k, v in zip(cache.k, cache.v)):
            return False
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        linears = [m for m in self.layers.modules() if hasattr(m, "in_features")]
        return all(n.native_ready() for n in norms) and all(isinstance(m, Q8ActLinear) for m in linears)

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, kv, spans: dict[str, AttentionSpan]) -> torch.Tensor:
        x = self.embed(tokens)
        rope = {t: table.lookup(positions, x.dtype) for t, table in self.ropes.items()}
        stack = self._layer_stack(x, kv)
        if stack is not None:  # every layer in one C call (kernels/decoder_layer.c)
            keep = []  # what the steps point into, alive until the call returns
            steps = self._stack_steps(x, rope, kv, spans, keep)
            return self.norm(decoder_stack(stack, steps, x))
        for i, layer in enumerate(self.layers):
            t = self.config.layer_types[i]
            cos, sin = rope[t]
            x = layer(x, cos, sin, kv, i, spans[t])
        return self.norm(x)

    def _layer_stack(self, x: torch.Tensor, kv) -> ctypes.Array | None:
        """Every layer's LayerWeights when each layer would take decoder_layer.c on this forward
        (see DecoderLayer._fused_weights), built once and kept while a Snapshot of the layers
        shows nothing replaced or written: checking it costs ~0.1 ms a step, the layers' own
        keys ~1 ms."""
        if x.shape[1] > SHORT_FORWARD or not isinstance(kv, KVCache) or not kernels_apply(x):
            return None
        if self._stack is None or not self._stack[0].unchanged():
            layers = list(self.layers)
            fused = None
            if all(layer._fusable() for layer in layers):
                fused = (LayerWeights * len(layers))(*[layer._layer_weights() for layer in layers])
            # the norms' scales the weights point into: offset norms keep theirs until the weight changes
            scales = [n.native_scale() for layer in layers for n in layer._norms() + layer._qk_norms()]
            self._stack = (Snapshot(self.layers), fused, scales)
        fused = self._stack[1]
        d = self.config.head_dim
        if fused is None or not all(reads_cache(kv.k[i], kv.v[i], d) for i in range(len(self.layers))):
            return None
        return fused

    def _stack_steps(self, x: torch.Tensor, rope: dict, kv: KVCache, spans: dict[str, AttentionSpan],
                     keep: list) -> ctypes.Array:
        """Each layer's LayerStep: its type's rope rows, span and mask, its own cache slot."""
        b, t, _ = x.shape
        d = self.config.head_dim
        by_type = {}
        for kind, (cos, sin) in rope.items():
            span = spans[kind]
            by_type[kind] = layer_step(b, t, d, cos, sin, kv.positions, kv.k[0], kv.v[0], span.lo, span.hi,
                                       span.mask, keep)
        steps = (LayerStep * len(self.layers))()
        for i, kind in enumerate(self.config.layer_types):
            steps[i] = by_type[kind]
            k, v = kv.k[i], kv.v[i]
            steps[i].k_cache, steps[i].v_cache = k.data_ptr(), v.data_ptr()
            steps[i].cache_sb, steps[i].cache_sh = k.stride(0), k.stride(1)
        return steps
