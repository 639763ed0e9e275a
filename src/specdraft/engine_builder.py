"""From a loaded target to a ready engine: the one path `generate`, `serve` and `bench` take.

    drafter = load_drafter(--drafter, --drafter-path, --draft-tokens)   (drafters/kinds.py)
    policy  = adaptive (costs measured here) or fixed                    (speculative/policy.py)
    engine  = Engine(target, drafter, K, policy)
    engine.prepare_policy(rows)   the policy's one-time step timings, before anything is timed or served

With `simulate` (--simulate-acceptance) the drafter is wrapped in drafters/simulated.py: its cost is
paid, its drafts land as often as the profile says; speculative/simulation.py gives it the plain
continuations it matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.drafters import load_drafter
from specdraft.drafters.kinds import resolve_auto
from specdraft.drafters.base import Drafter
from specdraft.drafters.simulated import AcceptanceProfile, SimulatedAcceptance
from specdraft.errors import SpecdraftError
from specdraft.runtime import Runtime
from specdraft.speculative.costs import MeasuredCosts, cost_key
from specdraft.speculative.engine import Engine
from specdraft.speculative.policy import AdaptivePolicy, DraftPolicy


@dataclass
class BuiltEngine:
    engine: Engine
    drafter: str  # the drafter kind that runs ("none": plain decoding; `auto` resolved)
    draft_tokens: int  # K, the most drafts the drafter proposes a round (0 without a drafter)
    drafter_path: str | None = None  # the folder its network came from (`auto`: the one it chose)


def draft_policy(rt: Runtime, policy: str = "adaptive", progress: bool = False) -> DraftPolicy | None:
    """The engine's draft policy: "adaptive" (width per round from step costs measured on this
    machine, cached under $SPECDRAFT_CACHE/costs, and the acceptance seen so far) or "fixed"
    (None: the engine's own FixedPolicy, K every round, plain rounds from `rt.speculate_below` rows)."""
    if policy == "fixed":
        return None
    if policy != "adaptive":
        raise ValueError(f"unknown draft policy {policy!r} (adaptive or fixed)")
    key = cost_key(rt.folder, rt.weights, rt.dtype_name, rt.device)
    return AdaptivePolicy(MeasuredCosts(key, progress=progress), timed_rounds=True)


def engine_for(rt: Runtime, drafter: Drafter | None = None, draft_tokens: int = 4, policy: str = "adaptive",
               progress: bool = False, **engine_kwargs: Any) -> Engine:
    """An Engine over this target with a loaded drafter (or none). With a drafter, `policy` says
    how many drafts a round verifies (draft_policy); `engine_kwargs` go to Engine (max_batch_size,
    capacity...)."""
    chosen = draft_policy(rt, policy, progress) if drafter is not None else None
    return Engine(rt.model, rt.tokenizer, drafter, draft_tokens, speculate_below=rt.speculate_below,
                  policy=chosen, **engine_kwargs)


def check_drafter_fits_target(model: str, drafter: str, drafter_path: str | None) -> None:
    """Refuse an MTP drafter that does not fit the target from the two configs alone, before the
    target loads (a mismatched assistant for a 30 GB target fails in a second, not after minutes)."""
    from specdraft.drafters.kinds import KINDS
    from specdraft.drafters.mtp.checkpoint import check_drafter_fits

    kind = KINDS.get(drafter)
    # `auto` ignores --drafter-path; a missing path is the loader's own one-line error
    if kind is None or kind.build is None or "mtp" not in kind.parts or not drafter_path:
        return
    from specdraft.loading import hub

    if Path(drafter_path).expanduser().exists():
        check_drafter_fits(Path(drafter_path), model)
    elif hub.is_hub_id(drafter_path):  # its config.json alone, before either model's weights
        check_drafter_fits(hub.cached_folder(drafter_path, text_only=False) or hub.config_folder(drafter_path), model)


def build_engine(rt: Runtime, drafter: str = "auto", drafter_path: str | None = None,
                 draft_tokens: int | None = None, policy: str = "adaptive", prepare_rows: int | None = None,
                 progress: bool = False, simulate: AcceptanceProfile | None = None, simulate_seed: int = 0,
                 **engine_kwargs: Any) -> BuiltEngine:
    """Load the drafter `drafter` names (a kind of drafters/kinds.py; a draft model is loaded with
    Runtime.load), build the engine, and with `prepare_rows` let the policy measure its step costs
    for batches of that many rows now, so that no timed generation or served request waits on it."""
    if drafter == "auto":  # resolved here, so that the caller learns which drafter folder auto chose
        drafter, drafter_path = resolve_auto(rt.name, getattr(rt, "folder", None))
    found, kind, k = load_drafter(rt, drafter, drafter_path, draft_tokens, load_runtime=Runtime.load)
    if simulate is not None:
        if found is None:
            raise SpecdraftError(f"--simulate-acceptance needs a drafter whose cost to pay (--drafter {kind} runs none)")
        found = SimulatedAcceptance(found, simulate, simulate_seed)
    engine = engine_for(rt, found, k, policy, progress, **engine_kwargs)
    if prepare_rows is not None:
        engine.prepare_policy(prepare_rows)
    return BuiltEngine(engine, kind, k if found is not None else 0, drafter_path if found is not None else None)
