"""A decoder layer's short forward in one C call (decoder_layer.c): fp16 tiles or GGUF blocks."""

from __future__ import annotations

import ctypes
import operator

import torch

from specdraft.models.kernels.build import library

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class Linear(ctypes.Structure):
    """A projection as decoder_layer.c multiplies by it: fp16_gemv tiles or block_gemv blocks."""

    _fields_ = [("kind", _INT), ("weights", _P), ("scales", _P), ("offsets", _P), ("group", _I64), ("bias", _P),
                ("base", _I64), ("code_max", _I64)]


FP16_TILES, BLOCKS, PACKED_BLOCKS, Q8_ACT = 0, 1, 2, 3  # Q8_ACT + Q8ActLinear.kernel_layout: 3 and up


def linear_weights(m) -> Linear:
    """The Linear of a projection the C kernels read (see `kernel_linear`)."""
    return m.c_linear()


def kernel_linear(m) -> bool:
    """Whether decoder_layer.c multiplies by this projection's weights as its forward does: its
    format describes itself with `c_linear()` (formats own their layout; kernels only read it)."""
    describe = getattr(m, "c_linear", None)
    return describe is not None and describe() is not None


class LayerWeights(ctypes.Structure):
    """Pointers into the layer's own tensors: valid while those tensors live and stay in place."""

    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("qkv_kv_heads", _I64), ("sandwich", _INT), ("act", _INT), ("eps", _F), ("qk_eps", _F),
                ("scale", _F), ("softcap", _F), ("layer_scalar", _F),
                ("norm_in", _P), ("norm_post_attn", _P), ("norm_pre_mlp", _P), ("norm_post_mlp", _P),
                ("q_norm", _P), ("k_norm", _P), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear)]


class LayerStep(ctypes.Structure):
    _fields_ = [("B", _I64), ("T", _I64), ("cos", _P), ("sin", _P), ("positions", _P), ("k_cache", _P),
                ("v_cache", _P), ("cache_sb", _I64), ("cache_sh", _I64), ("span_lo", _I64), ("span_len", _I64),
                ("mask", _P), ("mask_sb", _I64), ("mask_st", _I64), ("kv_half", _I64)]


def pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def layer_step(b: int, t: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
               k_cache: torch.Tensor, v_cache: torch.Tensor, span_lo: int, span_hi: int, mask: torch.Tensor,
               keep: list) -> LayerStep:
    """The LayerStep of a forward of b rows x t tokens (see decoder_layer); the tensors it points
    into are appended to `keep`, which must outlive the call."""
    cos, sin = cos.reshape(b * t, head_dim).contiguous(), sin.reshape(b * t, head_dim).contiguous()
    mask = mask.expand(b, 1, t, span_hi - span_lo)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    positions = None if positions is None else positions.contiguous()
    keep += [cos, sin, mask, positions]
    half = int(k_cache.dtype == torch.float16)
    return LayerStep(b, t, cos.data_ptr(), sin.data_ptr(), pointer(positions), k_cache.data_ptr(),
                     v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), span_lo, span_hi - span_lo,
                     mask.data_ptr(), mask.stride(0), mask.stride(2), half)


