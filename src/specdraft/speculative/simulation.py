"""The reference continuations a simulated-acceptance drafter matches (drafters/simulated.py).

Before a speculative run under `--simulate-acceptance`, each prompt is decoded plainly (greedy,
no drafter) on the same model: those tokens are what a drafter of the chosen acceptance gets
right. The plain pass is not part of any timing.
"""

from __future__ import annotations

from specdraft.drafters.simulated import SimulatedAcceptance
from specdraft.sampling import SamplingParams
from specdraft.speculative.engine import Engine


def simulated_drafter(engine: Engine) -> SimulatedAcceptance | None:
    drafter = engine.drafter
    return drafter if isinstance(drafter, SimulatedAcceptance) else None


def prepare_references(engine: Engine, prompts: list[list[int]], max_new_tokens: int, stop: tuple[str, ...] = (),
                       eos_token_ids: list[int] | None = None) -> None:
    """Give the engine's simulated drafter the plain continuation of every prompt it lacks (a
    no-op for any other drafter). Plain rows are decoded together, as the run will decode them."""
    drafter = simulated_drafter(engine)
    if drafter is None:
        return
    missing = list({tuple(p): p for p in prompts if not drafter.has_reference(p, max_new_tokens)}.values())
    if not missing:
        return
    # A round near the end drafts past max_new_tokens: the reference covers those positions too.
    room = engine.max_context() - max_new_tokens - max(map(len, missing))
    extra = max(0, min(engine.width + 1, room))
    plain = Engine(engine.model, engine.tokenizer, None, max_batch_size=len(missing))
    results = plain.generate(missing, max_new_tokens + extra, SamplingParams(), stop, eos_token_ids)
    for prompt, result in zip(missing, results):
        drafter.add_reference(prompt, result.token_ids, max_new_tokens)
