"""Deepen a trained drafter: `train-drafter --init-from DRAFTER --layers N` with N above its layers.

The new blocks go in front of the trained ones (the Gemma 4 pattern keeps sliding blocks first
and the full block last) and start as the identity: a block adds post_norm(attn) and
post_norm(mlp) to its input, and with both post-norm scales at zero it adds nothing. So the grown
drafter drafts exactly what the trained one did at step 0, and training opens the new blocks
from there (the scales get gradients at once; the projections behind them as the scales grow).
Zeroing the projections instead would not do: an RMSNorm of a near-zero vector is a unit vector.
"""

from __future__ import annotations

import dataclasses

import torch

from specdraft.config import FULL, SLIDING
from specdraft.drafters.mtp.config import MTPConfig
from specdraft.errors import SpecdraftError

PREFIX = "model.layers."


def grown_config(cfg: MTPConfig, layers: int, target_layer_types: list[str]) -> MTPConfig:
    """cfg with `layers` blocks: the new ones (sliding where the target has sliding layers) first."""
    if layers < cfg.num_layers:
        raise SpecdraftError(f"--layers {layers} is fewer than the {cfg.num_layers} layers of the drafter given "
                             f"to --init-from (a drafter can be deepened, not cut; try {cfg.num_layers})")
    new_type = SLIDING if SLIDING in target_layer_types else FULL
    return dataclasses.replace(cfg, layer_types=[new_type] * (layers - cfg.num_layers) + list(cfg.layer_types))


def front_blocks(count: int) -> tuple[str, ...]:
    """Name prefixes of the first `count` blocks' tensors (the new ones of a deepened drafter)."""
    return tuple(f"{PREFIX}{i}." for i in range(count))


def grown_state(state: dict[str, torch.Tensor], added: int) -> dict[str, torch.Tensor]:
    """The trained drafter's tensors renamed for a drafter with `added` blocks in front."""
    out = {}
    for name, tensor in state.items():
        if name.startswith(PREFIX):
            index, rest = name[len(PREFIX):].split(".", 1)
            name = f"{PREFIX}{int(index) + added}.{rest}"
        out[name] = tensor
    return out


@torch.no_grad()
def close_new_blocks(net: torch.nn.Module, added: int) -> None:
    """Make the first `added` blocks the identity (see the module docstring)."""
    for block in list(net.model.layers)[:added]:
        block.post_attention_layernorm.weight.zero_()
        block.post_feedforward_layernorm.weight.zero_()
        block.layer_scalar.fill_(1.0)
