"""Drafters: who proposes the tokens the target verifies.

- mtp: Gemma-4-style multi-token-prediction drafter reading the target's KV cache (mtp.py)
- ngram: prompt lookup, training-free (ngram.py)
- draft-model: an independent small model with its own KV cache (draft_model.py)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.errors import SpecdraftError

DEFAULT_K = 4


def shipped_drafter_path(model_name: str) -> Path | None:
    """The trained MTP drafter that ships with the package for a preset, if any."""
    from specdraft.loading.presets import PRESETS

    if model_name not in PRESETS:  # a folder or .gguf path: joinpath would return the path itself
        return None
    folder = resources.files("specdraft").joinpath("drafters", "shipped", model_name)
    path = Path(str(folder))
    return path if (path / "config.json").exists() else None


def load_drafter(rt, kind: str, path: str | None, draft_tokens: int | None) -> tuple[Drafter | None, str, int]:
    """Resolve --drafter/--drafter-path/--draft-tokens into (drafter, kind actually used, K)."""
    if draft_tokens is not None and draft_tokens < 1:
        raise SpecdraftError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    if kind == "auto":
        shipped = shipped_drafter_path(rt.name)
        if shipped is None:
            return None, "none", 0
        kind, path = "mtp", str(shipped)
    if kind == "none":
        return None, "none", 0
    if kind == "ngram":
        from specdraft.drafters.ngram import NgramDrafter

        return NgramDrafter(), kind, draft_tokens or DEFAULT_K
    if kind == "mtp":
        from specdraft.drafters.mtp import load_mtp_drafter

        if path is None:
            raise SpecdraftError("--drafter mtp needs --drafter-path (a drafter folder)")
        drafter = load_mtp_drafter(Path(path), rt.model, rt.dtype, rt.device)
        return drafter, kind, draft_tokens or drafter.recommended_k or DEFAULT_K
    if kind == "draft-model":
        from specdraft.drafters.draft_model import DraftModelDrafter

        if path is None:
            raise SpecdraftError("--drafter draft-model needs --drafter-path (a model name or path)")
        return DraftModelDrafter.load(path, rt), kind, draft_tokens or DEFAULT_K
    raise SpecdraftError(f"unknown drafter kind {kind!r} (use auto, none, mtp, ngram or draft-model)")


__all__ = ["Draft", "Drafter", "DraftInput", "load_drafter", "shipped_drafter_path"]
