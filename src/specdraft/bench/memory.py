"""Resident memory, measured rather than estimated.

What we measure (and say we measure):
- RSS (resident set size) from /proc/self/statm: every page of this process in RAM, weights,
  activations, KV caches, allocator slack, and file pages mmapped and touched (llama.cpp maps
  its GGUF, so its weights show up here as they are read).
- `load_delta`: RSS after loading a method's own weights minus RSS before; the allocator may
  reuse freed memory, so this can undercount, never invent.
- `PeakSampler`: the highest RSS seen while a batch generates, sampled every few milliseconds
  from a background thread (each read takes microseconds, so it barely competes with the
  generation it watches; it can miss a spike shorter than the interval). Reported as the peak above the RSS just before.
- CUDA: torch's allocator peak (max_memory_allocated) for the same window.
- `max_rss`: the process high-water mark from getrusage, the one number that cannot miss.
"""

from __future__ import annotations

import os
import resource
import sys
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size; falls back to the high-water mark where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return max_rss_bytes()


def max_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class PeakSampler:
    """`with PeakSampler(device) as s: ...` then s.before, s.peak (bytes) and s.cuda_peak."""

    def __init__(self, device: torch.device | None = None, interval: float = 0.005):
        self.interval = interval
        self.cuda = device is not None and device.type == "cuda"
        self.before = self.peak = 0
        self.cuda_peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakSampler":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.before = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        if self.cuda:
            torch.cuda.synchronize()
            self.cuda_peak = torch.cuda.max_memory_allocated()

    @property
    def delta(self) -> int:
        return self.peak - self.before
