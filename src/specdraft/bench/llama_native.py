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
from specdraft.device import cpu_flags

# llama.cpp's x86 extensions by the /proc/cpuinfo flag that says the CPU has them. A build for
# the machine takes every one it has but AMX (llama.cpp's AMX path crashed at load on an AMX
# Xeon); GGML_NATIVE would take AMX too, and a fixed list either leaves VNNI out (slower int8 dot
# products than llama.cpp's users get) or puts AVX-512 on a CPU without it (illegal instructions).
GGML_CPU_OPTIONS = (("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"),
                    ("avx_vnni", "GGML_AVX_VNNI"))
BUILD_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=ON")


def ggml_cpu_flags(flags: set[str] | frozenset[str] | None = None) -> tuple[str, ...]:
    """ggml's CPU options for this CPU (or for one with `flags`): not native, AMX off, AVX2, FMA
    and F16C as llama.cpp's non-native default, each AVX-512 / VNNI extension on where it is there."""
    have = cpu_flags() if flags is None else flags
    fixed = ("-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
    return fixed + tuple(f"-D{option}={'ON' if flag in have else 'OFF'}" for flag, option in GGML_CPU_OPTIONS)


def cmake_flags(flags: set[str] | frozenset[str] | None = None) -> tuple[str, ...]:
    """cmake options for llama.cpp's binaries built for this CPU (or for one with `flags`)."""
    return BUILD_FLAGS + ggml_cpu_flags(flags)


TARGETS = ("llama-server", "llama-bench", "llama-quantize")
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
