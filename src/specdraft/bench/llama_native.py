"""A native llama.cpp (its own llama-server), built once into the cache, for the bench's peers.

llama-cpp-python's wheel runs llama.cpp in-process but has no MTP drafting; llama-server does
(`--spec-type draft-mtp` with a Gemma 4 assistant converted by llama.cpp's converter). The tool
`tools/llama_cpp_native.py` builds the binaries with cmake from a llama.cpp source tree into
`$SPECDRAFT_CACHE/llama.cpp/bin` and converts assistants into `$SPECDRAFT_CACHE/llama.cpp/gguf`;
the peers find them here. $SPECDRAFT_LLAMA_CPP_BIN names another folder of binaries.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from specdraft.cache_dir import cache_root

# The same CPU flags as the wheel's build note (bench/__init__.py): AMX off, AVX-512 on.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX512=ON", "-DGGML_AMX_TILE=OFF",
               "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON")
TARGETS = ("llama-server", "llama-bench")
TOOL = "python tools/llama_cpp_native.py"


def native_root() -> Path:
    return cache_root() / "llama.cpp"


def bin_dir() -> Path:
    """Where the peers look for llama-server: $SPECDRAFT_LLAMA_CPP_BIN, else the cache's build."""
    given = os.environ.get("SPECDRAFT_LLAMA_CPP_BIN")
    return Path(given) if given else native_root() / "bin"


def find_binary(name: str = "llama-server") -> Path | None:
    path = bin_dir() / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def binary_env(binary: Path) -> dict[str, str]:
    """The environment a binary runs in: its shared libraries sit beside it."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(binary.parent), env.get("LD_LIBRARY_PATH")) if p)
    return env


def assistant_gguf(folder: str | Path) -> Path:
    """Where the converted GGUF of an assistant folder lives (keyed by the folder's path and its
    weights' size and time, so a rewritten assistant is converted again)."""
    folder = Path(folder).resolve()
    stats = [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(folder.glob("*.safetensors"))]
    key = hashlib.sha256(repr((str(folder), stats)).encode()).hexdigest()[:16]
    return native_root() / "gguf" / f"{folder.name}-{key}-q8_0.gguf"
