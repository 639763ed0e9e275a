"""A Gemma 4 GGUF loaded from its own blocks: no float model, no converted folder.

The model is built on the meta device from the header's config, then filled tensor by tensor
from a private memory map of the file:
- block-quantised matrices (Q8_0, Q4_K, Q6_K, Q4_0/1, Q5_0/1) become int8-activation kernel
  linears (models/formats/q8_act_linear.py, llama.cpp's own Q8_0 activation arithmetic) straight
  from their codes: Q8_0, Q4_K and Q6_K laid out in C from the file's bytes, the others decoded
  first, one matrix's transients at a time, handed back to the OS after each;
- F16 / BF16 / F32 matrices are compacted as a checkpoint's are under --weights q8;
- the expert stacks of a MoE model become one such linear per expert and part;
- the token and per-layer tables stay views of the file in their block format, dequantised a
  row at a time when looked up (models/formats/gguf_table.py); the tied LM head is a kernel
  linear over the token table's blocks;
- norms, scalars and the router's vectors are float32 tensors. llama.cpp's Gemma 4 converter
  stores them as Hugging Face does (norms as w, no shift; the embedding scale is applied by the
  model, not stored), so nothing is undone; rope_freqs is read into the config.
The tokenizer is written once into a small cache folder (tokenizer files and config.json only).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from specdraft.cache_dir import cache_root
from specdraft.config import ModelConfig
from specdraft.device import release_free_memory
from specdraft.errors import SpecdraftError
from specdraft.loading.gguf_blocks import SUPPORTED_BLOCK_FORMATS, decode_blocks
from specdraft.loading.gguf_description import FLOAT_TYPES, GGUFDescription
from specdraft.loading.gguf_file import hf_name
from specdraft.loading.gguf_reader import GGUFTensor
from specdraft.loading.weights import decoder_name
from specdraft.models.architectures.hf_config import read_model_config
from specdraft.models.formats.block_linear import Blocks
from specdraft.models.formats.gguf_table import GGUFEmbedding
from specdraft.models.formats.q8_act_linear import Q8ActLinear
from specdraft.models.formats.quant import compact_head, compact_matrix

TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")
_SPLIT_EXPERTS = ("ffn_gate_exps", "ffn_up_exps")


def describe_model(desc: GGUFDescription) -> tuple[ModelConfig, nn.Module]:
    """The config and the model the file describes, on the meta device (shapes, no memory)."""
    from specdraft.loading import build_model

    cfg = read_model_config(desc.config)
    with torch.device("meta"):
        return cfg, build_model(cfg)


class FileMap:
    """The file mapped privately (copy-on-write, as checkpoints are): a tensor's bytes are a view,
    and `release` hands a read matrix's pages back so they stop counting as resident."""

    def __init__(self, desc: GGUFDescription):
        with open(desc.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    @staticmethod
    def span(t: GGUFTensor) -> tuple[int, int]:
        return t.offset, t.offset + t.data.nbytes

    def raw(self, t: GGUFTensor) -> torch.Tensor:
        lo, hi = self.span(t)
        return torch.frombuffer(self.map, dtype=torch.uint8, count=hi - lo, offset=lo)

    def release(self, t: GGUFTensor) -> None:
        lo, hi = self.span(t)
        first, last = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self.map.madvise(mmap.MADV_DONTNEED, first, last - first)


def matrix_shape(t: GGUFTensor) -> tuple[int, int]:
    k, n = (int(d) for d in t.shape[:2])  # GGUF lists the input width first
    return n, k


def float_values(t: GGUFTensor, raw: torch.Tensor) -> torch.Tensor:
    """A plain-float tensor's values as float32, in numpy order (rows first)."""
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t.tensor_type.name]
    return raw.view(dtype).view(*reversed(t.shape)).float()


def tensor_values(t: GGUFTensor, raw: torch.Tensor) -> torch.Tensor:
    """A small tensor's values (a norm, a scalar, a vector) as float32, in numpy order, whatever
    its type."""
    fmt = t.tensor_type.name
    if fmt in FLOAT_TYPES:
        return float_values(t, raw)
    return _decoder(fmt, int(t.shape[0]))(raw.numpy().reshape(-1, t.data.shape[-1])).reshape(*reversed(t.shape))


