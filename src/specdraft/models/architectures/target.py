"""The contract every target model keeps, so the engine and the drafters run any of them.

`models.architectures.decoder.Transformer` (Gemma 3, Llama family) and `models.architectures.gemma4.Gemma4Transformer`
implement it; nothing above `models/` may rely on more than this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specdraft.config import ModelConfig
from specdraft.errors import SpecdraftError
from specdraft.kv_cache import AttentionSpan, KVCache
from specdraft.models.kernels.argmax import argmax_last
from specdraft.models.architectures.layers import softcap
from specdraft.models.formats.quant import head_scores
from specdraft.models.architectures.rope import RopeTable


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

    def new_cache(self, batch_size: int, capacity: int, max_forward: int | None = None,
                  reads_window: int | None = None) -> KVCache:
        """A cache of `capacity` positions per row. With `max_forward` (the widest forward and the
        furthest rollback the caller makes), a model may keep sliding layers in rings
        (kv_cache.py); `reads_window`: the widest window a drafter reads of it."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] with the model's own scaling."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., H] -> float32 logits [..., V] (final softcap applied)."""

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Raw head scores [..., V] (model dtype, or float32 from the int8 head): same argmax as `logits`."""

    def head_outputs(self, hidden: torch.Tensor, greedy_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H] -> (`greedy_tokens` of the first `greedy_rows` rows, `logits` of the rest),
        each row's as a call of its own would give it."""

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., H] -> the greedy next token [...] (argmax of the head's scores)."""

    @property
    def dtype(self) -> torch.dtype:
        """Activations and KV cache (the token table may be stored narrower)."""

    @property
    def head_weight(self) -> torch.Tensor:
        """The [V, H] table the LM head scores against (the embedding when tied); it may be
        stored narrower than `dtype` (fp16 under --weights fp16)."""

    def cache_slot(self, layer: int) -> int:
        """Which KV-cache slot holds layer `layer`'s K/V."""

    def kv_layers(self) -> list[int]:
        """Layers that compute and store their own K/V, in order."""

    def attention_layout(self, layer: int) -> AttentionLayout: ...

    def prefill_rows_alone(self, cache: KVCache) -> bool:
        """Whether each position's K/V and hidden state come out with the same bits whatever
        forward computes it (a prompt's chunk of any width and start, a decode step): then a
        prefix cache may restore a prompt's prefix up to any position."""


class CachedDecoder(nn.Module):
    """What both model families share: the cached forward and the LM head.

    Subclasses define `run_layers` (embedding to final norm) and set `config`, `windows`
    (layer type -> sliding window or None), `embed_tokens` and `lm_head`.
    """

    # Whether new_cache keeps sliding layers in rings when given max_forward (kv_cache.py).
    sliding_rings = False

    def __init__(self) -> None:
        super().__init__()
        self.packed_head: nn.Module | None = None  # set by models.formats.quant.compact_weights
        self.screened_head: nn.Module | None = None  # set by models.formats.screened_head.screen_head
        self.compiled_step = None  # set by models.compile.compile_steps

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B, T] written at each row's next T positions -> final-normed hidden [B, T, H]."""
        positions = cache.begin(tokens.shape[1])
        if self.compiled_step is not None and self.compiled_step.handles(tokens):
            hidden = self.compiled_step(tokens, positions, cache)
        else:
            hidden = self.run_layers(tokens, positions, cache, {t: cache.span(w) for t, w in self.windows.items()})
        cache.end()
        return hidden

    def prefill_rows_alone(self, cache: KVCache) -> bool:
        """See TargetModel.prefill_rows_alone; False unless a model shows otherwise."""
        return False

    def run_layers(self, tokens: torch.Tensor, positions: torch.Tensor, kv, spans: dict[str, AttentionSpan]) -> torch.Tensor:
        """The forward proper once positions and key spans are known; `kv` stores the new K/V
        (the KVCache itself, or IndexedWrites inside a compiled step)."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The activations' and the KV cache's dtype. The token table may be stored narrower
        (fp16 under --weights fp16, models.formats.quant.compact_weights): read its rows through `embed`."""
        return self.norm.weight.dtype

    @property
    def head_weight(self) -> torch.Tensor:
        table = self.embed_tokens if self.lm_head is None else self.lm_head
        if getattr(table, "format", None) is not None and table.weight.dtype == torch.uint8:
            # a GGUF table kept in its file's blocks (models/formats/gguf_table.py): its bytes are
            # not the [V, H] values a drafter's tied head or training would score against
            raise SpecdraftError(f"this target's token table stays in its GGUF file's {table.format} blocks, so a "
                                 "drafter whose head is the target's table, and drafter training, cannot read it; "
                                 "use a drafter with its own head (the official assistant) or the checkpoint")
        return table.weight

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_scores(self, hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of the head's raw scores (the softcap is monotonic), per row on its own: the
        screened head when there is one, else the scores read as float32 (on a CPU an argmax over
        bf16 values costs 4x the conversion plus a float32 argmax)."""
        if self.screened_head is not None:
            return self.screened_head(hidden)
        return argmax_last(head_scores(self, hidden).float())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., H] -> logits [..., V] in float32 (final softcap applied)."""
        return softcap(head_scores(self, hidden).float(), self.config.final_softcap)

    def head_outputs(self, hidden: torch.Tensor, greedy_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy rows and sampled rows in one pass over the head's table where both come from the
        same scores (a CPU head pass costs ~3 rows' multiplies in reading the table: a server
        round with greedy and sampled requests read it twice). The screened head finds greedy
        tokens without the scores: two calls there."""
        if self.screened_head is not None or greedy_rows == 0:
            none = torch.empty(0, dtype=torch.long, device=hidden.device)
            return self.greedy_tokens(hidden[:greedy_rows]) if greedy_rows else none, self.logits(hidden[greedy_rows:])
        scores = head_scores(self, hidden).float()
        return argmax_last(scores[:greedy_rows]), softcap(scores[greedy_rows:], self.config.final_softcap)
