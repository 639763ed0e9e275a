"""The MTP drafter network (Gemma 4 assistant architecture), one draft step at a time.

    x     = pre_projection([E_target(token) * target_scale, state])        Linear(2H -> h)
    x     = L decoder blocks with QUERY-ONLY attention over target K/V
    z     = norm(x)
    state = post_projection(z)                                             Linear(h -> H)
    logits from z against the drafter's own table (head "own"), or from the new state
    against the target's table (head "target"); with a copy gate (copy.py), plus a learned
    bonus on the tokens that followed the current token earlier in the text.

Each block reads keys/values the target already computed (the last target layer of the block's
attention type); it has no K/V projections and no cache. Queries use one constant position per
round, so several queries per row (training: one per anchor) work the same way as one.
Parameter names follow the Gemma 4 assistant checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdraft.drafters.mtp.config import MTPConfig
from specdraft.drafters.mtp.copy import CopyGate
from specdraft.drafters.mtp.head import ClusteredHead
from specdraft.kv_cache import SHORT_FORWARD
from specdraft.models.kernels import build as kernels
from specdraft.models.kernels.build import applies as kernels_apply
from specdraft.models.kernels.decoder_layer import (Linear, LayerStep, LayerWeights, Snapshot, decoder_layer,
                                                    decoder_stack, fusable, kernel_linear, layer_step, linear_weights,
                                                    parts_key, pointer, reads_cache)
from specdraft.models.kernels.draft_step import DraftNet, draft_step
from specdraft.models.kernels.fp16_gemv import takes as fp16_tiles_take
from specdraft.models.kernels.gated_act import KINDS
from specdraft.models.architectures.layers import GatedMLP, RMSNorm, attend
from specdraft.models.formats.gguf_table import GGUFEmbedding
from specdraft.models.formats.q8_act_linear import ACT_GROUP, Q8ActLinear, int8_blocks
from specdraft.models.formats.quant import Fp16Linear
from specdraft.models.architectures.rope import apply_rope


@dataclass
class LayerContext:
    """What one drafter layer attends over, fixed for a whole round."""

    keys: torch.Tensor  # [B, Hkv, S, D]
    values: torch.Tensor
    mask: torch.Tensor  # [B, 1, T, S] bool
    cos: torch.Tensor  # [B, 1, T, D] at the query positions
    sin: torch.Tensor
    scale: float


@dataclass
class DraftStep:
    """One inference draft step's outputs for B rows."""

    z: torch.Tensor  # [B, h]
    state: torch.Tensor  # [B, H], the next step's state
    centroid_scores: torch.Tensor | None = None  # [B, C] when computed with the step (else the head's to do)
    copy_bonus: torch.Tensor | None = None  # [B, 2] likewise, for a drafter with a copy gate


class QueryOnlyAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, eps: float, q_norm: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if q_norm else None
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, ctx.cos, ctx.sin)
        out = attend(q, ctx.keys, ctx.values, ctx.mask, ctx.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DrafterBlock(nn.Module):
    """Gemma 4 block: sandwich RMSNorms, GeGLU MLP, a per-layer output scalar."""

    def __init__(self, cfg: MTPConfig, layer_type: str):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = QueryOnlyAttention(h, cfg.num_heads, cfg.head_dim[layer_type], eps, cfg.q_norm)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self._fused = None  # (key, LayerWeights or None, what it points into): see _fused_weights

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        weights = self._fused_weights(x, ctx)
        if weights is not None:  # the whole block in one C call (models/kernels/decoder_layer.c)
            return decoder_layer(weights, x, ctx.cos, ctx.sin, None, ctx.keys, ctx.values, 0, ctx.keys.shape[2],
                                 ctx.mask)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar

    def _norms(self) -> list[RMSNorm]:
        return [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm]

    def _fused_weights(self, x: torch.Tensor, ctx: LayerContext) -> LayerWeights | None:
        """The block's weights for decoder_layer.c (query-only attention, nothing written) when this
        step can take it: inference in float32 on the CPU, the kernels' weights (kernels_like_target). Kept
        until a projection, a norm's weight, the scalar or the context's shape changes."""
        if x.shape[1] > SHORT_FORWARD or not kernels_apply(x):
            return None
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.q_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qk_norms = [attn.q_norm] if attn.q_norm is not None else []
        key, tiles = parts_key(linears, self._norms() + qk_norms, self.layer_scalar._version, ctx.scale,
                               ctx.keys.shape[1])
        if self._fused is None or self._fused[0] != key:
            ok = fusable(linears, self._norms(), mlp.act_name, qk_norms, attn.head_dim)
            self._fused = (key, self._layer_weights(ctx) if ok else None, linears, tiles, qk_norms)
        weights = self._fused[1]
        fits = weights is not None and reads_cache(ctx.keys, ctx.values, attn.head_dim, takes_half=True)
        return weights if fits else None

    def _layer_weights(self, ctx: LayerContext) -> LayerWeights:
        attn, mlp = self.self_attn, self.mlp
        q_norm = attn.q_norm
        return LayerWeights(
            hidden=attn.o_proj.out_features, heads=attn.heads, kv_heads=ctx.keys.shape[1], head_dim=attn.head_dim,
            inter=mlp.down_proj.in_features, qkv_kv_heads=0, sandwich=1, act=KINDS[mlp.act_name],
            eps=self.input_layernorm.eps, qk_eps=q_norm.eps if q_norm is not None else 0.0, scale=ctx.scale,
            softcap=0.0, layer_scalar=float(self.layer_scalar),
            norm_in=pointer(self.input_layernorm.native_scale()),
            norm_post_attn=pointer(self.post_attention_layernorm.native_scale()),
            norm_pre_mlp=pointer(self.pre_feedforward_layernorm.native_scale()),
            norm_post_mlp=pointer(self.post_feedforward_layernorm.native_scale()),
            q_norm=pointer(q_norm.native_scale()) if q_norm is not None else None, k_norm=None,
            qkv=linear_weights(attn.q_proj), o=linear_weights(attn.o_proj),
            gate_up=linear_weights(mlp.gate_up_proj), down=linear_weights(mlp.down_proj))


class DrafterBody(nn.Module):
    """Named `model` in checkpoints: the tied table (head "own"), the blocks, the final norm."""

    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if cfg.head == "own" else None
        self.layers = nn.ModuleList(DrafterBlock(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPNetwork(nn.Module):
    def __init__(self, cfg: MTPConfig):
        super().__init__()
        self.config = cfg
        self.model = DrafterBody(cfg)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.masked_embedding = (
            ClusteredHead(cfg.hidden_size, cfg.vocab_size, cfg.num_centroids, cfg.top_k_clusters,
                          cfg.sampling_top_k_clusters)
            if cfg.clustered else None
        )
        self.copy_gate = CopyGate(cfg.hidden_size) if cfg.copy_gate else None
        # A dense head "own" kept as a kernel linear over its table's blocks (a GGUF assistant's
        # token_embd: drafters/mtp/gguf.py), in place of model.embed_tokens; None: scored from the table.
        self.packed_head: nn.Module | None = None
        self._stack = None  # a drafting round's blocks for decoder_layer.c: see _round_stack
        self._weights = None  # (Snapshot of the network, contexts' key, the blocks' LayerWeights or None)
        self._net = None  # (key, DraftNet or None, what it points into): see _draft_net
        self._net_kept = None  # (Snapshot of the network, the target's key) _net was last checked against
        self._net_round = None  # (the round's contexts, the DraftNet checked for it)

    def step(self, token_embeds: torch.Tensor, state: torch.Tensor, contexts: list[LayerContext]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for queries [B, T]: (z [B, T, h], next state [B, T, H])."""
        x = self.pre_projection(torch.cat([token_embeds, state], dim=-1))
        stack = self._round_stack(x, contexts)
        if stack is not None:  # every block in one C call (decoder_layer.c), the same bits as one by one
            x = decoder_stack(stack[1], stack[2], x)
        else:
            for layer, ctx in zip(self.model.layers, contexts):
                x = layer(x, ctx)
        z = self.model.norm(x)
        return z, self.post_projection(z)

    def draft_step(self, target: nn.Module, tokens: torch.Tensor, state: torch.Tensor,
                   contexts: list[LayerContext]) -> DraftStep:
        """An inference draft step for the current tokens [B] and states [B, H]: `step` on the
        target's embeddings, in one C call with the head's centroid scores and copy bonus where
        the kernels take every part (draft_step.c: the same bits, ~0.4 ms a step less)."""
        if not kernels_apply(state):
            net = None
        else:  # its parts checked once a round (~30 us a check)
            if self._net_round is None or self._net_round[0] is not contexts:
                self._net_round = (contexts, self._draft_net(target, state))
            net = self._net_round[1]
        stack = None if net is None else self._round_stack(state[:, None], contexts)
        if stack is None:
            z, state = self.step(target.embed(tokens[:, None]), state[:, None], contexts)
            return DraftStep(z[:, 0], state[:, 0])
        embeds = None if net.table else target.embed(tokens)  # a GGUF table: its rows from its own lookup
        return DraftStep(*draft_step(net, stack[1], stack[2], tokens, state, embeds))

    def _draft_net(self, target: nn.Module, state: torch.Tensor) -> DraftNet | None:
        """The network's parts outside its blocks for draft_step.c, where the kernels take them all:
        float32 inference on the CPU, kernel linears, a plain token table of fp16 or float32 rows
        (the target's embed(): a row, widened, times embed_scale), or a table kept in a GGUF file's
        blocks (no table pointer: the step is handed the rows the target's embed() gives, so the
        blocks are dequantised by their own decoder alone). Kept until a part changes."""
        embedding = getattr(target, "embed_tokens", None)
        in_blocks = type(embedding) is GGUFEmbedding
        if not kernels_apply(state) or not (in_blocks or type(embedding) is nn.Embedding) \
                or target.dtype != torch.float32:
            return None
        table = None if in_blocks else embedding.weight
        # Every round asks; the parts' keys below cost ~0.07 ms a round, one Snapshot check of the
        # whole network (and the target's table) a fraction of that.
        seen = (id(target), id(embedding), None if table is None else (table.data_ptr(), table.dtype))
        kept = self._net_kept
        if self._net is not None and kept is not None and kept[1] == seen and kept[0].unchanged():
            return self._net[1]
        head, gate = self.masked_embedding, self.copy_gate
        linears = [self.pre_projection, self.post_projection] + ([head.centroids] if head is not None else []) \
            + ([gate.proj] if gate is not None else [])
        norm = self.model.norm
        where = (id(embedding),) if table is None else (table.data_ptr(), table.dtype)
        key, tiles = parts_key(linears, [norm], id(target), *where)
        if self._net is None or self._net[0] != key:
            plain = table is None or (table.is_contiguous() and table.dtype in (torch.float16, torch.float32))
            ok = all(kernel_linear(m) for m in linears) and norm.native_ready() and plain
            self._net = (key, self._build_draft_net(target, table) if ok else None, linears, tiles, table,
                         norm.native_scale())
        self._net_kept = (Snapshot(self), seen)
        return self._net[1]

    def _build_draft_net(self, target: nn.Module, table: torch.Tensor | None) -> DraftNet:
        head, gate, norm = self.masked_embedding, self.copy_gate, self.model.norm
        none = Linear()
        return DraftNet(
            hidden=self.config.hidden_size, backbone=self.config.backbone_hidden_size,
            centroids=head.num_centroids if head is not None else 0, gate_out=gate.proj.out_features if gate else 0,
            pre=linear_weights(self.pre_projection), post=linear_weights(self.post_projection),
            centroid=linear_weights(head.centroids) if head is not None else none,
            gate=linear_weights(gate.proj) if gate is not None else none,
            norm=pointer(norm.native_scale()), eps=norm.eps, table=pointer(table),
            table_half=int(table is not None and table.dtype == torch.float16),
            embed_scale=float(target.config.embed_scale))

    def _round_stack(self, x: torch.Tensor, contexts: list[LayerContext]) -> tuple | None:
        """(contexts, the blocks' LayerWeights, their LayerSteps, what those point into) when every
        block takes decoder_layer.c: built at a round's first step and kept for its other steps,
        which share the contexts (the same list) and x's shape; checking each block's weights and
        building its step every step cost ~0.1 ms of a ~2 ms draft step."""
        kept = self._stack
        if kept is not None and kept[0] is contexts and kept[4] == x.shape:
            return kept
        self._stack = None
        layers = list(self.model.layers)
        weights = self._stack_weights(layers, x, contexts)
        if weights is None:
            return None
        b, t, keep = x.shape[0], x.shape[1], []
        steps = (LayerStep * len(layers))(*[
            layer_step(b, t, layer.self_attn.head_dim, ctx.cos, ctx.sin, None, ctx.keys, ctx.values, 0,
                       ctx.keys.shape[2], ctx.mask, keep) for layer, ctx in zip(layers, contexts)])
        keep += [ctx.keys for ctx in contexts] + [ctx.values for ctx in contexts]
        self._stack = (contexts, weights, steps, keep, x.shape)
        return self._stack

    def _stack_weights(self, layers: list[DrafterBlock], x: torch.Tensor, contexts: list[LayerContext]):
        """The blocks' LayerWeights array (what DrafterBlock._fused_weights gives each), kept across
        rounds while a Snapshot of the network shows no part replaced or written and the contexts
        have the same scale and K/V heads: checking every block's parts each round cost ~0.1 ms
        of a ~2 ms drafting round. What x and this round's cache decide is checked every round."""
        if x.shape[1] > SHORT_FORWARD or not kernels_apply(x) or not all(
                reads_cache(ctx.keys, ctx.values, layer.self_attn.head_dim, takes_half=True)
                for layer, ctx in zip(layers, contexts)):
            return None
        shape = tuple((ctx.scale, ctx.keys.shape[1]) for ctx in contexts)
        kept = self._weights
        if kept is None or kept[1] != shape or not kept[0].unchanged():
            weights = [layer._fused_weights(x, ctx) for layer, ctx in zip(layers, contexts)]
            array = None if any(w is None for w in weights) else (LayerWeights * len(layers))(*weights)
            kept = self._weights = (Snapshot(self), shape, array)
        return kept[2]

    def nbytes(self) -> int:
        tensors = list(self.parameters()) + list(self.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)


def kernels_like_target(net: MTPNetwork, target: nn.Module) -> str | None:
    """For inference next to a target whose linears run on the C kernels, the drafter's linears
    take the same path, and each MLP's gate and up become one projection:

    - next to --weights gguf-q8 (int8 activations): int8 codes per 32 inputs
      (Q8ActLinear), ~1.1 bytes a weight. A draft step reads all of the drafter's linears, mostly
      evicted by the target's forward in between, so fewer bytes make a faster round at the same
      acceptance (BENCHMARKS.md, "Lookups that learn past 3 drafts, an int8 drafter");
    - next to --weights fp16 or gguf: fp16 tiles, half of float32's bytes.

    Drafts may round differently from the float32 drafter's; what is emitted is still the
    target's. Returns "int8", "fp16", or None where nothing changed."""
    if not kernels.available() or not any(kernel_linear(m) for m in target.modules()):
        return None
    int8 = any(type(m) is Q8ActLinear for m in target.modules())
    for layer in net.model.layers:
        layer.mlp.fuse_projections()
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            blocks = int8_blocks(child.weight) if int8 and child.in_features % ACT_GROUP == 0 else None
            if blocks is not None and Q8ActLinear.takes(blocks):
                setattr(module, name, Q8ActLinear(blocks, child.bias))
            elif fp16_tiles_take(child.weight):
                setattr(module, name, Fp16Linear(child.weight, child.bias))
    return "int8" if int8 else "fp16"