def decoder_layer(weights: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  positions: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, span_lo: int,
                  span_hi: int, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T, hidden] float32 -> the layer's output [B, T, hidden]; writes the new K/V into
    k_cache, v_cache [B, kv_heads, capacity, head_dim] (same strides, head_dim contiguous) at
    `positions` [B, T] (None: query-only, nothing written); attends over keys [span_lo, span_hi)
    under mask [B, 1, T, span] bool."""
    b, t, _ = x.shape
    x, keep = x.contiguous(), []
    step = layer_step(b, t, weights.head_dim, cos, sin, positions, k_cache, v_cache, span_lo, span_hi, mask, keep)
    lib = library()
    scratch = torch.empty(lib.decoder_layer_scratch(ctypes.byref(weights), b * t, span_hi - span_lo),
                          dtype=torch.float32)
    out = torch.empty_like(x)
    lib.decoder_layer(ctypes.byref(weights), ctypes.byref(step), x.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
    return out


def decoder_stack(weights: ctypes.Array, steps: ctypes.Array, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, hidden] through len(weights) layers, layer i as decoder_layer(weights[i], steps[i])
    computes it (the same bits), in one C call."""
    x, lib = x.contiguous(), library()
    scratch = torch.empty(lib.decoder_stack_scratch(weights, steps, len(weights)), dtype=torch.float32)
    out = torch.empty_like(x)
    lib.decoder_stack(weights, steps, len(weights), x.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
    return out


class Snapshot:
    """Every submodule, parameter and buffer of a module tree by identity, and each tensor's
    version and storage, as they were when a C view of the tree (LayerWeights) was built.
    `unchanged()` checks them with C-level maps over dict lookups, not nn.Module attribute
    lookups, so an 18-layer step can ask it every time (~0.1 ms)."""

    def __init__(self, module: torch.nn.Module):
        self.tables, self.names, self.objects = [], [], []
        for m in module.modules():
            for table in (m._modules, m._parameters, m._buffers):
                for name, obj in table.items():
                    self.tables.append(table)
                    self.names.append(name)
                    self.objects.append(obj)
        tensors = [t for t in self.objects if isinstance(t, torch.Tensor)]
        # inference tensors (made under torch.inference_mode) keep no version counter, and are
        # only written in place under inference mode, which nothing here does: their storage is checked
        self.versioned = [t for t in tensors if not t.is_inference()]
        self.tensors = tensors
        self.stamps = self._stamps()

    def _stamps(self) -> list[int]:
        return [t._version for t in self.versioned] + [t.data_ptr() for t in self.tensors]

    def unchanged(self) -> bool:
        return (all(map(operator.is_, map(dict.get, self.tables, self.names), self.objects))
                and self._stamps() == self.stamps)


def fusable(linears, norms, act: str, qk_norms, head_dim: int) -> bool:
    """Whether decoder_layer.c computes a layer made of these parts: every projection fp16 tiles
    or GGUF blocks, float32 or int8 activations (`kernel_linear`), an activation gated_act.c takes, norms with float32 scales (or none) and one
    eps, q/k norms (those the layer has) with scales."""
    from specdraft.models.kernels.gated_act import KINDS
    from specdraft.models.kernels.qk_rope import MAX_HEAD_DIM

    qk_ok = all(n.weight is not None and n.native_ready() for n in qk_norms)
    return (all(kernel_linear(m) for m in linears) and qk_ok and act in KINDS
            and all(n.native_ready() for n in norms) and len({n.eps for n in norms}) == 1
            and head_dim <= MAX_HEAD_DIM)


def parts_key(linears, norms, *extra) -> tuple[tuple, tuple]:
    """(key, tiles): what a kept LayerWeights points into, as a key that changes when a projection
    or its tiles are replaced (`to()`, loading) or a norm's weight is written; keep `tiles` (and
    the modules) referenced with the weights so the ids stay theirs."""
    tiles = tuple(_weight_tensor(m) for m in linears)
    versions = tuple(-1 if n.weight is None else n.weight._version for n in norms)
    return tuple(map(id, tuple(linears) + tiles)) + versions + extra, tiles


def _weight_tensor(m) -> torch.Tensor | None:
    """The tensor a LayerWeights' Linear points at for projection m: tiles, codes or packed codes."""
    for name in ("tiles", "codes", "nibbles", "packed_codes"):
        t = getattr(m, name, None)
        if t is not None:
            return t
    return None


def reads_cache(k: torch.Tensor, v: torch.Tensor, head_dim: int, takes_half: bool = False) -> bool:
    """Whether K/V storage (or a key span of it) is laid out as the layer kernels read it: float32,
    or float16 where the caller's kernel takes it (`takes_half`: gemma4_layer.c, and decoder_layer.c's
    query-only attention for the MTP drafter, which writes nothing; decoder_layer.c writes float32)."""
    dtypes = (torch.float32, torch.float16) if takes_half else (torch.float32,)
    return (k.dtype == v.dtype and k.dtype in dtypes and k.stride(-1) == 1 and k.stride(-2) == head_dim
            and v.stride() == k.stride())
