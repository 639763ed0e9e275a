"""A Gemma 4 assistant GGUF (llama.cpp's `gemma4-assistant`) loaded from its own blocks, beside a
target whose linears run on the C kernels (beside a float target it is dequantised instead:
checkpoint.load_network).

As a Gemma 4 target GGUF is (loading/gguf_direct.py): the network is built on the meta device
from the header's config, checked against the target and counted against the memory left
(loading/footprint.check_gguf_drafter_fits) before any weight is read, then filled from a
private map of the file:
- every matrix becomes an int8-activation kernel linear over its own blocks (Q8ActLinear), each
  MLP's gate and up stacked into one, as kernels_like_target makes them for a checkpoint;
- the token table `token_embd` is the dense head itself, a kernel linear over its blocks
  (`MTPNetwork.packed_head`): the drafter never looks its rows up (its input rows are the
  target's), so no view or float copy of it stays;
- norms, the layer scalars and q_norm are float32 tensors (llama.cpp stores them as Hugging Face does).

llama.cpp's converter leaves out the clustered head ("efficient embedder") of E2B's and E4B's
assistants, so such a file drafts with a dense head over its own table, as llama.cpp's
assistant graph does; that is said once per file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from specdraft.device import release_free_memory
from specdraft.drafters.mtp.config import MTPConfig
from specdraft.drafters.mtp.network import MTPNetwork
from specdraft.errors import SpecdraftError
from specdraft.loading.footprint import check_gguf_drafter_fits
from specdraft.loading.gguf_blocks import SUPPORTED_BLOCK_FORMATS
from specdraft.loading.gguf_description import GGUFDescription, assistant_config_dict, describe_gguf
from specdraft.loading.gguf_direct import FileMap, matrix_blocks, matrix_linear, matrix_shape, tensor_values
from specdraft.loading.gguf_file import hf_name
from specdraft.loading.gguf_reader import GGUFTensor
from specdraft.models.formats import q8_act_linear
from specdraft.models.formats.block_linear import stack_blocks
from specdraft.models.formats.q8_act_linear import Q8ActLinear
from specdraft.models.kernels.decoder_layer import kernel_linear

TABLE = "model.embed_tokens.weight"
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_noted: set[Path] = set()  # files whose missing clustered head was said


def loads_from_blocks(path: Path, target: nn.Module, dtype: torch.dtype, device) -> bool:
    """Whether this drafter path is a GGUF that loads from its own blocks here: float32 inference
    on a CPU whose build runs the int8 kernel, beside a target whose linears run on the kernels
    (a GGUF target, or --weights q8, gguf, fp16...), as kernels_like_target makes a checkpoint
    drafter's. Beside a float target the file is dequantised instead (a small drafter), so the
    drafter computes in float as the target does."""
    return (path.is_file() and path.suffix == ".gguf" and dtype == torch.float32
            and torch.device(device).type == "cpu" and q8_act_linear.kernel_available()
            and any(kernel_linear(m) for m in target.modules()))


def load_gguf_network(path: Path, cfg: MTPConfig) -> MTPNetwork:
    """The network of a gemma4-assistant GGUF whose config `cfg` the caller has checked against
    its target (checkpoint.kv_sources), from the file's blocks (see the module docstring), after
    counting it against the memory left."""
    assistant_config_dict(path)  # refuses a file that is not a drafter
    desc = describe_gguf(path)
    check_gguf_drafter_fits(desc, path.name)
    bad = desc.unsupported_tensor()
    if bad is not None:
        raise SpecdraftError(f"{path}: tensor {bad[0]} is stored as {bad[1]}, which specdraft does not read "
                             f"(supported: {', '.join(SUPPORTED_BLOCK_FORMATS)}, F16, BF16, F32)")
    with torch.device("meta"):
        net = MTPNetwork(cfg)
    _fill(net, desc)
    if path not in _noted:
        _noted.add(path)
        print(f"specdraft: note: {path.name} carries no clustered head (llama.cpp's converter leaves out E2B's and "
              f"E4B's): the drafter scores all {cfg.vocab_size} tokens with a dense head over its own table",
              file=sys.stderr, flush=True)
    return net.eval().requires_grad_(False)


def _fill(net: MTPNetwork, desc: GGUFDescription) -> None:
    """Every tensor of the file into `net`, in place of its meta tensors (one matrix's decoding
    transients at a time, its pages handed back after it)."""
    expected = dict(net.named_parameters()) | dict(net.named_buffers())
    files, kept, seen = FileMap(desc), [], set()
    halves: dict[str, list[tuple[GGUFTensor, torch.Tensor] | None]] = {}  # an MLP's gate and up, until both are read
    for t in desc.reader.tensors:
        name = hf_name(t.name, desc.arch)
        if name is None:  # rope_freqs (in the config), a clustered head (not read)
            continue
        if name not in expected:
            raise SpecdraftError(f"{desc.path}: GGUF tensor {t.name} ({name}) is not one this drafter's config describes")
        want, got = tuple(expected[name].shape), tuple(int(d) for d in reversed(t.shape))
        if want != got:
            raise SpecdraftError(f"{desc.path}: tensor {t.name} has shape {got} but the header implies {want}")
        raw = files.raw(t)
        owner_name, _, attr = name.rpartition(".")
        owner = net.get_submodule(owner_name)
        if name == TABLE:
            net.packed_head = matrix_linear(t.tensor_type.name, *matrix_shape(t), raw, "the drafter's head", kept)
            net.model.embed_tokens = None  # the head is the table: no rows are looked up
        elif type(owner) is nn.Linear and attr == "weight":
            parent_name, _, slot = owner_name.rpartition(".")
            if slot in _GATE_UP:
                pair = halves.setdefault(parent_name, [None, None])
                pair[_GATE_UP[slot]] = (t, raw)
                if all(pair):
                    _set_gate_up(net.get_submodule(parent_name), pair, parent_name, kept)
                    for half, _ in pair:
                        files.release(half)
            else:
                linear = matrix_linear(t.tensor_type.name, *matrix_shape(t), raw, name, kept)
                setattr(net.get_submodule(parent_name), slot, linear)
                files.release(t)
            release_free_memory()  # the matrix's decoding transients (device.py says why)
        else:
            value = tensor_values(t, raw).reshape(want).clone()
            if attr in owner._buffers:
                owner._buffers[attr] = value
            else:
                setattr(owner, attr, nn.Parameter(value, requires_grad=False))
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise SpecdraftError(f"{desc.path}: GGUF lacks {len(missing)} tensor(s) the header implies, e.g. {missing[:3]}")
    if kept:
        print(f"specdraft: note: {len(kept)} drafter matrix(es) of shapes the int8 kernel does not take keep float32 "
              f"weights: {', '.join(kept[:4])}", file=sys.stderr, flush=True)


def _set_gate_up(mlp: nn.Module, pair: list, name: str, kept: list[str]) -> None:
    """gate and up as one linear (gate's outputs first), as GatedMLP.fuse_projections makes it:
    their blocks stacked (regrouped to the smaller group where the formats differ), or, where
    either is stored as plain floats, their values stacked and compacted."""
    (gate, gate_raw), (up, up_raw) = pair
    n, k = matrix_shape(gate)
    fmts = {gate.tensor_type.name, up.tensor_type.name}
    if fmts <= set(SUPPORTED_BLOCK_FORMATS):
        blocks = stack_blocks([matrix_blocks(gate.tensor_type.name, n, k, gate_raw, f"{name}.gate_proj"),
                               matrix_blocks(up.tensor_type.name, *matrix_shape(up), up_raw, f"{name}.up_proj")])
        if Q8ActLinear.takes(blocks):
            fused = Q8ActLinear(blocks, None)
        else:
            kept.append(f"{name}.gate_up_proj")
            fused = nn.Linear(k, 2 * n, bias=False, device="meta")
            fused.weight = nn.Parameter(blocks.dequantized(), requires_grad=False)
    else:
        values = torch.cat([tensor_values(gate, gate_raw), tensor_values(up, up_raw)]).contiguous()
        fused = matrix_linear("F32", 2 * n, k, values.view(torch.uint8).reshape(-1), f"{name}.gate_up_proj", kept)
    mlp.gate_up_proj = fused
    del mlp.gate_proj, mlp.up_proj
