"""The contract every target model keeps, so the engine and the drafters run any of them.

`models.decoder.Transformer` (Gemma 3, Llama family) and `models.gemma4.Gemma4Transformer`
implement it; nothing above `models/` may rely on more than this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdraft.config import ModelConfig
from specdraft.kv_cache import KVCache
from specdraft.models.rope import RopeTable


@dataclass(frozen=True)
class AttentionLayout:
    """How queries meet one layer's cached K/V: the cache slot, and the exact q-path (head_dim,
    KV heads, RoPE table, softmax scale, window, whether queries are RMS-normalised). A query
    from outside the layer (the MTP drafter's) must follow it, because the cached keys were
    normed and rotated by exactly this layer."""

    layer: int
    slot: int
    layer_type: str
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None
    rope: RopeTable
    q_norm: bool


class TargetModel(Protocol):
    config: ModelConfig

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, T] at each row's next T positions -> final-normed hidden [B, T, H]."""

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] with the model's own scaling."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., H] -> float32 logits [..., V] (final softcap applied)."""

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw head scores [..., V] in the model's dtype: same argmax as `logits`, no float32 copy."""

    @property
    def head_weight(self) -> torch.Tensor:
        """The [V, H] table the LM head scores against (the embedding when tied)."""

    def cache_slot(self, layer: int) -> int:
        """Which KV-cache slot holds layer `layer`'s K/V."""

    def kv_layers(self) -> list[int]:
        """Layers that compute and store their own K/V, in order."""

    def attention_layout(self, layer: int) -> AttentionLayout: ...
