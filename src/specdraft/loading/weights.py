"""Reading safetensors files and assigning their tensors to a model, with clear errors.

Only safetensors are read (never pickle), so loading a checkpoint never executes its code.
"""

from __future__ import annotations

import json
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
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise SpecdraftError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
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


def text_decoder_weights(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Strip wrapper prefixes; return (weights named as our modules name them, ignored tower names)."""
    out: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for name, tensor in state.items():
        if name.startswith(IGNORED_PREFIXES):
            ignored.append(name)
            continue
        if name.endswith("lm_head.weight"):
            out["lm_head.weight"] = tensor
            continue
        for prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        out[name] = tensor
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
