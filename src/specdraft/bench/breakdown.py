"""Where a plain decode step's time goes, per op class (`specdraft steps --breakdown`).

The floor of a step is its weight bytes over the read bandwidth; what this shows is how far each
part of the step is from its share of that floor: the matrices by where they sit (with the bytes
they read and the rate that implies), the LM head, attention, norms, the int8 rounding of
activations, the PLE inputs, and what is left (Python, dispatch, glue between the C calls).
Inside the fused Gemma 4 layers the C code times each op class (kernels/gemma4_layer.c); other
models show the outer split only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdraft.kv_cache import PREFILL_CHUNK
from specdraft.models.kernels import gemma4_layer
from specdraft.speculative.profiling import profile_tokens


@dataclass
class Part:
    name: str
    ms: float  # per step
    nbytes: int = 0  # weight bytes it reads per step (0: not a weight read)


def module_bytes(m: torch.nn.Module | None) -> int:
    if m is None:
        return 0
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def _matrix_bytes(model) -> dict[str, int]:
    """Weight bytes of the fused layers' matrices per class, as the timers name them."""
    out = {"attention matrices (q, k, v, o)": 0, "MLP matrices (gate, up, down)": 0, "PLE matrices (gate, projection)": 0}
    for layer in model.layers:
        attn = layer.self_attn
        own = [] if attn.shared else [attn.k_proj, attn.v_proj]
        out["attention matrices (q, k, v, o)"] += sum(map(module_bytes, [attn.q_proj, attn.o_proj] + own))
        mlp = layer.mlp
        out["MLP matrices (gate, up, down)"] += sum(map(module_bytes, [mlp.gate_proj, mlp.up_proj, mlp.down_proj]))
        if layer.ple:
            out["PLE matrices (gate, projection)"] += sum(map(module_bytes, [layer.per_layer_input_gate,
                                                                             layer.per_layer_projection]))
    return out


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_breakdown(model: torch.nn.Module, context: int = 512, repeats: int = 15, width: int = 1) -> list[Part]:
    """Per-op-class time of a forward of `width` tokens (1: a plain step; K + 1: a verification of
    K drafts) over `context` cached tokens (batch 1), medians of `repeats` forwards; the first part
    is the whole forward, the last what the parts leave."""
    cache = model.new_cache(1, context + width + 1, PREFILL_CHUNK)
    text = profile_tokens(model.config.vocab_size, 1, context + width, seed=0)
    for at in range(0, context, PREFILL_CHUNK):
        model(text[:, at : min(context, at + PREFILL_CHUNK)], cache)
    token = text[:, context : context + width]

    def forward() -> torch.Tensor:
        cache.rollback([context])
        return model(token, cache)

    hidden = forward()
    for _ in range(2):
        forward()
    total = _median_ms(forward, repeats)
    parts = [Part("whole forward (no LM head)", total)]
    inner = 0.0
    fused = getattr(model, "_fused", None)
    if fused is not None and fused.weights(model, hidden, cache) is not None:
        runs = []
        for _ in range(repeats):
            gemma4_layer.read_timers(True)
            forward()
            runs.append(gemma4_layer.read_timers(False))
        by_bytes = _matrix_bytes(model)
        for name in gemma4_layer.TIMED_OPS:
            ms = sorted(r[name] for r in runs)[len(runs) // 2] * 1000
            parts.append(Part(f"layers: {name}", ms, by_bytes.get(name, 0)))
            inner += ms
    x = model.embed(token)
    parts.append(Part("token embedding", _median_ms(lambda: model.embed(token), repeats)))
    if hasattr(model, "per_layer_inputs") and model.params.hidden_size_per_layer_input:
        parts.append(Part("PLE inputs (table rows, projection, norms)",
                          _median_ms(lambda: model.per_layer_inputs(token, x), repeats),
                          module_bytes(model.per_layer_model_projection)))
    parts.append(Part("final norm", _median_ms(lambda: model.norm(hidden), repeats)))
    outside = sum(p.ms for p in parts[1:]) - inner
    parts.append(Part("Python, dispatch, RoPE rows, masks, glue (the rest)", total - inner - outside))
    head = getattr(model, "packed_head", None)
    parts.append(Part("LM head + argmax (after the forward)", _median_ms(lambda: model.greedy_tokens(hidden[0]),
                                                                          repeats), module_bytes(head)))
    return parts


def omp_regions_note(model: torch.nn.Module) -> str:
    """How much of the matrices' time is OpenMP's fork/join: regions a step opens x one's cost."""
    fused = getattr(model, "_fused", None)
    if fused is None or fused._built is None or fused._built[1] is None:  # not the fused Gemma 4 layers
        return ""
    per_layer = [2 + (0 if layer.self_attn.shared else 2) + 3 + (2 if layer.ple else 0) for layer in model.layers]
    seconds = gemma4_layer.omp_region_seconds(torch.get_num_threads())
    regions = sum(per_layer)
    return (f"OpenMP: ~{regions} parallel regions a step (one per matrix) at {seconds * 1e6:.1f} us each -> "
            f"{regions * seconds * 1000:.2f} ms, inside the matrices' time")
