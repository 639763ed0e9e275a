"""What a model will take in memory, known before any weight is read, and a refusal when it
cannot fit: one line that names the setting that would, instead of the kernel's OOM killer.

The estimate counts, from the model built on the meta device (shapes only):
- weights: every matrix in the chosen format (q8 ~1.06 bytes a weight, q4 ~0.56, int8 ~1,
  fp16 2, dtype its size), the LM head likewise; tables looked up a row at a time (token and
  per-layer embeddings) as the format keeps them: views of the checkpoint under q8 / q4 (only
  the token table counted, since the drafter's head reads its rows all over), else in memory;
- the KV cache for the context asked for;
- the server's prefix cache at its bound (--prefix-cache-mb): finished requests' K/V it may keep;
- a working set: a forward's activations and logits, and the allocator's slack.

A GGUF file loaded from its own blocks (loading/gguf_direct.py) is counted from its header: each
matrix as the int8 kernel keeps its blocks (GGUF_LOADED_BYTES), the token table as the file
stores it (a view of the file), the per-layer table not at all (a row per token), plus the
largest matrix's decoding transients. A gemma4-assistant GGUF (the MTP drafter) is counted the
same way before its weights are read, against the memory left beside the loaded target.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.kv_cache import PREFILL_CHUNK
from specdraft.loading.gguf_description import GGUFDescription

GB = 1 << 30
BYTES_PER_WEIGHT = {"q8": 34 / 32, "q4": 18 / 32, "int8": 1.0, "int4": 0.6, "fp16": 2.0, "gguf": 1.1, "gguf-q8": 1.1}
BASE_WORKING_SET = 384 << 20  # torch, the tokenizer, the allocator's slack
DRAFT_ROWS = 9  # the widest verification a row runs (8 drafts + 1)
SMALLER = {"dtype": "q8", "fp16": "q8", "int8": "q4", "q8": "q4"}  # the next format down
# Bytes a weight of each GGUF type takes once the direct loader has made it a kernel linear:
# codes (4-bit ones two a byte, 5-6-bit ones in a nibble and a 2-bit plane, wider ones a byte),
# scales (fp16 where the file's are; K-quants' as the file keeps them), offsets.
GGUF_LOADED_BYTES = {"Q8_0": 1 + 2 / 32, "Q4_0": 0.5 + 2 / 32, "Q4_1": 0.5 + 8 / 32, "Q5_0": 0.75 + 2 / 32,
                     "Q5_1": 0.75 + 8 / 32, "Q4_K": 0.5 + 2 / 32 + 4 / 256, "Q6_K": 0.75 + 1 / 16 + 2 / 256,
                     "F32": 1 + 4 / 32, "F16": 1 + 4 / 32, "BF16": 1 + 4 / 32}  # floats: compacted as q8
DECODE_TRANSIENT = 4  # bytes a weight of the matrix being decoded: int16 codes, then the kernel's layout
LAID_OUT_IN_C = ("Q8_0", "Q4_K", "Q6_K")  # written from the file's bytes into place: no transient
SMALLER_GGUF = "Q4_0"  # the smaller file a refusal prices


@dataclass
class Footprint:
    weights: int
    kv: int
    working: int
    prefix_cache: int = 0  # the server's bound on saved K/V (speculative/prefix_cache.py)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.working + self.prefix_cache

    def describe(self, fmt: str, context: int) -> str:
        saved = f", prefix cache {self.prefix_cache / GB:.2f} GB" if self.prefix_cache else ""
        return (f"~{self.total / GB:.1f} GB (weights {self.weights / GB:.1f} GB as {fmt}, KV cache "
                f"{self.kv / GB:.2f} GB for {context} tokens{saved}, working set {self.working / GB:.1f} GB)")


def _matrices(model: nn.Module) -> list[torch.Tensor]:
    """The weights a compact format packs: the decoder layers' linears and expert stacks."""
    out = []
    for module in model.layers.modules():
        if type(module) is nn.Linear:
            out.append(module.weight)
        for part in getattr(module, "expert_parts", ()):
            out.append(getattr(module, part))
    return out


