"""Loading targets: presets, Hugging Face folders and GGUF files, all through one entry point."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.config import ModelConfig
from specdraft.errors import SpecdraftError
from specdraft.loading.presets import DEFAULT_MODEL, PRESETS, resolve_model
from specdraft.loading.weights import assign_weights, read_safetensors, safetensors_files, text_decoder_weights
from specdraft.models.architectures.hf_config import read_model_config


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecdraftError(f"{folder}: no config.json") from None
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{path}: invalid JSON ({e})") from None


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    if cfg.family == "gemma4":
        from specdraft.models.architectures.gemma4 import Gemma4Transformer

        return Gemma4Transformer(cfg)
    from specdraft.models.architectures.decoder import Transformer

    return Transformer(cfg)


def load_folder(folder: Path, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.nn.Module, ModelConfig, list[str]]:
    """Build the model a HF folder's config.json describes and fill it with its safetensors weights."""
    cfg = read_model_config(read_config(folder))
    with torch.device("meta"):
        model = build_model(cfg)
    state, ignored = text_decoder_weights(read_safetensors(safetensors_files(folder)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Gemma 4: some exports keep K/V weights for KV-shared layers, which compute no K/V.
    for name in getattr(model, "unused_checkpoint_tensors", lambda names: [])(list(state)):
        del state[name]
    assign_weights(model, state, dtype, device)
    model.eval().requires_grad_(False)
    notes = [f"ignored {len(ignored)} tensor(s) of non-text towers (vision/audio)"] if ignored else []
    return model, cfg, notes


__all__ = ["DEFAULT_MODEL", "PRESETS", "load_folder", "resolve_model", "build_model"]
