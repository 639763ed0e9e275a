"""Every drafter kind `--drafter` names: what it is made of, what --drafter-path names for it,
and how it is built. The CLI's choices, the bench's methods and the loader all read this table.

    auto        mtp+ngram with the drafter shipped for the model, or for a Gemma 4 target Google's
                assistant (official.py); prompt lookup (ngram) where no drafter can be had
    none        plain decoding
    mtp         a Gemma-4-style MTP drafter reading the target's KV cache (mtp/)
    mtp+ngram   prompt lookup where the text repeats itself, the MTP drafter elsewhere (mtp_lookup.py)
    ngram       prompt lookup, training-free (ngram.py)
    draft-model an independent small model with its own KV cache (draft_model.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdraft.drafters.base import Drafter
from specdraft.errors import SpecdraftError

DEFAULT_K = 4
# (name, dtype, device) -> a loaded runtime (Runtime.load): drafters sit below the runtime and are
# handed the loader for a draft model rather than importing it.
LoadRuntime = Callable[[str, str, str], Any]


@dataclass(frozen=True)
class DrafterSettings:
    """What a kind's builder gets: the loaded target, the kind's name, --drafter-path, --draft-tokens."""

    rt: Any  # specdraft.runtime.Runtime (or anything with its model, dtype, device, name)
    kind: str
    path: str | None
    draft_tokens: int | None
    load_runtime: LoadRuntime | None


@dataclass(frozen=True)
class DrafterKind:
    name: str
    parts: tuple[str, ...]  # the drafters it runs: "mtp", "ngram" (prompt lookup), "draft-model"
    path: str | None  # what --drafter-path names for it (None: it reads none)
    # -> (drafter, K); None for `auto`, which load_drafter resolves to another kind first (resolve_auto)
    build: Callable[[DrafterSettings], tuple[Drafter | None, int]] | None


def shipped_drafter_path(model_name: str) -> Path | None:
    """The trained MTP drafter that ships with the package for a preset, if any."""
    from specdraft.loading.presets import PRESETS

    if model_name not in PRESETS:  # a folder or .gguf path: joinpath would return the path itself
        return None
    folder = resources.files("specdraft").joinpath("drafters", "shipped", model_name)
    path = Path(str(folder))
    return path if (path / "config.json").exists() else None


def _lookup_budget(rt: Any) -> int | None:
    """The widest verify that costs about one pass over packed weights (Runtime.verify_width_budget)."""
    return getattr(rt, "verify_width_budget", None)


def _none(b: DrafterSettings) -> tuple[Drafter | None, int]:
    return None, 0


def _ngram(b: DrafterSettings) -> tuple[Drafter | None, int]:
    from specdraft.drafters.ngram import NgramDrafter

    budget = _lookup_budget(b.rt)
    default = min(DEFAULT_K, budget - 1) if budget else DEFAULT_K
    return NgramDrafter(), b.draft_tokens if b.draft_tokens is not None else default


def _mtp(b: DrafterSettings) -> tuple[Drafter | None, int]:
    from specdraft.drafters.mtp import load_mtp_drafter

    path = b.path
    if path is None:  # the drafter shipped for this model, if one is
        shipped = shipped_drafter_path(b.rt.name)
        if shipped is None:
            raise SpecdraftError(f"--drafter {b.kind}: no drafter ships for {b.rt.name}; give --drafter-path "
                                 "(a drafter folder, see `specdraft train-drafter`)")
        path = str(shipped)
    drafter = load_mtp_drafter(resolve_drafter_path(path), b.rt.model, b.rt.dtype, b.rt.device)
    return drafter, b.draft_tokens if b.draft_tokens is not None else drafter.recommended_k or DEFAULT_K


def _mtp_with_lookup(b: DrafterSettings) -> tuple[Drafter | None, int]:
    from specdraft.drafters.mtp_lookup import LOOKUP_TOKENS, MTPWithLookup

    mtp, k = _mtp(b)
    # Lookups propose up to LOOKUP_TOKENS, fewer where a wider verify costs another pass over the weights.
    budget = _lookup_budget(b.rt)
    lookup = min(LOOKUP_TOKENS, max(k, budget - 1)) if budget else LOOKUP_TOKENS
    return MTPWithLookup(mtp, lookup_tokens=lookup), k


def _draft_model(b: DrafterSettings) -> tuple[Drafter | None, int]:
    from specdraft.drafters.draft_model import DraftModelDrafter

    if b.path is None:
        raise SpecdraftError("--drafter draft-model needs --drafter-path (a model name or path)")
    if b.load_runtime is None:
        raise ValueError("load_drafter: draft-model needs load_runtime")
    draft_rt = b.load_runtime(b.path, b.rt.dtype_name, str(b.rt.device))
    return DraftModelDrafter.sharing_tokenizer(b.rt, draft_rt), b.draft_tokens if b.draft_tokens is not None \
        else DEFAULT_K


MTP_FOLDER = ("a drafter folder (config.json + model.safetensors; default: the one shipped for the model) or a "
              "gemma4-assistant GGUF")
KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind("auto", ("mtp", "ngram"), None, None),
    DrafterKind("none", (), None, _none),
    DrafterKind("mtp", ("mtp",), MTP_FOLDER, _mtp),
    DrafterKind("mtp+ngram", ("mtp", "ngram"), MTP_FOLDER, _mtp_with_lookup),
    DrafterKind("ngram", ("ngram",), None, _ngram),
    DrafterKind("draft-model", ("draft-model",), "a model name or path, as for --model", _draft_model),
)}
DRAFTER_KINDS = tuple(KINDS)  # --drafter's choices
MTP_KINDS = tuple(name for name, k in KINDS.items() if "mtp" in k.parts and k.path is not None)  # read an MTP drafter


AUTO_WITH_DRAFTER = "mtp+ngram"  # what `auto` runs where a drafter ships for the model
# Where none does: prompt lookup, which needs no weights and drafts only where the text repeats
# itself (a round without a match is a plain step): 1.19x plain on SmolLM2-135M-Instruct, never
# below plain in a Spec-Bench category (BENCHMARKS.md, "`auto` runs prompt lookup where no drafter ships").
AUTO_WITHOUT_DRAFTER = "ngram"


def resolve_auto(model_name: str, folder: Path | None = None) -> tuple[str, str | None]:
    """What `auto` runs for this model (loaded from `folder`): (kind, drafter folder)."""
    shipped = shipped_drafter_path(model_name)
    if shipped is not None:
        return AUTO_WITH_DRAFTER, str(shipped)
    if folder is not None:
        from specdraft.drafters.official import assistant_id, find_assistant
        from specdraft.loading.presets import read_config

        if assistant_id(model_name, read_config(folder), folder) is not None:
            found = find_assistant(model_name, folder)
            if found is not None:
                return AUTO_WITH_DRAFTER, str(found)
    return AUTO_WITHOUT_DRAFTER, None


def resolve_drafter_path(path: str) -> Path:
    """--drafter-path: a folder or file here, or a Hugging Face id (fetched into its cache)."""
    from specdraft.loading import hub

    if hub.is_hub_id(path):
        return hub.resolve(path, text_only=False)
    return Path(path).expanduser()


def load_drafter(rt: Any, kind: str, path: str | None, draft_tokens: int | None,
                 load_runtime: LoadRuntime | None = None) -> tuple[Drafter | None, str, int]:
    """Resolve --drafter/--drafter-path/--draft-tokens into (drafter, kind actually used, K). How
    many drafts a round carries is the engine's draft policy; `load_runtime(name, dtype, device)`
    loads a draft model (Runtime.load). K is checked by the engine."""
    if kind == "auto":
        kind, path = resolve_auto(rt.name, getattr(rt, "folder", None))
    if kind not in KINDS:
        raise SpecdraftError(f"unknown drafter kind {kind!r} (use {', '.join(DRAFTER_KINDS)})")
    drafter, k = KINDS[kind].build(DrafterSettings(rt, kind, path, draft_tokens, load_runtime))
    return drafter, kind, k
