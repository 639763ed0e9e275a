"""A GGUF file's metadata and tensor table, parsed in one pass over the header.

The `gguf` package's reader builds numpy views for every part of every value: opening Gemma 3's
file (262k vocabulary strings, scores and types) took 40-80 s on a 2-core CPU, most of a first
load. Here the header is walked with `struct` over a memory map, strings are decoded from slices
and number arrays read with one `np.frombuffer` each (well under a second). Tensor data stays
in the map, shaped as the `gguf` reader shapes it, so `gguf.quants.dequantize` reads it as is.

Format (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, key/value count
u64; key/value pairs (string key, u32 value type, value); tensor infos (string name, u32 dims,
u64 per dim, u32 ggml type, u64 offset); the data, from the header's end rounded up to
`general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

# GGUF value types -> numpy dtypes (8 = string and 9 = array are handled apart).
_NUMBER_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# Unquantised tensor types are read as their own numbers; the others as bytes.
_PLAIN_TENSOR_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                       GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                       GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                       GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFField:
    name: str
    value: Any

    def contents(self) -> Any:
        """The value as Python objects (lists for arrays), as `gguf.ReaderField.contents()` gives it."""
        return self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the input width first
    data: np.ndarray  # a view of the file: numbers for unquantised types, else bytes per row
    offset: int = 0  # where the data starts in the file


class GGUFFile:
    """`fields` (key -> GGUFField) and `tensors` (in file order) of one GGUF file."""

    def __init__(self, path: str | Path):
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        magic, version = self._bytes(4), self._unpack("<I")
        if magic != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader handles 2 and 3, little-endian)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, GGUFField] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = GGUFField(key, self._value(self._unpack("<I")))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata field's contents (a number, string or list), or `default` where the file lacks it."""
        found = self.fields.get(key)
        return default if found is None else found.contents()

    # -- header primitives (each raises on a header that runs past the end of the file)

    def _bytes(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            raise ValueError("the header runs past the end of the file")
        out = self._buf[self._pos : self._pos + n].tobytes()
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._bytes(self._unpack("<Q")).decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("<I"), self._unpack("<Q")
            if item_kind == _STRING:
                return [self._string() for _ in range(count)]
            if item_kind in _NUMBER_TYPES:
                dtype = np.dtype(_NUMBER_TYPES[item_kind])
                return np.frombuffer(self._bytes(dtype.itemsize * count), dtype).tolist()
            return [self._value(item_kind) for _ in range(count)]  # arrays of arrays
        if kind not in _NUMBER_TYPES:
            raise ValueError(f"unknown GGUF value type {kind}")
        dtype = np.dtype(_NUMBER_TYPES[kind])
        return np.frombuffer(self._bytes(dtype.itemsize), dtype)[0].item()

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        kind = GGMLQuantizationType(self._unpack("<I"))
        return name, dims, kind, self._unpack("<Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        block, block_bytes = GGML_QUANT_SIZES[kind]
        n_bytes = int(np.prod(dims, dtype=np.int64)) * block_bytes // block
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"tensor {name} ends past the end of the file")
        shape = tuple(reversed(dims))  # numpy order: rows last in GGUF are first here
        raw = self._map[begin : begin + n_bytes]
        if kind in _PLAIN_TENSOR_TYPES:
            data = raw.view(_PLAIN_TENSOR_TYPES[kind]).reshape(shape)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
        return GGUFTensor(name, kind, dims, data, begin)
