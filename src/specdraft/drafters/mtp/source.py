"""Which target layer an MTP drafter layer reads.

A drafter layer of type t attends over the cached K/V of the last target layer of type t
that stores its own K/V (Gemma 4's KV-shared layers store none); on a target with no layer of
type t (an all-full Llama), the last such layer of any type. The drafter's queries then follow
that layer's q-path (`AttentionLayout`).
"""

from __future__ import annotations

from specdraft.models.architectures.target import AttentionLayout, TargetModel


def kv_source(target: TargetModel, layer_type: str) -> AttentionLayout:
    owners = target.kv_layers()
    same = [i for i in owners if target.config.layer_types[i] == layer_type]
    return target.attention_layout(same[-1] if same else owners[-1])
