"""Hugging Face Hub ids (`org/name` or `org/name@revision`) -> a folder in the Hugging Face cache.

Everything goes through huggingface_hub: its cache ($HF_HOME, $HF_HUB_CACHE), its progress bars,
its retries (a cut transfer is retried in the run), $HF_TOKEN, $HF_HUB_OFFLINE and $HF_ENDPOINT
(read when a command runs, not when the library was imported). Weight shards are fetched into
its cache so that a run that gives up mid-file leaves the part it got, and the next run goes on
from there (hub_resume.py); files already fetched stay, so a rerun fetches only what is missing.
A local folder or file never comes here (presets.resolve_model tries them first).

The order matters: config.json comes first, alone, and `before_download` (the memory check, from
a model built on the meta device) runs on it, so a model that cannot fit is refused before a byte
of its weights is fetched; then what will be fetched is said (files, GB) and only the files the
loader reads are downloaded: config, tokenizer, chat template, generation config and the
safetensors shards that hold text-decoder tensors (shards of only vision/audio towers are skipped
where the index says so).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.loading.hub_resume import fetch_shards

# org/name as the Hub spells repository ids, and an optional @revision (a branch, tag or commit).
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[A-Za-z0-9_./-]+))?")
METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "model.safetensors.index.json")
INDEX = "model.safetensors.index.json"
GB = 1e9


def is_hub_id(name: str) -> bool:
    """`org/name[@revision]` that is not a path on this machine (a local path always wins)."""
    if name.startswith((".", "/", "~")) or name.endswith(".gguf") or Path(name).expanduser().exists():
        return False
    return HUB_ID.fullmatch(name) is not None


def split_id(name: str) -> tuple[str, str | None]:
    m = HUB_ID.fullmatch(name)
    if m is None:
        raise SpecdraftError(f"{name!r} is not a Hugging Face id (org/name or org/name@revision)")
    return m.group("repo"), m.group("rev")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _options() -> dict:
    """huggingface_hub's settings as the environment says now (the library reads them at import)."""
    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME")
                                               else None)
    return {"endpoint": os.environ.get("HF_ENDPOINT") or None, "token": os.environ.get("HF_TOKEN") or None,
            "cache_dir": cache}


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise SpecdraftError("a Hugging Face id needs huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


def config_folder(name: str) -> Path:
    """The cache folder holding the id's config.json (fetched alone if it is not cached)."""
    repo, rev = split_id(name)
    hub = _hub()
    try:
        path = hub.hf_hub_download(repo, "config.json", revision=rev, local_files_only=offline(), **_options())
    except Exception as e:
        raise _one_line(e, name) from None
    return Path(path).parent


def cached_folder(name: str, text_only: bool = True) -> Path | None:
    """The id's complete folder in the local cache, or None; never touches the network."""
    try:
        return _local_snapshot(name, text_only)
    except SpecdraftError:
        return None


def resolve(name: str, progress: bool = True, before_download: Callable[[Path], None] | None = None,
            text_only: bool = True) -> Path:
    """The id's folder in the Hugging Face cache, downloading what is missing (unless offline).
    `before_download(folder with config.json)` runs before any weight is fetched; `text_only`
    skips shards that hold only vision/audio towers."""
    local = cached_folder(name, text_only)
    if local is not None:
        return local
    if offline():
        raise SpecdraftError(f"{name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it once "
                             "with the network on (or unset HF_HUB_OFFLINE)")
    folder = config_folder(name)
    if before_download is not None:
        before_download(folder)
    repo, rev = split_id(name)
    hub, opts = _hub(), _options()
    try:
        plan = hub.snapshot_download(repo, revision=rev, allow_patterns=_patterns(), dry_run=True, **opts)
        files = _wanted([f.filename for f in plan], folder, repo, rev, text_only)
        fetch = [f for f in plan if f.filename in files and f.will_download]
        if fetch and progress:
            size = sum(f.file_size or 0 for f in fetch)
            print(f"specdraft: fetching {name}: {len(fetch)} file(s), {size / GB:.2f} GB, into the Hugging Face "
                  "cache (an interrupted run leaves what it got: a rerun fetches only the rest)", file=sys.stderr,
                  flush=True)
        if fetch:  # the shards first, resumable across runs; then the rest, and the snapshot's links
            fetch_shards(repo, fetch[0].commit_hash or rev, [f.filename for f in fetch], opts)
        path = hub.snapshot_download(repo, revision=rev, allow_patterns=files, **opts)
    except SpecdraftError:
        raise
    except Exception as e:
        raise _one_line(e, name) from None
    return Path(path)


def _patterns() -> list[str]:
    return list(METADATA) + ["*.safetensors"]


def _local_snapshot(name: str, text_only: bool) -> Path:
    """The cached snapshot, complete for what the loader reads, else SpecdraftError."""
    repo, rev = split_id(name)
    hub = _hub()
    try:
        folder = Path(hub.snapshot_download(repo, revision=rev, allow_patterns=list(METADATA), local_files_only=True,
                                            **_options()))
    except Exception as e:
        raise _one_line(e, name) from None
    names = [p.name for p in folder.iterdir()]
    missing = [f for f in _wanted(names, folder, repo, rev, text_only, local=True) if not (folder / f).exists()]
    if missing or not any(n.endswith(".safetensors") for n in names):
        raise SpecdraftError(f"{name}: the cached copy lacks {missing or 'its weights'}")
    return folder


def _wanted(names: list[str], folder: Path, repo: str, rev: str | None, text_only: bool, local: bool = False
            ) -> list[str]:
    """Of a repository's top-level files, those the loader reads: the metadata and the weight
    shards (per the index, those holding a text-decoder tensor when `text_only`)."""
    top = [n for n in names if "/" not in n]
    keep = [n for n in top if n in METADATA]
    if INDEX not in top:
        return keep + [n for n in top if fnmatch.fnmatch(n, "*.safetensors")]
    index = folder / INDEX
    if not index.exists() and not local:
        index = Path(_hub().hf_hub_download(repo, INDEX, revision=rev, **_options()))
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    if text_only:
        from specdraft.loading.weights import decoder_name

        shards = {f for t, f in weight_map.items() if decoder_name(t) is not None}
    else:
        shards = set(weight_map.values())
    return keep + sorted(shards)


def _one_line(e: Exception, name: str) -> SpecdraftError:
    """huggingface_hub's and the network's errors, as one line saying what to do."""
    hub = _hub()
    errors = hub.errors
    kind = type(e).__name__
    if isinstance(e, SpecdraftError):
        return e
    if isinstance(e, errors.GatedRepoError):
        return SpecdraftError(f"{name} is gated: accept its license on its Hugging Face page and set HF_TOKEN to a "
                              "token with access")
    if isinstance(e, errors.RevisionNotFoundError):
        return SpecdraftError(f"{name}: no such revision on the Hugging Face Hub")
    if isinstance(e, errors.RepositoryNotFoundError):
        return SpecdraftError(f"{name}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN)")
    if isinstance(e, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
        return SpecdraftError(f"{name}: the repository has no config.json (not a Hugging Face model)")
    if isinstance(e, errors.OfflineModeIsEnabled) or (isinstance(e, errors.LocalEntryNotFoundError) and offline()):
        return SpecdraftError(f"{name} is not (completely) in the Hugging Face cache and HF_HUB_OFFLINE is set")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return SpecdraftError(f"cannot reach the Hugging Face Hub for {name}, and it is not in the local cache "
                              "(check the network, or set HF_HUB_OFFLINE=1 to use only cached models)")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        if status in (401, 403):
            return SpecdraftError(f"{name}: access denied by the Hugging Face Hub ({status}); set HF_TOKEN to a token "
                                  "with access")
        return SpecdraftError(f"{name}: the Hugging Face Hub answered {status}; try again later")
    if isinstance(e, OSError) or "httpx" in type(e).__module__:
        return SpecdraftError(f"downloading {name} failed ({kind}: {' '.join(str(e).split())[:120]}); run the "
                              "command again: it fetches what is still missing")
    return SpecdraftError(f"{name}: {kind}: {' '.join(str(e).split())[:160]}")
