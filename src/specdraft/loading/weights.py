"""Reading safetensors files and assigning their tensors to a model, with clear errors.

Only safetensors are read (never pickle), so loading a checkpoint never executes its code.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specdraft.errors import SpecdraftError

# Prefixes that wrap the text decoder in HF checkpoints (causal LM, multimodal wrappers).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
# Towers of multimodal checkpoints that a text-only runtime ignores.
IGNORED_PREFIXES = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
    "audio_tower.", "model.audio_tower.", "embed_vision.", "model.embed_vision.", "embed_audio.", "model.embed_audio.",
)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a HF folder: the sharded index's files, else model.safetensors, else
    every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise SpecdraftError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        # A shard of only vision/audio towers may be left out (a Hub download skips it, hub.py).
        text = {shard for tensor, shard in weight_map.items() if decoder_name(tensor) is not None}
        missing = [str(f) for f in files if not f.exists() and f.name in text]
        if missing:
            raise SpecdraftError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return [f for f in files if f.exists()]
    if (folder / "model.safetensors").exists():  # a single-file checkpoint; other files are not weights
        return [folder / "model.safetensors"]  # (e.g. a training checkpoint's optimizer.safetensors)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecdraftError(f"{folder}: no *.safetensors weights found")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise SpecdraftError(f"{path}: cannot read safetensors file ({str(e).splitlines()[0]}); is it truncated or corrupt?") from None
    return state


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
PAGE = mmap.PAGESIZE


class MappedSafetensors:
    """One safetensors file mapped into memory: `tensor(name)` is a view of the file, no copy.

    A private (copy-on-write) mapping: pages come from the page cache as they are read and count
    as resident only while mapped, so `release(name)` hands a tensor's pages back once it has been
    converted (a shard's weights never all sit in anonymous memory). A tensor kept as a view (a
    lookup table read a row at a time) keeps only the rows it has read resident."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = path.stat().st_size
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(n))
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else None
        except (OSError, ValueError, struct.error) as e:
            raise SpecdraftError(f"{path}: cannot read safetensors file ({str(e).splitlines()[0]}); "
                                 "is it truncated or corrupt?") from None
        header.pop("__metadata__", None)
        self.start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for name, info in header.items():
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            lo, hi = info["data_offsets"]
            if dtype is None:
                raise SpecdraftError(f"{path}: tensor {name} has dtype {info.get('dtype')}, which is not supported")
            if self.start + hi > size or lo > hi:
                raise SpecdraftError(f"{path}: cannot read safetensors file (tensor {name} lies past its end); "
                                     "is it truncated or corrupt?")
            self.entries[name] = (dtype, list(info["shape"]), self.start + lo, self.start + hi)

    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, lo, hi = self.entries[name]
        count = (hi - lo) // dtype.itemsize
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=count, offset=lo).view(shape)

    def release(self, name: str) -> None:
        """Drop a tensor's pages from this process (they are re-read from the file if touched again)."""
        _, _, lo, hi = self.entries[name]
        first, last = (lo + PAGE - 1) // PAGE * PAGE, hi // PAGE * PAGE
        if self.map is not None and last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)


def decoder_name(name: str) -> str | None:
    """A checkpoint tensor's name as our modules name it (wrapper prefixes stripped); None for a
    tower a text-only runtime ignores."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    if name.endswith("lm_head.weight"):
        return "lm_head.weight"
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def text_decoder_weights(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Strip wrapper prefixes; return (weights named as our modules name them, ignored tower names)."""
    out: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for name, tensor in state.items():
        renamed = decoder_name(name)
        if renamed is None:
            ignored.append(name)
        else:
            out[renamed] = tensor
    return out, ignored


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> None:
    """Put `state` into `model` (built on the meta device), converting to dtype/device.

    Every parameter must be present with the right shape; unknown tensors are an error too,
    since they usually mean the config does not describe the checkpoint.
    """
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise SpecdraftError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    if unexpected:
        raise SpecdraftError(f"checkpoint has {len(unexpected)} tensor(s) the config does not describe, e.g. {unexpected[:3]}")
    for name, param in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise SpecdraftError(
                f"tensor {name} has shape {tuple(tensor.shape)} but the config implies {tuple(param.shape)}"
            )
    converted = {n: state[n].to(device=device, dtype=dtype) for n in expected}
    model.load_state_dict(converted, strict=True, assign=True)
