"""Loading targets: presets, Hugging Face folders and GGUF files, all through one entry point."""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.config import ModelConfig
from specdraft.device import release_free_memory
from specdraft.errors import SpecdraftError
from specdraft.loading.presets import DEFAULT_MODEL, PRESETS, read_config, resolve_model
from specdraft.loading.weights import MappedSafetensors, decoder_name, safetensors_files
from specdraft.models.architectures.hf_config import read_model_config
from specdraft.models.formats.quant import BLOCK_FORMATS
from specdraft.models.formats.streaming import StreamingCompactor


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    if cfg.family == "gemma4":
        from specdraft.models.architectures.gemma4 import Gemma4Transformer

        return Gemma4Transformer(cfg)
    from specdraft.models.architectures.decoder import Transformer

    return Transformer(cfg)


def describe_folder(folder: Path) -> tuple[ModelConfig, torch.nn.Module]:
    """The config and the model it describes, built on the meta device (shapes, no memory)."""
    cfg = read_model_config(read_config(folder))
    with torch.device("meta"):
        return cfg, build_model(cfg)


def matrix_parameters(model: torch.nn.Module) -> int:
    """Parameters of the decoder layers and the head (tables read a row per token excluded)."""
    head = model.lm_head.weight if getattr(model, "lm_head", None) is not None else model.embed_tokens.weight
    return sum(p.numel() for p in model.layers.parameters()) + head.numel()


def load_folder(folder: Path, dtype: torch.dtype, device: torch.device | str, weights: str = "dtype"
                ) -> tuple[torch.nn.Module, ModelConfig, list[str]]:
    """Build the model a HF folder's config.json describes and fill it with its safetensors
    weights, one tensor at a time: each is converted (or, for q8 / q4, compacted) and its pages
    of the file handed back before the next, so loading needs about the final model plus one
    matrix, never the whole checkpoint in memory."""
    cfg, model = describe_folder(folder)
    files = safetensors_files(folder)  # a missing shard fails before any work
    compactor = StreamingCompactor(model, weights, dtype, device) if weights in BLOCK_FORMATS else None
    expected = dict(model.named_parameters())
    unused = set(getattr(model, "unused_checkpoint_tensors", lambda names: [])(list(expected) + _all_names(files)))
    seen: set[str] = set()
    ignored = unexpected = mapped = 0
    first_unexpected: list[str] = []
    for path in files:
        shard = MappedSafetensors(path)
        for stored in shard.names():
            name = decoder_name(stored)
            if name is None:
                ignored += 1
                continue
            if name in unused or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name not in expected:
                unexpected += 1
                first_unexpected.append(name)
                continue
            tensor = shard.tensor(stored)
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise SpecdraftError(f"tensor {name} has shape {tuple(tensor.shape)} but the config implies "
                                     f"{tuple(expected[name].shape)}")
            compacted = compactor is not None and compactor.takes(name)
            keep = compactor.put(name, tensor) if compacted else True
            if keep:
                as_stored = compactor is not None and name in LOOKUP_TABLES
                set_parameter(model, name, tensor if as_stored else tensor.to(device=device, dtype=dtype))
                mapped += tensor.numel() * tensor.element_size() if as_stored else 0
            shard.release(stored)  # a view kept as stored re-reads the rows it needs from the file
            if compacted:
                release_free_memory()  # the compaction's float32 transients (device.py says why)
            seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise SpecdraftError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[:3]}")
    if unexpected:
        raise SpecdraftError(f"checkpoint has {unexpected} tensor(s) the config does not describe, "
                             f"e.g. {first_unexpected[:3]}")
    model.eval().requires_grad_(False)
    model.mapped_bytes = mapped  # tables read from the file a row at a time: resident only as read
    notes = [f"ignored {ignored} tensor(s) of non-text towers (vision/audio)"] if ignored else []
    return model, cfg, notes


# Tables read a row per token: under q8 / q4 they stay as the checkpoint stores them, views of
# the file (only the rows read become resident); their rows are widened exactly when used.
LOOKUP_TABLES = ("embed_tokens.weight", "embed_tokens_per_layer.weight")


def _all_names(files: list[Path]) -> list[str]:
    return [n for path in files for stored in MappedSafetensors(path).names() if (n := decoder_name(stored))]


def set_parameter(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


__all__ = ["DEFAULT_MODEL", "PRESETS", "load_folder", "describe_folder", "matrix_parameters", "resolve_model", "build_model"]
