"""Compacting a model while its checkpoint is read (q8 / q4), one tensor at a time."""

from __future__ import annotations

import torch
from torch import nn

from specdraft.models.formats.quant import check_compactable, compact_head, compact_matrix


class StreamingCompactor:
    """Compacts a model's matrices while its checkpoint is read, one tensor at a time (q8 / q4):
    the loader hands each tensor over before converting it, so the float32 model never exists
    and loading peaks at about the compact model plus one matrix.

    Takes the decoder layers' bias-free linears, expert stacks (modules with `compact_experts`),
    and builds the LM head from its source tensor (which the model keeps as stored: its rows are
    still looked up as input embeddings)."""

    def __init__(self, model: nn.Module, fmt: str, dtype: torch.dtype, device: torch.device | str):
        check_compactable(fmt, dtype, torch.device(device).type)
        self.model, self.fmt, self.dtype = model, fmt, dtype
        self.places: dict[str, tuple[nn.Module, str]] = {}
        for name, child in model.named_modules():
            if child is model.lm_head:
                continue
            prefix = f"{name}." if name else ""
            for attr, sub in child.named_children():
                if sub is model.lm_head:
                    continue
                if type(sub) is nn.Linear and sub.bias is None:
                    self.places[f"{prefix}{attr}.weight"] = (child, attr)
            if hasattr(child, "compact_experts"):
                for part in child.expert_parts:
                    self.places[f"{prefix}{part}"] = (child, part)
        self.head_source = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"

    def takes(self, name: str) -> bool:
        return name in self.places or name == self.head_source

    def put(self, name: str, tensor: torch.Tensor) -> bool:
        """Compact `tensor` into its place; True if the model also keeps the tensor as stored (the head's source)."""
        make = lambda w: compact_matrix(w, None, self.fmt, self.dtype)  # noqa: E731
        if name == self.head_source:
            compact_head(self.model, tensor, self.fmt, self.dtype)
            return True
        owner, attr = self.places[name]
        if hasattr(owner, "compact_experts"):
            owner.compact_part(attr, tensor, make)
            return False
        packed = make(tensor)
        setattr(owner, attr, packed if packed is not None else _linear_of(tensor.to(self.dtype)))
        return False


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return linear
