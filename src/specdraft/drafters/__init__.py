"""Drafters: who proposes the tokens the target verifies.

- mtp: Gemma-4-style multi-token-prediction drafter reading the target's KV cache (mtp/)
- ngram: prompt lookup, training-free (ngram.py)
- mtp+ngram: prompt lookup where the text repeats itself, the MTP drafter elsewhere (mtp_lookup.py)
- draft-model: an independent small model with its own KV cache (draft_model.py)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Callable

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


def load_drafter(rt, kind: str, path: str | None, draft_tokens: int | None,
                 load_runtime: Callable[[str, str, str], Any] | None = None) -> tuple[Drafter | None, str, int]:
    """Resolve --drafter/--drafter-path/--draft-tokens into (drafter, kind actually used, K).
    `auto` is mtp+ngram with the drafter shipped for the model (none if none ships); how
    many rows may draft at once is the engine's policy (Runtime.speculate_below). `load_runtime(name, dtype,
    device)` loads a draft model (`Runtime.load`); drafters sit below the runtime and are
    handed the loader rather than importing it."""
    if draft_tokens is not None and draft_tokens < 1:
        raise SpecdraftError(f"--draft-tokens must be >= 1, got {draft_tokens}")
    if kind == "auto":
        shipped = shipped_drafter_path(rt.name)
        if shipped is None:
            return None, "none", 0
        kind, path = "mtp+ngram", str(shipped)
    if kind == "none":
        return None, "none", 0
    if kind == "ngram":
        from specdraft.drafters.ngram import NgramDrafter

        budget = getattr(rt, "verify_width_budget", None)
        return NgramDrafter(), kind, draft_tokens or (min(DEFAULT_K, budget - 1) if budget else DEFAULT_K)
    if kind in ("mtp", "mtp+ngram"):
        from specdraft.drafters.mtp import load_mtp_drafter
        from specdraft.drafters.mtp_lookup import LOOKUP_TOKENS, MTPWithLookup

        if path is None:  # the drafter shipped for this model, if one is
            shipped = shipped_drafter_path(rt.name)
            if shipped is None:
                raise SpecdraftError(f"--drafter {kind}: no drafter ships for {rt.name}; give --drafter-path "
                                     "(a drafter folder, see `specdraft train-drafter`)")
            path = str(shipped)
        drafter = load_mtp_drafter(Path(path), rt.model, rt.dtype, rt.device)
        k = draft_tokens or drafter.recommended_k or DEFAULT_K
        if kind == "mtp":
            return drafter, kind, k
        # Lookups propose up to 8 tokens, fewer where a wider verify costs another pass over the weights.
        budget = getattr(rt, "verify_width_budget", None)
        lookup = min(LOOKUP_TOKENS, max(k, budget - 1)) if budget else LOOKUP_TOKENS
        return MTPWithLookup(drafter, lookup_tokens=lookup), kind, k
    if kind == "draft-model":
        from specdraft.drafters.draft_model import DraftModelDrafter

        if path is None:
            raise SpecdraftError("--drafter draft-model needs --drafter-path (a model name or path)")
        if load_runtime is None:
            raise ValueError("load_drafter: draft-model needs load_runtime")
        draft_rt = load_runtime(path, rt.dtype_name, str(rt.device))
        return DraftModelDrafter.sharing_tokenizer(rt, draft_rt), kind, draft_tokens or DEFAULT_K
    raise SpecdraftError(f"unknown drafter kind {kind!r} (use auto, none, mtp, mtp+ngram, ngram or draft-model)")


__all__ = ["Draft", "Drafter", "DraftInput", "load_drafter", "shipped_drafter_path"]