def estimate(model: nn.Module, fmt: str, dtype: torch.dtype, context: int, batch_size: int = 1,
             prefix_cache: int = 0) -> Footprint:
    """The footprint of `model` (built on the meta device) in weight format `fmt`, computing in
    `dtype`, with a KV cache of `batch_size` rows of `context` positions and a prefix cache of at
    most `prefix_cache` bytes."""
    size = torch.finfo(dtype).bits // 8
    per_weight = BYTES_PER_WEIGHT.get(fmt, size)
    matrices = _matrices(model)
    packed = {id(m) for m in matrices}
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    tables = {"embed_tokens.weight", "embed_tokens_per_layer.weight", "lm_head.weight"}
    weights = sum(m.numel() for m in matrices) * per_weight + head.numel() * per_weight
    for name, p in model.named_parameters():
        if id(p) in packed or name == "lm_head.weight":
            continue
        if name == "embed_tokens_per_layer.weight" and fmt in ("q8", "q4"):
            continue  # read a row per token from the mapped checkpoint
        if name in tables and fmt in ("q8", "q4"):
            weights += p.numel() * 2  # as the checkpoint stores it (bf16)
        elif name in tables and fmt in ("fp16", "gguf-q8"):
            weights += p.numel() * 2
        else:
            weights += p.numel() * size
    kv = kv_bytes(model, dtype, context, batch_size)
    logits = batch_size * DRAFT_ROWS * head.shape[0] * 4 * 3  # scores, probabilities, a sort's scratch
    return Footprint(int(weights), kv, BASE_WORKING_SET + logits, prefix_cache)


def kv_bytes(model: nn.Module, dtype: torch.dtype, context: int, batch_size: int = 1) -> int:
    """The engine's KV cache: `context` positions per layer that stores K/V, or, where the model
    keeps sliding layers in rings, window + a prefill chunk of them; in the dtype the model's
    cache stores (a float16 cache beside float32 arithmetic: kv_cache.kv_storage_dtype)."""
    stored = model.kv_dtype(dtype) if hasattr(model, "kv_dtype") else dtype
    size = torch.finfo(stored).bits // 8
    total = 0
    for layer in model.kv_layers():
        layout = model.attention_layout(layer)
        kept = context
        if getattr(model, "sliding_rings", False) and layout.window is not None:
            kept = min(context, layout.window + PREFILL_CHUNK)
        total += 2 * layout.num_kv_heads * layout.head_dim * size * kept
    return total * batch_size


def available_memory() -> int:
    """Bytes this process may still use: $SPECDRAFT_MEMORY_LIMIT (e.g. 16G) if set, else the
    smaller of the kernel's MemAvailable and this cgroup's free allowance."""
    limit = os.environ.get("SPECDRAFT_MEMORY_LIMIT")
    if limit:
        return parse_bytes(limit)
    free = _meminfo_available()
    cgroup = _cgroup_free()
    return min(x for x in (free, cgroup) if x is not None) if (free or cgroup) else 1 << 62


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)i?B?\s*", text, re.I)
    if not m:
        raise SpecdraftError(f"SPECDRAFT_MEMORY_LIMIT={text!r}: use a size such as 16G or 800M")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_free() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        return int(limit) - used
    except (OSError, ValueError):
        return None


def _fitting_context(model: nn.Module, fmt: str, dtype: torch.dtype, context: int, batch_size: int,
                     free: int, prefix_cache: int = 0) -> int | None:
    """The longest context, halving from `context` down to 512 tokens, whose footprint fits in `free`."""
    return _longest_fitting(lambda c: estimate(model, fmt, dtype, c, batch_size, prefix_cache), context, free)


def _smaller_prefix_cache(need: Footprint, free: int) -> str | None:
    """'--prefix-cache-mb N fits' where the rest fits with a smaller prefix cache (N may be 0: off)."""
    if not need.prefix_cache or need.total - need.prefix_cache > free:
        return None
    return f"--prefix-cache-mb {(free - (need.total - need.prefix_cache)) >> 20} fits"


def _longest_fitting(footprint, context: int, free: int) -> int | None:
    while context >= 512:
        if footprint(context).total <= free:
            return context
        context //= 2
    return None