def _decoder(fmt: str, width: int):
    """raw rows -> float32 values, exactly as llama.cpp dequantises them."""
    if fmt in FLOAT_TYPES:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[fmt]
        return lambda rows: torch.from_numpy(rows).view(dtype).float()
    return lambda rows: decode_blocks(rows, fmt, (rows.shape[0], width)).dequantized()


def matrix_blocks(fmt: str, n: int, k: int, raw: torch.Tensor, name: str) -> Blocks:
    """A block-format matrix's codes and scales as they are (a one-line error for bad bytes)."""
    try:
        return decode_blocks(raw.numpy(), fmt, (n, k))
    except ValueError as e:
        raise SpecdraftError(f"cannot read the blocks of {name} ({e}); is the file corrupt?") from None


def matrix_linear(fmt: str, n: int, k: int, raw: torch.Tensor, name: str, kept: list[str]) -> nn.Module:
    """One matrix's linear: the kernel over its own blocks, or (plain floats) compacted as a
    checkpoint's are under q8; float32 where the kernel takes no such shape (named in `kept`)."""
    if fmt in SUPPORTED_BLOCK_FORMATS:
        laid_out = Q8ActLinear.from_file(raw, fmt, n, k)  # Q8_0 / Q4_K / Q6_K: in C, from the bytes
        if laid_out is not None:
            return laid_out
        blocks = matrix_blocks(fmt, n, k, raw, name)
        if Q8ActLinear.takes(blocks):
            return Q8ActLinear(blocks, None)
        weight = blocks.dequantized()
    else:
        weight = raw.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[fmt]).view(n, k).float()
        packed = compact_matrix(weight, None, "q8", torch.float32)
        if packed is not None:
            return packed
    kept.append(name)
    linear = nn.Linear(k, n, bias=False, device="meta")
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return linear


def _expert_linears(fmt: str, t: GGUFTensor, raw: torch.Tensor, name: str, kept: list[str]) -> list[nn.Module]:
    """An [E, N, K] expert stack -> one linear per expert."""
    experts = int(t.shape[2])
    n, k = matrix_shape(t)
    per = raw.numel() // experts
    return [matrix_linear(fmt, n, k, raw[e * per : (e + 1) * per], f"{name}[{e}]", kept) for e in range(experts)]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, attr = _owner(model, name)
    setattr(owner, attr, nn.Parameter(value, requires_grad=False))


