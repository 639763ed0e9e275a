"""Drafters: who proposes the tokens the target verifies.

- base.py: what every drafter sees (DraftInput) and returns (Draft), and the Drafter interface
- kinds.py: every kind --drafter names, what it is made of and how it is built (load_drafter)
- mtp/: Gemma-4-style multi-token-prediction drafter reading the target's KV cache
- ngram.py, lookup_index.py: prompt lookup, training-free
- mtp_lookup.py: prompt lookup where the text repeats itself, the MTP drafter elsewhere
- draft_model.py: an independent small model with its own KV cache
"""

from __future__ import annotations

from specdraft.drafters.base import Draft, Drafter, DraftInput
from specdraft.drafters.kinds import DEFAULT_K, DRAFTER_KINDS, KINDS, load_drafter, shipped_drafter_path

__all__ = ["DEFAULT_K", "DRAFTER_KINDS", "KINDS", "Draft", "Drafter", "DraftInput", "load_drafter",
           "shipped_drafter_path"]
