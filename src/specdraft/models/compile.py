"""The decode/verify forward compiled with torch.compile (Inductor), eager kept as the reference.

An eager step of a small model is mostly Python and kernel-launch overhead: some 1,800 small
ops (norms, RoPE, masks, residuals) around a few dozen matmuls. Compiled, the ops between the
matmuls fuse into a handful of C++ loops.

Shapes: one graph serves every position, cache length and query width up to SHORT_FORWARD. The
step reads positions as a tensor and the key extent as a symbolic size, and writes K/V by
index (`IndexedWrites`), so nothing it guards on changes from one step to the next. Dynamo
specialises sizes 0 and 1, so width 1 (plain decoding) and batch 1 get graphs of their own:
at most four graphs per process. Prompts (wider forwards) stay eager. Duck sizing is off while
tracing: by default Dynamo assumes two sizes that happen to be equal when a graph is built are
always equal (the rope table and the key extent, both 88; the KV heads and the rows, both 2) and
rebuilt the graph when they parted, one to two extra graphs of tens of seconds each.

Compilation costs tens of seconds per graph on a small CPU (213 s for all four graphs of Gemma 3
270M on 2 cores); Inductor's on-disk cache (under $TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_$USER) makes later processes faster. With int8 weights the packed matmuls
dominate a CPU step, so compiling gains only ~7% there, and with fp16 weights on an AVX2 CPU
~20% for ~5 minutes of compiling (BENCHMARKS.md): it is opt-in (--compile). FBGEMM's packed fp16
weights are opaque to the compiler; the graph calls them through the specdraft::fp16_linear op.
"""

from __future__ import annotations

import sys
import time

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from specdraft.kv_cache import SHORT_FORWARD, IndexedWrites, KVCache, attention_span, ring_span


class CompiledStep:
    """Calls `model.run_layers` through one torch.compile'd function for short forwards."""

    def __init__(self, model: torch.nn.Module, max_width: int = SHORT_FORWARD, announce: bool = True):
        self.model = model
        self.max_width = max_width
        self.announce = announce
        self.compile_seconds = 0.0
        self._seen: set[tuple[bool, bool]] = set()
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        self._step = torch.compile(self._run, fullgraph=True, dynamic=True)

    def handles(self, tokens: torch.Tensor) -> bool:
        return tokens.shape[1] <= self.max_width

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        shape_class = (tokens.shape[0] == 1, tokens.shape[1] == 1)
        if shape_class in self._seen:
            return self._step(tokens, positions, cache.span_end, cache.k, cache.v, *_ring_layout(cache))
        # A graph this process has not built yet: say so, and time it apart from generation.
        if self.announce:
            print(f"specdraft: compiling the {'decode' if shape_class[1] else 'verify'} step "
                  f"(batch {'1' if shape_class[0] else '> 1'}); about 20-90 s the first time on a small CPU, "
                  "faster once cached", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        # Only a graph's first trace needs duck sizing off (see the top); later steps call the
        # graph as is (the patch costs tens of microseconds a call).
        with fx_config.patch(use_duck_shape=False):
            out = self._step(tokens, positions, cache.span_end, cache.k, cache.v, *_ring_layout(cache))
        self.compile_seconds += time.perf_counter() - t0
        self._seen.add(shape_class)
        return out

    def warm_up(self, max_batch_size: int = 1) -> float:
        """Build the graphs a run up to `max_batch_size` rows will use, on a scratch cache; returns seconds."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for rows in sorted({1, min(2, max_batch_size)}):
                for width in (1, 2):
                    cache = self.model.new_cache(rows, 8)
                    self.model(torch.zeros(rows, width, dtype=torch.long, device=cache.device), cache)
        return time.perf_counter() - t0

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, end: int,
             k: list[torch.Tensor], v: list[torch.Tensor], rings: tuple[int | None, ...],
             ring_of_window: tuple[tuple[int, int], ...]) -> torch.Tensor:
        by_window, ends = dict(ring_of_window), positions[:, -1] + 1
        spans = {t: attention_span(positions, 0, end, w) if w not in by_window else
                 ring_span(positions, ends, by_window[w], end, w) for t, w in self.model.windows.items()}
        return self.model.run_layers(tokens, positions, IndexedWrites(k, v, positions, rings), spans)


def _ring_layout(cache: KVCache) -> tuple[tuple[int | None, ...], tuple[tuple[int, int], ...]]:
    """The cache's rings per slot and per window, as constants the compiled graph guards on."""
    return tuple(cache.rings), tuple(sorted(cache.ring_of_window.items()))


def compile_steps(model: torch.nn.Module, announce: bool = True) -> CompiledStep:
    """Route the model's short forwards (decode, verify, drafting over its cache) through a
    compiled step; wider forwards (prompts) stay eager."""
    model.compiled_step = CompiledStep(model, announce=announce)
    return model.compiled_step