def estimate_gguf(model: nn.Module, desc: GGUFDescription, context: int, batch_size: int = 1,
                  as_type: str | None = None, prefix_cache: int = 0) -> Footprint:
    """The footprint of a GGUF file loaded from its own blocks (see the module docstring), `model`
    built on the meta device from its header; `as_type`: price every block matrix as that type
    instead (what a smaller file of the same model would take)."""
    from specdraft.loading.gguf_file import hf_name

    weights, largest = 0.0, 0
    for name, t in desc.tensors.items():
        hf = hf_name(name, desc.arch)
        if hf is None or name == "per_layer_token_embd.weight":
            continue  # towers and rope_freqs; the per-layer table is read a row per token
        kind = t.tensor_type.name
        numel = 1
        for d in t.shape:
            numel *= int(d)
        if len(t.shape) == 1:
            weights += numel * 4
            continue
        per_weight = GGUF_LOADED_BYTES.get(as_type if as_type and kind not in ("F32", "F16", "BF16") else kind, 4.0)
        if name == "token_embd.weight":
            weights += t.data.nbytes  # the table itself, a view of the file
            if "output.weight" in desc.tensors:
                continue
        weights += numel * per_weight
        if (as_type or kind) not in LAID_OUT_IN_C:
            largest = max(largest, numel)
    head = desc.config["vocab_size"]
    logits = batch_size * DRAFT_ROWS * head * 4 * 3
    kv = kv_bytes(model, torch.float32, context, batch_size)
    return Footprint(int(weights), kv, BASE_WORKING_SET + logits + largest * DECODE_TRANSIENT, prefix_cache)


# Bytes a weight takes while a GGUF file converts to a float32 folder (loading/gguf_file.convert_gguf):
# the float32 state of every tensor, held until the blocks of the quantised ones are read beside it
# (int8 codes, float32 scales and offsets per 16 or 32 codes: at most 1.25 bytes a weight).
CONVERSION_FLOAT_BYTES = 4
CONVERSION_BLOCK_BYTES = 1.25


def estimate_gguf_conversion(desc: GGUFDescription) -> int:
    """The peak bytes of converting a GGUF file into a float32 folder, from its header."""
    from specdraft.loading.gguf_blocks import SUPPORTED_BLOCK_FORMATS
    from specdraft.loading.gguf_file import hf_name

    total = 0.0
    for name, t in desc.tensors.items():
        if hf_name(name, desc.arch) is None:
            continue
        numel = 1
        for d in t.shape:
            numel *= int(d)
        blocks = t.tensor_type.name in SUPPORTED_BLOCK_FORMATS and len(t.shape) == 2
        total += numel * (CONVERSION_FLOAT_BYTES + (CONVERSION_BLOCK_BYTES if blocks else 0))
    return int(total) + BASE_WORKING_SET


def check_gguf_conversion_fits(desc: GGUFDescription, name: str, fmt: str, direct: Footprint | None,
                               available: int | None = None) -> None:
    """Refuse in one line, before anything is converted, a GGUF file whose conversion to a float32
    folder (what --weights `fmt` loads from) cannot fit; `direct`: the footprint of the file run
    from its own blocks (--weights gguf-q8), where that loader takes it, named when it fits."""
    need = estimate_gguf_conversion(desc)
    free = available_memory() if available is None else available
    if need <= free:
        return
    if direct is not None and direct.total <= free:
        hint = f"--weights gguf-q8 runs the file from its own blocks, no conversion (~{direct.total / GB:.1f} GB)"
    else:
        hint = "no conversion of this file fits this machine"
    raise SpecdraftError(f"{name}: --weights {fmt} converts the file to a float32 folder first, which needs "
                         f"~{need / GB:.1f} GB (every weight in float32, beside its blocks) but {free / GB:.1f} GB is "
                         f"available; {hint}")


def estimate_gguf_drafter(desc: GGUFDescription, batch_size: int = 1) -> Footprint:
    """The footprint of a gemma4-assistant GGUF loaded from its own blocks (drafters/mtp/gguf.py):
    each matrix as the kernel keeps it, its token table included (the table is its dense head:
    no view of the file stays), vectors in float32; the largest matrix's decoding transients and a
    round's dense logits as the working set. It keeps no KV cache (it reads the target's)."""
    from specdraft.loading.gguf_file import hf_name

    weights, largest = 0.0, 0
    for name, t in desc.tensors.items():
        if hf_name(name, desc.arch) is None:
            continue  # rope_freqs (read into the config)
        numel = 1
        for d in t.shape:
            numel *= int(d)
        if len(t.shape) == 1:
            weights += numel * 4
            continue
        weights += numel * GGUF_LOADED_BYTES.get(t.tensor_type.name, 4.0)
        largest = max(largest, numel)
    logits = batch_size * DRAFT_ROWS * desc.config["text_config"]["vocab_size"] * 4 * 3
    return Footprint(int(weights), 0, logits + largest * DECODE_TRANSIENT)


