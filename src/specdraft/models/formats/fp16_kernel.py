"""FBGEMM's fp16-weight matmul on x86 CPUs, padded so that a row's result never depends on the rows beside it.

`quantized.linear_dynamic_fp16` keeps the weight in fp16 (half the bytes of float32) and
computes in float32: each weight is widened exactly and the products are summed in float32. On
a CPU without bf16 units it is the fastest dense kernel torch has for decode and verify widths:
for Gemma 3 270M's 262144 x 640 head 20 ms at 1-4 rows against MKL float32's 80-184 ms on a
2-core AVX2 EPYC (BENCHMARKS.md).

Row invariance. FBGEMM cuts the rows of a call into blocks for micro-kernels of 1 to 6 rows
(AVX2; wider on AVX-512). The 1- and 2-row kernels round differently from the others, so row r
of an M-row call can differ in the last bits from the same row alone, which would make a (K+1)-row
verification disagree with K+1 one-row steps. `row_padding` probes once per process which call
sizes give every row the bits it gets inside a 3-row call, and `fp16_mm` pads each call to the
nearest such size with zero rows. The probe is empirical because the blocking is FBGEMM's
choice and differs between CPUs; sizes it cannot fix are reported by `row_invariant`.
"""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from functools import lru_cache

import torch

PROBE_ROWS = 96  # decode/verify calls up to this many rows are padded (8 rows x 12 tokens)
_PROBE_SEARCH = 12  # how far above M the probe looks for a size that gives canonical bits
_CANONICAL = 3  # the block size a row is referenced against


def prepack_fp16(weight: torch.Tensor) -> torch.ScriptObject:
    """weight [N, K] float32 -> FBGEMM's packed fp16 copy (weights rounded to nearest fp16)."""
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notice; the op itself stays
        warnings.simplefilter("ignore")
        return torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)


def _raw_mm(rows: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(rows, packed)


@lru_cache(maxsize=1)
def row_padding() -> tuple[int | None, ...]:
    """padding[M] = the call size that gives M rows their canonical bits (None where none does)."""
    gen = torch.Generator().manual_seed(0)
    k = 256
    packed = prepack_fp16(torch.randn(128, k, generator=gen) * 0.05)
    x = torch.randn(PROBE_ROWS + _PROBE_SEARCH + _CANONICAL, k, generator=gen)
    canonical = torch.cat([_raw_mm(x[i : i + _CANONICAL], packed) for i in range(0, PROBE_ROWS, _CANONICAL)])
    padding: list[int | None] = [0]
    for m in range(1, PROBE_ROWS + 1):
        fits = (size for size in range(m, m + _PROBE_SEARCH + 1)
                if torch.equal(_raw_mm(x[:size], packed)[:m], canonical[:m]))
        padding.append(next(fits, None))
    return tuple(padding)


def row_invariant(max_rows: int = PROBE_ROWS) -> bool:
    """Whether every call of up to `max_rows` rows gives each row its canonical bits here."""
    return all(p is not None for p in row_padding()[1 : max_rows + 1])


def fp16_mm(rows: torch.Tensor, packed: torch.ScriptObject, pad: bool = True) -> torch.Tensor:
    """rows [M, K] float32 -> rows @ W^T [M, N] float32. With `pad`, a row's bits do not depend
    on M for M up to PROBE_ROWS (where `row_invariant`); wider calls (prompts) are not padded."""
    m = rows.shape[0]
    size = row_padding()[m] if pad and m <= PROBE_ROWS else None
    if size is None or size == m:
        return _raw_mm(rows.float().contiguous(), packed)
    padded = _padding_buffer(size, rows.shape[1])
    padded[:m].copy_(rows)  # rows m.. stay zero: nothing else writes them
    return _raw_mm(padded, packed)[:m]


_BUFFERS = threading.local()


def _padding_buffer(size: int, width: int) -> torch.Tensor:
    """A zeroed [size, width] float32 buffer per thread, reused by every call of that shape
    (one copy instead of allocating, zeroing and concatenating on each of ~80 calls a step)."""
    cache = _BUFFERS.__dict__.setdefault("by_shape", {})
    buf = cache.get((size, width))
    if buf is None:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buf = cache[(size, width)] = torch.zeros(size, width)
    return buf


# torch.compile cannot trace FBGEMM's packed weights (an opaque ScriptObject), so a compiled step
# reaches them through a custom op that takes a plain int naming the layer. The registry holds the
# layers weakly: a model that is dropped frees its weights.
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def register(layer) -> int:
    """A handle for `layer` (anything with `matmul(rows)`) that compiled graphs can carry."""
    handle = next(_NEXT)
    _LAYERS[handle] = layer
    return handle


@torch.library.custom_op("specdraft::fp16_linear", mutates_args=())
def fp16_linear(rows: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """The registered layer's `matmul` (no bias), as one op a compiled graph calls out to."""
    return _LAYERS[handle].matmul(rows)


@fp16_linear.register_fake
def _(rows: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], out_features, dtype=torch.float32)


def fp16_kernel_available() -> bool:
    """FBGEMM's fp16-weight matmul is in torch's x86 CPU builds; not on ARM, not for CUDA tensors."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_prepack_fp16")