def load_gguf(desc: GGUFDescription, progress: bool = True) -> tuple[nn.Module, ModelConfig, list[str]]:
    """The model of a Gemma 4 GGUF, filled from the file's blocks (see the module docstring)."""
    from tqdm import tqdm

    bad = desc.unsupported_tensor()
    if bad is not None:
        raise SpecdraftError(f"{desc.path}: tensor {bad[0]} is stored as {bad[1]}, which specdraft does not read "
                             f"(supported: {', '.join(SUPPORTED_BLOCK_FORMATS)}, F16, BF16, F32)")
    cfg, model = describe_model(desc)
    params = dict(model.named_parameters())
    names = {t: hf_name(t, desc.arch) for t in desc.tensors}
    unused = set(model.unused_checkpoint_tensors([decoder_name(h) for h in names.values() if h]))
    files, kept, split, towers, mapped = FileMap(desc), [], {}, 0, 0
    seen: set[str] = set()
    for t in tqdm(desc.reader.tensors, desc=f"loading {desc.path.name}", unit="tensor", disable=not progress):
        hf = names[t.name]
        if hf is None:
            towers += t.name != "rope_freqs.weight"
            continue
        fmt, raw = t.tensor_type.name, files.raw(t)
        if hf.startswith("blk."):  # half of a split expert stack: joined below, per expert
            _, layer, local, _ = hf.split(".")
            split.setdefault(layer, {})[local] = _expert_linears(fmt, t, raw, t.name, kept)
            seen.add(f"layers.{layer}.experts.gate_up_proj")
            files.release(t)
            continue
        name = decoder_name(hf)
        if name in unused:
            continue
        if name not in params:
            raise SpecdraftError(f"{desc.path}: GGUF tensor {t.name} ({name}) is not one this model's config describes")
        want, got = tuple(params[name].shape), tuple(reversed(t.shape))
        if want != got:
            raise SpecdraftError(f"{desc.path}: tensor {t.name} has shape {got} but the header implies {want}")
        owner, attr = _owner(model, name)
        if name in TABLES:
            rows = int(t.shape[-1])
            table = GGUFEmbedding(raw.view(rows, -1), int(t.shape[0]), _decoder(fmt, int(t.shape[0])), fmt)
            setattr(model, name.split(".")[0], table)
            mapped += raw.numel()
            if name == "embed_tokens.weight" and model.lm_head is None:
                model.packed_head = _head(fmt, rows, int(t.shape[0]), raw, kept)
        elif attr == "weight" and type(owner) is nn.Linear:
            parent, slot = _owner(model, name.removesuffix(".weight"))
            setattr(parent, slot, matrix_linear(fmt, *matrix_shape(t), raw, name, kept))
        elif hasattr(owner, "compact_experts") and attr in owner.expert_parts:
            owner.compact_part(attr, _expert_linears(fmt, t, raw, t.name, kept), lambda m: m)
        else:
            values = float_values(t, raw) if fmt in FLOAT_TYPES else _decoder(fmt, got[-1])(raw.numpy().reshape(-1, t.data.shape[-1]))
            _set_tensor(model, name, values.reshape(want).clone())
        if name not in TABLES:
            files.release(t)
            release_free_memory()  # the matrix's decoding transients (device.py says why)
        seen.add(name)
    _join_split_experts(model, split)
    missing = sorted(n for n in params if n not in seen and n not in unused and not (n == "lm_head.weight"))
    if missing:
        raise SpecdraftError(f"{desc.path}: GGUF lacks {len(missing)} tensor(s) the header implies, e.g. {missing[:3]}")
    model.eval().requires_grad_(False)
    model.mapped_bytes = mapped  # the tables, views of the file: resident only as rows are read
    notes = [f"ignored {towers} tensor(s) of non-text towers (vision/audio)"] if towers else []
    if kept:
        notes.append(f"{len(kept)} matrix(es) of shapes the int8 kernel does not take keep float32 weights: "
                     f"{', '.join(kept[:4])}" + (" ..." if len(kept) > 4 else ""))
    return model, cfg, notes


def _head(fmt: str, rows: int, width: int, raw: torch.Tensor, kept: list[str]) -> nn.Module:
    """The tied LM head: a kernel linear over the token table's own blocks."""
    if fmt in SUPPORTED_BLOCK_FORMATS:
        return matrix_linear(fmt, rows, width, raw, "the LM head", kept)
    holder = nn.Module()
    compact_head(holder, _decoder(fmt, width)(raw.numpy().reshape(rows, -1)), "q8", torch.float32)
    return holder.packed_head


def _join_split_experts(model: nn.Module, split: dict[str, dict[str, list[nn.Module]]]) -> None:
    """Experts kept as separate gate and up stacks: each expert's gate_up_proj computes gate then
    up, as the stacked layout does (Gemma4Experts chunks its output in that order)."""
    for layer, halves in split.items():
        if set(halves) != set(_SPLIT_EXPERTS):
            raise SpecdraftError(f"GGUF layer {layer} has {sorted(halves)} but not both of {list(_SPLIT_EXPERTS)}")
        experts = model.layers[int(layer)].experts
        fused = [_Stacked(g, u) for g, u in zip(halves["ffn_gate_exps"], halves["ffn_up_exps"])]
        experts.compact_part("gate_up_proj", fused, lambda m: m)


class _Stacked(nn.Module):
    """Two linears' outputs side by side (gate, then up): each output is its own linear's bits."""

    def __init__(self, gate: nn.Module, up: nn.Module):
        super().__init__()
        self.gate, self.up = gate, up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.gate(x), self.up(x)], dim=-1)


def tokenizer_folder(desc: GGUFDescription) -> Path:
    """A cache folder holding the file's tokenizer (tokenizer.json, tokenizer_config.json) and the
    config.json its header implies; written once per file, atomically, never any weights."""
    from specdraft.loading.gguf_tokenizer import convert_gguf_tokenizer

    stat = desc.path.stat()
    key = hashlib.sha256(f"{desc.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_root() / "tokenizers" / f"{desc.path.stem}-{key}"
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits, then finds the folder written
        if (folder / "config.json").exists():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            convert_gguf_tokenizer(desc.reader, tmp)
            (tmp / "config.json").write_text(json.dumps(desc.config, indent=2))  # written last: complete
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder

