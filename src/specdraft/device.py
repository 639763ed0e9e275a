"""Choosing the device and dtype: `auto` means the fastest exact-enough option here."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@lru_cache(maxsize=1)
def cpu_has_bf16_units() -> bool:
    """True on CPUs with AMX or AVX512-BF16, where bf16 matmuls beat fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SpecdraftError("--device cuda requested but no CUDA device is available (this torch build: "
                             f"{torch.__version__})")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise SpecdraftError(f"unknown device {name!r} (use auto, cpu or cuda)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or cpu_has_bf16_units():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r} (use auto, float32 or bfloat16)")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
