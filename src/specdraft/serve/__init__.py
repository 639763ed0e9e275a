"""`specdraft serve`: an OpenAI-compatible server over the step-wise engine.

- app.py: routes, auth, errors in OpenAI's shape
- worker.py: the engine's thread (requests in, tokens and results out)
- schemas.py: request bodies; shapes.py: response bodies and the `specdraft` extension
- text.py: tokens -> streamed text with stop-string hold-back and per-token sources
- metrics.py: Prometheus; static/playground.html: the page at GET /
"""

from __future__ import annotations

from specdraft.serve.app import ServedModel, create_app


def load_served(model: str, drafter: str, dtype: str, device: str, max_batch_size: int, max_context: int,
                drafter_path: str | None = None, draft_tokens: int | None = None, weights: str = "auto",
                compile: bool = False, draft_policy: str = "adaptive", prefill_dtype: str = "auto",
                prefix_cache_bytes: int = 0) -> ServedModel:
    """Load the target and drafter and build the engine the server drives (compiled graphs and
    the draft policy's step costs are measured here, before the port opens, so no request waits).
    `prefix_cache_bytes`: the most finished requests' K/V kept for prompts that start alike (0: none),
    counted in the memory check before loading."""
    from specdraft.engine_builder import build_engine, check_drafter_fits_target
    from specdraft.runtime import Runtime
    from specdraft.speculative.prefix_cache import PrefixCache

    check_drafter_fits_target(model, drafter, drafter_path)
    rt = Runtime.load(model, dtype, device, weights=weights, compile=compile, prefill_dtype=prefill_dtype,
                      context=max_context, batch_size=max_batch_size, prefix_cache_bytes=prefix_cache_bytes)
    if compile:
        rt.model.compiled_step.warm_up(max_batch_size)
    cache = {"prefix_cache": PrefixCache(prefix_cache_bytes)} if prefix_cache_bytes > 0 else {}
    built = build_engine(rt, drafter, drafter_path, draft_tokens, draft_policy, prepare_rows=max_batch_size,
                         progress=True, max_batch_size=max_batch_size, capacity=max_context, **cache)
    return ServedModel(model, built.engine, rt.tokenizer, built.drafter, built.draft_tokens)


__all__ = ["ServedModel", "create_app", "load_served"]
