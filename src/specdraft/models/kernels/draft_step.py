"""An MTP draft step from the token to its clustered head's inputs in one C call (draft_step.c)."""

from __future__ import annotations

import ctypes

import torch

from specdraft.models.kernels.build import library
from specdraft.models.kernels.decoder_layer import Linear, pointer

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class DraftNet(ctypes.Structure):
    """Pointers into the drafter's own tensors and the target's token table: valid while those live
    and stay in place (drafters/mtp/network.py keeps them referenced beside it)."""

    _fields_ = [("hidden", _I64), ("backbone", _I64), ("centroids", _I64), ("gate_out", _I64),
                ("pre", Linear), ("post", Linear), ("centroid", Linear), ("gate", Linear),
                ("norm", _P), ("eps", _F), ("table", _P), ("table_half", _INT), ("embed_scale", _F)]


def draft_step(net: DraftNet, weights: ctypes.Array, steps: ctypes.Array, tokens: torch.Tensor, state: torch.Tensor,
               embeds: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """tokens [N] int64, state [N, H] float32 -> (z [N, h], next state [N, H], centroid scores [N, C]
    or None, copy-gate bonus [N, gate_out] or None), as the drafter's modules compute them one by
    one with the C kernels (the same bits). weights / steps: the blocks' LayerWeights and LayerSteps.
    embeds [N, H] float32: the tokens' input embeddings as the target's embed() gives them, for a
    net without a table pointer (a target whose table stays in a GGUF file's blocks)."""
    lib = library()
    if (embeds is None) == (not net.table):
        raise ValueError("draft_step: give embeds exactly when the DraftNet has no table")
    tokens, state = tokens.to(torch.int64).contiguous(), state.contiguous()
    embeds = None if embeds is None else embeds.float().contiguous()
    n = tokens.shape[0]
    z, state_out = torch.empty(n, net.hidden), torch.empty(n, net.backbone)
    scores = torch.empty(n, net.centroids) if net.centroids else None
    bonus = torch.empty(n, net.gate_out) if net.gate_out else None
    scratch = torch.empty(lib.draft_step_scratch(ctypes.byref(net), weights, steps, len(weights)))
    lib.draft_step(ctypes.byref(net), weights, steps, len(weights), tokens.data_ptr(), pointer(embeds), state.data_ptr(),
                   z.data_ptr(), state_out.data_ptr(), pointer(scores), pointer(bonus), scratch.data_ptr(),
                   torch.get_num_threads())
    return z, state_out, scores, bonus
