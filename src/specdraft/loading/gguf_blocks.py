"""A GGUF file's quantised blocks, kept as they are: one int8 code per weight, and a float32
scale (and offset) per group of inputs.

llama.cpp's block formats all dequantise the same way: a weight is fl(fl(s * c) - o) in float32,
for a small integer code c and a group's scale s and offset o (o = 0 where the format has none).
`convert_gguf` wrote exactly these numbers into the float32 checkpoint; keeping c, s and o lets a
kernel read about a quarter of the bytes and still multiply by the float32 model's own weights
(models/formats/block_linear.py, which defines `Blocks`). Each decoder below follows the layout of one format; `Blocks.dequantized`
is checked against the checkpoint when the weights are packed, so a mistake here cannot pass
silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from specdraft.errors import SpecdraftError
from specdraft.models.formats.block_linear import Blocks, TwoLevel


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, run: int) -> np.ndarray:
    """Each `run` bytes hold 2 * run 4-bit values: the low nibbles first, then the high ones."""
    n = raw.shape[0]
    low_high = raw.reshape(n, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (low_high & 0x0F).reshape(n, -1)


def _fifth_bits(raw: np.ndarray) -> np.ndarray:
    """The 32 high bits of a 5-bit block, one per value."""
    qh = raw.copy().view(np.uint32).reshape(-1, 1)
    return ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32


def _q4_0(b):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - 8, _f16(b[:, :2]), None, 32


def _q4_1(b):  # d * q + m: offset -m (negation is exact)
    return _nibbles(b[:, 4:], 16).astype(np.int8), _f16(b[:, :2]), -_f16(b[:, 2:4]), 32


def _q5_0(b):
    q = _nibbles(b[:, 6:], 16) | (_fifth_bits(b[:, 2:6]) << 4)
    return q.astype(np.int8) - 16, _f16(b[:, :2]), None, 32


def _q5_1(b):
    q = _nibbles(b[:, 8:], 16) | (_fifth_bits(b[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(b[:, :2]), -_f16(b[:, 2:4]), 32


def _q4_k(b):  # 256 values: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    packed = b[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=1)
    codes = _nibbles(b[:, 16:], 32).astype(np.int8)
    return codes, d * sc.astype(np.float32), dmin * mn.astype(np.float32), 32, (sc, d, mn, dmin)


def _q6_k(b):  # 256 values: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 8, 32)
    high = (b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).astype(np.int8) - 32
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    return q.reshape(n, 256), d * scales, None, 16, (b[:, 192:208].view(np.int8), d, None, None)


# format name -> decoder of [blocks, bytes per block] -> (codes, scales, offsets, group), and for
# K-quants the scales' and offsets' parts as stored (multipliers, factor, offset multipliers, offset
# factor); the block sizes are gguf-py's (GGML_QUANT_SIZES)
_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
SUPPORTED_BLOCK_FORMATS = tuple(_DECODERS)


def decode_blocks(data: np.ndarray, fmt: str, shape: tuple[int, int]) -> Blocks:
    """One GGUF tensor's raw bytes (format `fmt`, logical [N, K]) -> its Blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    n, _ = shape
    codes, scales, offsets, group, *parts = _DECODERS[fmt](np.ascontiguousarray(data).reshape(-1, nbytes))

    def rows(a):
        return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))

    def two_level(multipliers, factors):  # per super-block factors -> [N, K / 256]
        return None if multipliers is None else TwoLevel(rows(multipliers.view(np.int8)), rows(factors.astype(np.float16)))

    scale_parts = offset_parts = None
    if parts:
        sc, d, mn, dmin = parts[0]
        scale_parts, offset_parts = two_level(sc, d), two_level(mn, dmin)
    return Blocks(rows(codes.astype(np.int8)), rows(scales.astype(np.float32)),
                  None if offsets is None else rows(offsets.astype(np.float32)), group, scale_parts, offset_parts)


# In a folder converted from a GGUF; a subfolder, so that loading the folder's *.safetensors skips it.
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"


def save_blocks(blocks: dict[str, Blocks], path: Path) -> None:
    """Write blocks as one safetensors file (atomically: a reader never sees half a file)."""
    from safetensors.torch import save_file

    tensors, groups = {}, {}
    for name, b in blocks.items():
        tensors[f"{name}.codes"], tensors[f"{name}.scales"] = b.codes.contiguous(), b.scales.contiguous()
        if b.offsets is not None:
            tensors[f"{name}.offsets"] = b.offsets.contiguous()
        groups[name] = b.group
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two processes may save at once
    save_file(tensors, str(tmp), metadata={"groups": json.dumps(groups)})
    os.replace(tmp, path)


def load_blocks(path: Path) -> dict[str, Blocks]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        groups = json.loads(f.metadata()["groups"])
        keys = set(f.keys())
        return {name: Blocks(f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"),
                             f.get_tensor(f"{name}.offsets") if f"{name}.offsets" in keys else None, group)
                for name, group in groups.items()}
