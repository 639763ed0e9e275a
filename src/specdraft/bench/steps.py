"""The cost of one target forward by query width and batch size: what decides K.

A speculative round costs one verify forward of width K+1 (plus drafting); it pays when the
tokens it emits outweigh that cost in plain steps. So the table that matters is the time of a
width-w forward (w = 1..9) next to a width-1 step, per batch size, with the bytes a step reads
and the bandwidth that implies against the machine's measured floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdraft.kv_cache import PREFILL_CHUNK, KVCache
from specdraft.speculative.profiling import by_confidence, first_rows, profile_tokens


@dataclass
class StepTime:
    batch_size: int
    width: int
    ms: float  # median forward + LM head, per call
    ratio: float  # ms / the same batch's width-1 ms


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes a one-token decode step reads: every weight and packed buffer at its stored size,
    but one row of each lookup table (token and per-layer embeddings: one row is gathered per
    token), the token table again in full when the LM head is tied to it and unpacked, of a MoE
    layer's experts only the top_k a token is routed to, and no copies only prompts read (bf16
    prompt weights, models/formats/block_linear.py)."""
    tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    total = sum(t.numel() * t.element_size() for i, t in tensors.items() if i not in tables)
    total += sum(t[0].numel() * t.element_size() for t in tables.values())
    embed = model.embed_tokens.weight
    total += sum(getattr(m, "packed_nbytes", 0) for m in model.modules())  # FBGEMM's fp16 copies (the screen's too)
    prompt_only = [getattr(m, "prompt_weight", None) for m in model.modules()]
    total -= sum(w.numel() * w.element_size() for w in prompt_only if w is not None)
    screened, packed_head = getattr(model, "screened_head", None), getattr(model, "packed_head", None)
    if screened is not None:  # greedy steps read the screen, not a float32 head
        if packed_head is None and model.lm_head is not None:
            total -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        if getattr(screened, "int8_codes", None) is not None and packed_head is not None:
            # an int8 copy of its own: sampling's fp16 copy (FBGEMM's, or the kernel's tiles) is unread
            total -= getattr(packed_head, "packed_nbytes", 0) + sum(b.numel() * b.element_size()
                                                                   for b in packed_head.buffers())
    elif packed_head is None and model.lm_head is None:
        total += embed.numel() * embed.element_size()  # tied head reads the table in full
    return total - _unrouted_expert_bytes(model)


def _unrouted_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the experts a one-token step skips: all but top_k of each MoE layer's."""
    skipped = 0
    for layer in model.modules():
        router, experts = getattr(layer, "router", None), getattr(layer, "experts", None)
        if router is None or experts is None or not hasattr(router, "top_k"):
            continue
        stored = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers()))
        n = router.proj.out_features
        skipped += stored * (n - router.top_k) // n
    return skipped


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_times(model: torch.nn.Module, batch_sizes: list[int], widths: list[int], context: int = 512,
               repeats: int = 15, progress=None) -> list[StepTime]:
    """Median time of a forward of `width` tokens per row over `context` cached tokens, plus the
    median time of the greedy head over as many rows (greedy verification scores all of them),
    for each batch size."""
    out = []
    vocab = model.config.vocab_size
    for b in batch_sizes:
        # the engine's cache (sliding layers in rings where the model keeps them), prefilled as it does
        cache: KVCache = model.new_cache(b, context + max(widths) + 1, max(PREFILL_CHUNK, max(widths)))
        text = profile_tokens(vocab, b, context + max(widths), seed=0)  # as the adaptive policy times steps
        hidden = [model(text[:, at : min(context, at + PREFILL_CHUNK)].to(cache.device), cache)[0, -128:]
                  for at in range(0, context, PREFILL_CHUNK)]
        states = by_confidence(model, torch.cat(hidden)[-128:])
        base = None
        for w in widths:
            tokens = text[:, context : context + w].to(cache.device)
            # the head over b * w rows the model is sure about, as on most real steps (timed apart
            # from the forward, as the policy does: on the profile text's unsure rows the exact
            # greedy head reads the table twice)
            rows = first_rows(states, b * w)

            def forward() -> None:
                cache.rollback([context] * b)
                model(tokens, cache)

            def head() -> None:
                model.greedy_tokens(rows)

            for _ in range(3):  # warm-up (and any compilation) outside the timing
                forward()
                head()
            ms = _median_ms(forward, repeats) + _median_ms(head, repeats)
            base = ms if w == 1 else base
            out.append(StepTime(b, w, ms, ms / base if base else 1.0))
            if progress is not None:
                progress(out[-1])
    return out
