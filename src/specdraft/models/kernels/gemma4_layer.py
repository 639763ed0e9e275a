"""Gemma 4 decoder layers' short forward in one C call (gemma4_layer.c)."""

from __future__ import annotations

import ctypes

import torch

from specdraft.models.kernels import build
from specdraft.models.kernels.decoder_layer import Linear

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Gemma4Weights(ctypes.Structure):
    """Pointers into one layer's own tensors: valid while those tensors live and stay in place.
    A Linear with no weights: absent (k: a KV-shared layer; v: V is K's raw projection)."""

    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("ple", _I64), ("act", _INT), ("eps", _F), ("layer_scalar", _F),
                ("norm_in", _P), ("norm_post_attn", _P), ("norm_pre_mlp", _P), ("norm_post_mlp", _P),
                ("norm_ple", _P), ("q_norm", _P), ("k_norm", _P),
                ("q", Linear), ("k", Linear), ("v", Linear), ("o", Linear), ("gate", Linear), ("up", Linear),
                ("down", Linear), ("ple_gate", Linear), ("ple_proj", Linear)]


def gemma4_stack(weights: ctypes.Array, steps: ctypes.Array, x: torch.Tensor, ple: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, hidden] float32 through len(weights) layers in one C call; ple [B, T, layers, width]
    (contiguous) or None. Layer i writes its new K/V where steps[i] points (nothing if KV-shared)."""
    x, lib = x.contiguous(), build.library()
    scratch = torch.empty(lib.gemma4_stack_scratch(weights, steps, len(weights)), dtype=torch.float32)
    out = torch.empty_like(x)
    stride = 0 if ple is None else ple.shape[-2] * ple.shape[-1]
    lib.gemma4_stack(weights, steps, len(weights), x.data_ptr(), None if ple is None else ple.data_ptr(), stride,
                     out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    return out


# gemma4_layer.c's timers, in its order: what `specdraft steps --breakdown` reports per op class
TIMED_OPS = ("norms", "activation rounding (int8)", "attention matrices (q, k, v, o)", "MLP matrices (gate, up, down)",
             "PLE matrices (gate, projection)", "q/k/v norms, RoPE, cache writes", "attention", "GeGLU and copies")


def read_timers(on: bool) -> dict[str, float]:
    """Seconds per op class the fused layers spent since the last read (zeroed now); `on`
    switches the timers on or off for the calls after this one."""
    out = (ctypes.c_double * len(TIMED_OPS))()
    build.library().gemma4_timers(int(on), out)
    return dict(zip(TIMED_OPS, out))


def omp_region_seconds(threads: int, reps: int = 2000) -> float:
    """What one empty OpenMP parallel region of `threads` threads costs (fork, join, barrier)."""
    return build.library().omp_region_seconds(threads, reps)