def check_gguf_drafter_fits(desc: GGUFDescription, name: str, batch_size: int = 1,
                            available: int | None = None) -> Footprint:
    """The drafter's footprint (estimate_gguf_drafter), or a one-line refusal before any of its
    weights is read, where it exceeds the memory left beside the loaded target."""
    need = estimate_gguf_drafter(desc, batch_size)
    free = available_memory() if available is None else available
    if need.total <= free:
        return need
    raise SpecdraftError(f"the drafter {name} needs ~{need.total / GB:.2f} GB (weights {need.weights / GB:.2f} GB as its "
                         f"GGUF blocks, working set {need.working / GB:.2f} GB) but {free / GB:.2f} GB is available "
                         "beside the target; --drafter ngram (prompt lookup) needs no weights, or give the target "
                         "a shorter --max-context")


def check_gguf_fits(model: nn.Module, desc: GGUFDescription, name: str, context: int, batch_size: int = 1,
                    available: int | None = None, prefix_cache: int = 0) -> Footprint:
    """check_fits for a GGUF loaded from its own blocks, from its header alone: the footprint, or a
    one-line refusal naming a smaller prefix cache, a shorter context or a smaller file that would fit."""
    need = estimate_gguf(model, desc, context, batch_size, prefix_cache=prefix_cache)
    free = available_memory() if available is None else available
    if need.total <= free:
        return need
    options = [o for o in [_smaller_prefix_cache(need, free)] if o]
    shorter = _longest_fitting(lambda c: estimate_gguf(model, desc, c, batch_size, prefix_cache=prefix_cache),
                               context // 2, free)
    if shorter is not None:
        options.append(f"--max-context {shorter} fits")
    small = estimate_gguf(model, desc, context, batch_size, as_type=SMALLER_GGUF, prefix_cache=prefix_cache)
    if small.total < need.total:
        if small.total <= free:
            options.append(f"a {SMALLER_GGUF} file of this model fits (~{small.total / GB:.1f} GB)")
        elif (fits := _longest_fitting(lambda c: estimate_gguf(model, desc, c, batch_size, SMALLER_GGUF,
                                                               prefix_cache), context // 2, free)) is not None:
            options.append(f"a {SMALLER_GGUF} file of this model with --max-context {fits} fits")
    hint = "; ".join(options) if options else "no smaller file or context down to 512 tokens fits this machine"
    raise SpecdraftError(f"{name} needs {need.describe('its GGUF blocks', context)} but {free / GB:.1f} GB is "
                         f"available; {hint}")


def check_fits(model: nn.Module, name: str, fmt: str, dtype: torch.dtype, context: int, batch_size: int = 1,
               available: int | None = None, prefix_cache: int = 0) -> Footprint:
    """The footprint, or a SpecdraftError naming what would fit when it exceeds the memory available:
    a smaller prefix cache, the next smaller format, a shorter context, or both."""
    need = estimate(model, fmt, dtype, context, batch_size, prefix_cache)
    free = available_memory() if available is None else available
    if need.total <= free:
        return need
    options = [o for o in [_smaller_prefix_cache(need, free)] if o]
    smaller = SMALLER.get(fmt)
    if smaller is not None:
        small_dtype = torch.float32 if smaller in ("q8", "q4") else dtype
        alt = estimate(model, smaller, small_dtype, context, batch_size, prefix_cache)
        if alt.total <= free:
            options.append(f"--weights {smaller} fits (~{alt.total / GB:.1f} GB)")
        elif (fits := _fitting_context(model, smaller, small_dtype, context // 2, batch_size, free,
                                       prefix_cache)) is not None:
            options.append(f"--weights {smaller} with --max-context {fits} fits")
    shorter = _fitting_context(model, fmt, dtype, context // 2, batch_size, free, prefix_cache)
    if shorter is not None:
        options.append(f"--max-context {shorter} fits")
    hint = "; ".join(options) if options else "no smaller format or context down to 512 tokens fits this machine"
    raise SpecdraftError(f"{name} needs {need.describe(fmt, context)} but {free / GB:.1f} GB is available; {hint}")
