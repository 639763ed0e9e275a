"""Large tables and weight matrices in 2 MB pages (Linux transparent huge pages).

Weight matrices: a decode step streams every matrix once; with 4 KB pages the walk to translate
each new page sits in the stream's way (BENCHMARKS.md measures the step with and without).

The MTP drafter scores ~4096 rows of the target's token table per draft step, scattered over
its 335 MB (fp16, Gemma 3 270M): with 4 KB pages nearly every row costs a TLB miss and a page
walk before its first byte arrives. Where the kernel has transparent huge pages in `madvise`
mode (the default of many distributions, this project's machines included), memory must ask for
them. Asked for on the fp16 token table, `mtp` decoding ran 1.06x faster on a 2-core Zen 4, the
plain step unchanged (BENCHMARKS.md). Elsewhere this is a plain allocation.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

import torch

HUGE_PAGE = 1 << 21
MADV_HUGEPAGE = 14  # linux/mman.h


@lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor starting on a 2 MB boundary, its whole 2 MB pages marked for
    huge pages before anything is written (so they fault in as 2 MB pages); torch.empty for
    tensors under a page, where madvise is not available, or with SPECDRAFT_HUGE_PAGES=0. It holds up to 2 MB of address space
    more than it needs, never touched."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None or os.environ.get("SPECDRAFT_HUGE_PAGES", "1") == "0":
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE), MADV_HUGEPAGE)
    return raw[start : start + nbytes].view(dtype).view(shape)


def huge_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t (converted to dtype) in memory from empty_huge."""
    out = empty_huge(tuple(t.shape), dtype or t.dtype)
    out.copy_(t)
    return out
