"""Choosing the device and dtype: `auto` means the fastest exact-enough option here."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@lru_cache(maxsize=4)
def _cpuinfo_field(name: str) -> str:
    """The value of /proc/cpuinfo's first `name` line (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.startswith(name)), "")
    return line.partition(":")[2].strip()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"; empty where there is none)."""
    return _cpuinfo_field("vendor_id")


def cpu_has_bf16_units() -> bool:
    """True on CPUs with AMX or AVX512-BF16, where bf16 matmuls beat fp32."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> a device this machine has; anything else is a
    one-line SpecdraftError (torch would accept `cuda:7` here and fail later, deep in a load)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    index_text = name.removeprefix("cuda:") if name.startswith("cuda:") else None
    if name != "cuda" and (index_text is None or not index_text.isdigit()):
        raise SpecdraftError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise SpecdraftError(f"--device {name} requested but no CUDA device is available (this torch build: "
                             f"{torch.__version__})")
    if index_text is not None:
        count = torch.cuda.device_count()
        if int(index_text) >= count:
            raise SpecdraftError(f"--device {name} requested but this machine has {count} CUDA device(s) "
                                 f"(cuda:0..cuda:{count - 1})")
    return torch.device(name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def physical_cores() -> int:
    """Cores, not hardware threads: a second OpenMP thread on a sibling hyperthread only waits."""
    try:
        pairs = set()
        cpu, core = None, None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("physical id"):
                cpu = line.split(":")[1].strip()
            elif line.startswith("core id"):
                core = line.split(":")[1].strip()
                pairs.add((cpu, core))
        usable = len(os.sched_getaffinity(0))
        return max(1, min(len(pairs) or usable, usable))
    except (OSError, AttributeError, IndexError):
        return max(1, (os.cpu_count() or 2))


def set_threads(threads: int | None) -> tuple[int, str | None]:
    """Set torch's intra-op threads (default: $SPECDRAFT_THREADS, else the physical cores).
    Returns (threads, note) where the note warns when other processes already keep the cores
    busy: OpenMP threads that get descheduled spin-wait on each other, and decoding can fall 10-30x."""
    if threads is None and os.environ.get("SPECDRAFT_THREADS", "").isdigit():
        threads = int(os.environ["SPECDRAFT_THREADS"])
    if threads is not None and threads < 1:
        raise SpecdraftError(f"--threads must be >= 1, got {threads}")
    n = threads or physical_cores()
    torch.set_num_threads(n)
    note = None
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    if n > 1 and busy + n > (os.cpu_count() or n) + 1.0:  # a decayed trace of a finished job is not a busy machine
        note = (f"the machine looks busy (load {busy:.1f} on {os.cpu_count()} CPUs) and {n} threads may "
                f"oversubscribe it; timings will be slow and noisy (try --threads {max(1, n - round(busy))})")
    return n, note


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Tensors of ever-changing sizes (a batch's logits, a drafter's candidate rows) leave glibc's
    heap fragmented: the memory is free but stays resident, and a long-running server's RSS
    creeps up although no tensor is alive (measured: live tensors constant, RSS +20% over 2,000
    requests). Trimming when the server goes idle returns it. Loading trims after each compacted
    matrix for the same reason: its float32 transients would stay resident (GBs over a 26B load)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
