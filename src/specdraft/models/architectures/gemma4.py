"""The Gemma 4 text decoder (E2B, E4B, 26B-A4B, 31B), as a specdraft target.

Same interface as `models.architectures.decoder.Transformer` (forward -> final-normed hidden, logits, embed,
new_cache, cache_slot, attention_layout: models.architectures.target.TargetModel), so the engine and the MTP drafter run it unchanged.
What differs from Gemma 3, each one a config switch in `Gemma4Params`:

- sliding and full layers have their own head_dim (and, with attention_k_eq_v, KV heads);
  full layers rotate only part of each head ("proportional" RoPE);
- q, k and v are RMS-normalised (v without a scale), so the softmax scale is 1;
- attention_k_eq_v: full layers have no v_proj; V is the raw K projection;
- the last num_kv_shared_layers layers compute no K/V: they attend over the cache of the last
  earlier layer of their type, so the KV cache has fewer slots than layers;
- per-layer input embeddings (PLE): a token embedding per layer, mixed with a projection of
  the input embedding, gates a small residual branch at the end of every layer;
- 26B-A4B: a routed mixture of experts runs beside the dense MLP in every layer;
- norms scale by w (not 1 + w) and every layer ends by multiplying with `layer_scalar`.

Parameter names follow the Hugging Face checkpoints minus the leading "model.".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.config import FULL, SLIDING, ModelConfig
from specdraft.kv_cache import AttentionSpan, KVCache, kv_storage_dtype
from specdraft.models.architectures.gemma4_config import Gemma4Params, gemma4_params
from specdraft.models.architectures.gemma4_fused import FusedLayers, run_fused
from specdraft.models.architectures.layers import GatedMLP, RMSNorm, activation, attend
from specdraft.models.architectures.rope import RopeTable, apply_rope
from specdraft.models.architectures.target import AttentionLayout, CachedDecoder


class Gemma4RMSNorm(RMSNorm):
    """Scale by w in float32, then round (transformers' Gemma4RMSNorm order, so bf16 matches).
    pow(-0.5) rather than rsqrt, as the reference, so float32 results agree to the last bit."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__(dim, eps, offset=False, with_scale=with_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, p: Gemma4Params, layer: int):
        super().__init__()
        t = cfg.layer_types[layer]
        self.head_dim, self.num_heads, self.num_kv_heads = p.head_dim[t], cfg.num_heads, p.num_kv_heads[t]
        self.window = cfg.sliding_window if t == SLIDING else None
        self.shared = p.is_shared(layer)
        h, d, bias, eps = cfg.hidden_size, self.head_dim, cfg.qkv_bias, cfg.rms_norm_eps
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.q_norm = Gemma4RMSNorm(d, eps)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if not self.shared:  # KV-shared layers own no K/V weights
            self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
            k_eq_v = p.attention_k_eq_v and t == FULL
            self.v_proj = None if k_eq_v else nn.Linear(h, self.num_kv_heads * d, bias=bias)
            self.k_norm = Gemma4RMSNorm(d, eps)
            self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, slot: int,
                span: AttentionSpan) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        if not self.shared:
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            v = k if self.v_proj is None else self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
            cache.write(slot, k, self.v_norm(v).transpose(1, 2))
        keys = cache.k[slot][:, :, span.lo : span.hi]
        values = cache.v[slot][:, :, span.lo : span.hi]
        out = attend(q, keys, values, span.mask, 1.0)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Gemma4Router(nn.Module):
    """Top-k expert choice per token: softmax over experts in float32, renormalised over the
    chosen k, times a learned per-expert scale."""

    def __init__(self, hidden: int, experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.root = top_k, hidden**-0.5
        self.norm = Gemma4RMSNorm(hidden, eps, with_scale=False)
        self.proj = nn.Linear(hidden, experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] float32, expert ids [N, k])."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """E GeGLU experts stored as 3-D tensors (checkpoint layout: gate and up fused), or, once
    compacted, as one compact linear per expert and part (`compact_experts`)."""

    expert_parts = ("gate_up_proj", "down_proj")

    def __init__(self, hidden: int, intermediate: int, experts: int, act: str):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.act = activation(act)
        self.compact: dict[str, nn.ModuleList] = {}

    def compact_part(self, part: str, stack: torch.Tensor, make) -> None:
        """Replace the [E, N, K] parameter `part` by E modules `make(stack[e])` (`stack`: a tensor,
        or a list of what `make` takes, one per expert)."""
        modules = nn.ModuleList(make(stack[e]) for e in range(len(stack)))
        if any(m is None for m in modules):
            raise ValueError(f"no compact kernel takes the experts' {part} of shape {tuple(stack.shape[1:])}")
        delattr(self, part)
        self.add_module(f"{part}_compact", modules)
        self.compact[part] = modules

    def compact_experts(self, make) -> None:
        for part in self.expert_parts:
            if part not in self.compact:
                self.compact_part(part, getattr(self, part).detach(), make)

    def project(self, part: str, e: int, x: torch.Tensor) -> torch.Tensor:
        modules = self.compact.get(part)
        return F.linear(x, getattr(self, part)[e]) if modules is None else modules[e](x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H]; each token's output is the weighted sum of its k experts' outputs."""
        if x.device.type != "cpu" and not self.compact:
            return self._gathered(x, weights, ids)
        out = torch.zeros_like(x)
        # Loop over the experts actually hit (a decode step hits few), in ascending order so the
        # per-token sum is accumulated in the same order as the reference.
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            gate, up = self.project("gate_up_proj", e, x[tok]).chunk(2, dim=-1)
            y = self.project("down_proj", e, self.act(gate) * up) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """On an accelerator: every (token, expert) pair as one batched matmul over gathered expert
        weights, so the step never waits for the device to learn which experts were hit."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # [N*k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat], rows)[..., 0].chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat], (self.act(gate) * up)[:, :, None])[..., 0]
        return (y.view(n, k, -1) * weights[..., None].to(y.dtype)).sum(1).to(x.dtype)


class Gemma4Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, p: Gemma4Params, layer: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, p, layer)
        wide = 2 if p.use_double_wide_mlp and p.is_shared(layer) else 1
        self.mlp = GatedMLP(h, cfg.intermediate_size * wide, cfg.hidden_act)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        # A parameter, not a buffer: it is in the checkpoint and loads like the weights.
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = p.enable_moe_block
        if self.moe:
            self.router = Gemma4Router(h, p.num_experts, p.top_k_experts, eps)
            self.experts = Gemma4Experts(h, p.moe_intermediate_size, p.num_experts, cfg.hidden_act)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.ple = p.hidden_size_per_layer_input
        if self.ple:
            self.act = activation(cfg.hidden_act)
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP, plus (MoE layers) the routed experts, both reading the residual x."""
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.moe:
            return y
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)
        experts = self.experts(self.pre_feedforward_layernorm_2(flat), weights, ids).reshape(x.shape)
        return self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(experts)

    def forward(self, x, cos, sin, cache, slot, span, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, cache, slot, span))
        x = x + self.post_feedforward_layernorm(self.feed_forward(x))
        if self.ple:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4Transformer(CachedDecoder):
    """forward(tokens, cache) -> final-normed hidden states; logits(hidden) -> vocabulary scores."""

    sliding_rings = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.params = p = gemma4_params(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if p.hidden_size_per_layer_input:
            width = cfg.num_layers * p.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(p.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(p.hidden_size_per_layer_input, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4Layer(cfg, p, i) for i in range(cfg.num_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ropes = {t: RopeTable(r, p.head_dim[t], cfg.max_position_embeddings) for t, r in cfg.rope.items()}
        self.windows = {t: cfg.sliding_window if t == SLIDING else None for t in dict.fromkeys(cfg.layer_types)}
        self._fused = FusedLayers()  # short forwards' layers in one C call where they take it

    # --- what the engine and the drafters use (models.architectures.target.TargetModel) -------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings times sqrt(hidden), the scale rounded to the weight dtype (as the reference)."""
        e = self.embed_tokens(tokens)
        if e.dtype != self.dtype:  # an fp16-stored table: widen the rows first (exact)
            e = e.to(self.dtype)
        return e * torch.tensor(self.config.embed_scale, dtype=e.dtype)

    def new_cache(self, batch_size: int, capacity: int, max_forward: int | None = None,
                  reads_window: int | None = None) -> KVCache:
        """One slot per layer that computes K/V (KV-shared layers read their producer's slot);
        with `max_forward`, sliding slots keep a ring of their window (kv_cache.py)."""
        cfg, p = self.config, self.params
        w = self.embed_tokens.weight
        for table in self.ropes.values():
            table.ensure(capacity, w.device)
        types = cfg.layer_types[: p.first_shared_layer]
        shapes = [(p.num_kv_heads[t], p.head_dim[t]) for t in types]
        return KVCache(shapes, batch_size, capacity, self.kv_dtype(), w.device, [self.windows[t] for t in types],
                       max_forward, reads_window)

    def kv_dtype(self, compute: torch.dtype | None = None) -> torch.dtype:
        """What the cache stores K/V in (kv_cache.kv_storage_dtype): float16 on the CPU by default.
        Every element is bounded: v_norm leaves |v_i| <= sqrt(D) (an RMS-normed vector of D
        elements), k_norm |k_i| <= sqrt(D) max|w|, and RoPE rotates pairs, which keeps a pair's
        length, so |k_i| <= sqrt(D) max|w| after it too."""
        w = self.embed_tokens.weight
        device = "cpu" if w.is_meta else w.device.type  # the memory estimate's model (meta) sizes a CPU run
        return kv_storage_dtype(compute or self.dtype, device, self.largest_kv())

    def largest_kv(self) -> float | None:
        """A bound on any K/V element this model writes (see kv_dtype); weights not loaded yet
        (the meta device) count as 1."""
        bound = 0.0
        for layer in self.layers[: self.params.first_shared_layer]:
            attn = layer.self_attn
            w = attn.k_norm.weight
            top = 1.0 if w is None or w.is_meta else float(w.detach().abs().max())
            bound = max(bound, attn.head_dim**0.5 * max(top, 1.0))
        return bound

    def cache_slot(self, layer: int) -> int:
        """Producers are layers 0..first_shared-1, stored in slots of the same index."""
        return self.params.kv_producer[layer]

    def kv_layers(self) -> list[int]:
        return list(range(self.params.first_shared_layer))

    def attention_layout(self, layer: int) -> AttentionLayout:
        cfg, p = self.config, self.params
        t = cfg.layer_types[layer]
        return AttentionLayout(
            layer=layer, slot=self.cache_slot(layer), layer_type=t, num_kv_heads=p.num_kv_heads[t],
            head_dim=p.head_dim[t], scale=1.0, window=cfg.sliding_window if t == SLIDING else None,
            rope=self.ropes[t], q_norm=True,
        )

    def unused_checkpoint_tensors(self, names: list[str]) -> list[str]:
        """Checkpoint tensors this model does not use: K/V weights that some exports keep for
        KV-shared layers (transformers ignores them the same way)."""
        first = self.params.first_shared_layer
        parts = ("k_proj", "v_proj", "k_norm", "v_norm")
        out = []
        for name in names:
            bits = name.split(".")
            if (len(bits) > 3 and bits[0] == "layers" and bits[1].isdigit() and int(bits[1]) >= first
                    and bits[2] == "self_attn" and bits[3] in parts):
                out.append(name)
        return out

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """PLE: (norm(proj(x) / sqrt(H)) + E_layer[token] * sqrt(P)) / sqrt(2), as [B, T, L, P]."""
        cfg, width = self.config, self.params.hidden_size_per_layer_input
        shape = (*tokens.shape, cfg.num_layers, width)
        e = self.embed_tokens_per_layer(tokens)
        if e.dtype != x.dtype:  # a table kept as the checkpoint stores it: widen the rows first (exact)
            e = e.to(x.dtype)
        token_part = (e * torch.tensor(width**0.5, dtype=e.dtype)).reshape(shape)
        context = self.per_layer_model_projection(x) * cfg.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + token_part) * 2.0**-0.5

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, kv, spans: dict[str, AttentionSpan]) -> torch.Tensor:
        cfg = self.config
        if self.params.placeholder_token_ids:
            placeholders = torch.tensor(self.params.placeholder_token_ids, device=tokens.device)
            tokens = torch.where(torch.isin(tokens, placeholders), self.config.pad_token_id, tokens)
        x = self.embed(tokens)
        ple = self.per_layer_inputs(tokens, x) if self.params.hidden_size_per_layer_input else None
        rope = {t: self.ropes[t].lookup(positions, x.dtype) for t in self.windows}
        fused = self._fused.weights(self, x, kv)
        if fused is not None:  # every layer in one C call (kernels/gemma4_layer.c)
            return self.norm(run_fused(self, fused, x, ple, rope, kv, spans))
        for i, layer in enumerate(self.layers):
            t = cfg.layer_types[i]
            cos, sin = rope[t]
            x = layer(x, cos, sin, kv, self.cache_slot(i), spans[t], None if ple is None else ple[:, :, i])
        return self.norm(x)
