"""Compact weights: int8, int4 and fp16 linears on torch's own CPU kernels, packed once at load.

Decoding a small model on a CPU is bound by the bytes the weights take to read: the 262k x 640
LM head of Gemma 3 270M alone is 335 MB in bf16. Three weight-only formats:

- int8: one scale per output row; `aten._weight_int8pack_mm` (bf16 or float32 activations).
- int4: asymmetric, one scale and one offset per group of 32 inputs; `aten._weight_int4pack_mm_for_cpu`.
- fp16: weights rounded to fp16, float32 activations and sums; a C kernel over a tiled copy
  (models/kernels/fp16_gemv.c), FBGEMM where it does not build (models/formats/fp16_kernel.py). For
  CPUs without bf16 units, where the int8/int4 kernels are compute-bound.
- q8 / q4: symmetric 8-bit / 4-bit codes per 32 inputs made from the checkpoint's weights, with
  int8 activations (models/formats/q8_act_linear.py); float32 activations and sums. Made one
  matrix at a time while the checkpoint is read (StreamingCompactor), so loading never holds
  the float32 model: the default for large models on CPUs without bf16 units.
- gguf: the GGUF file's own quantised blocks, multiplied as the float32 model's exact weights
  (models/formats/block_linear.py); float32 activations. Only for models converted from a GGUF.

The int8 and int4 kernels compute every output row on its own with a fixed reduction order
(fp16: by construction in the C kernel, by padding FBGEMM's calls in fp16_kernel.py), so a row's
result does not depend on how many rows are computed together (checked by tests). That is what
makes a K+1-row verification give the same bits as K+1 one-row steps, i.e. speculative output
equal to plain output in the default configuration, which bf16 `F.linear` does not guarantee
(its blocking changes with the number of rows on some CPUs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.kv_cache import SHORT_FORWARD
from specdraft.models.formats import block_linear, int8_head, q8_act_linear
from specdraft.models.formats.block_linear import Blocks
from specdraft.models.formats.fp16_kernel import fp16_mm, prepack_fp16, register
from specdraft.models.formats.huge_pages import huge_copy
from specdraft.models.kernels import build as kernels
from specdraft.models.kernels import fp16_gemv
from specdraft.models.kernels.decoder_layer import FP16_TILES, Linear, pointer

WEIGHT_FORMATS = ("dtype", "int8", "int4", "fp16", "gguf", "gguf-q8", "q8", "q4")  # dtype: weights stay in the model's dtype
# Blocks of 32 inputs with int8 activations (Q8ActLinear, llama.cpp's Q8_0 / Q4_0 arithmetic) made
# from a checkpoint's own weights: compacted one matrix at a time while the checkpoint is read.
BLOCK_FORMATS = ("q8", "q4")
INT4_GROUP = 32
# The packed kernels stream the weights once per 4 rows: right for decode and verify widths,
# 2.5-3x slower than a bf16 GEMM for a prompt. Inputs of more tokens per row than a short forward
# (prompts) dequantise the weight and use F.linear. The choice depends on tokens per row, never
# on the batch: a row's verify and its plain steps must take the same kernel at any batch size.
PACKED_MAX_ROWS = SHORT_FORWARD


def _wide(x: torch.Tensor) -> bool:
    """x [..., T, K] (or [N, K], one token per row): a prompt-sized input?"""
    return x.dim() >= 3 and x.shape[-2] > PACKED_MAX_ROWS


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], scales [N]): w ~ q * scale, scale = max|w_row| / 127."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes int32 [N, K] in 0..15, scales [N, K/g], minima [N, K/g]):
    w ~ q * scale + min per group of g inputs (asymmetric, so a group's range is used fully)."""
    n, k = weight.shape
    w = weight.float().view(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.view(n, k), scales, lo


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed: the packed kernel for decode/verify widths, the dequantised
    weight and a bf16 GEMM for prompts. Subclasses pack in __init__ and define the two paths."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, in_features] -> [N, out_features] on the packed kernel."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _wide(x):
            return F.linear(x, self.dequantized(), self.bias)
        y = self.packed_mm(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        q, scales = quantize_int8(weight)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)


class Int8Head(Int8Linear):
    """The vocabulary head in int8: the same weights and per-row scales as Int8Linear, scored by
    the compiled row-group loop of models/formats/int8_head.py (2x faster than the packed kernel here;
    float32 scores, row-invariant)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__(weight, None, dtype)
        self.register_buffer("scales_f32", self.scales.float())
        self.compiled = True  # False: every call on the packed kernel (no C++ compiler here)

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return super().packed_mm(rows)
        return int8_head.int8_head_scores(rows, self.qweight, self.scales_f32)


class Int4Linear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, group: int = INT4_GROUP):
        super().__init__()
        q, scales, lo = quantize_int4(weight, group)
        self.out_features, self.in_features = weight.shape
        self.group = group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # The kernel dequantises as (q - 8) * scale + zero, so zero = min + 8 * scale.
        zeros = lo + 8 * scales
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype))
        # The codes again, two per byte, for wide inputs (the kernel's packing is opaque).
        self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(n, k // g, g).to(self.scales_and_zeros.dtype)
        scale, zero = self.scales_and_zeros.transpose(0, 1).unbind(-1)  # [N, K/g] each
        return ((q - 8) * scale[..., None] + zero[..., None]).view(n, k)

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)


class Fp16Linear(nn.Module):
    """y = x W^T + b with W in fp16, float32 in and out.

    Where the C kernels build (x86 with AVX2, a C compiler), W is kept as the tiles of
    kernels/fp16_gemv.c, whose kernel is row-invariant by construction; for prompts it is within
    10-40% of FBGEMM's GEMM here, and widening W for a float32 GEMM cost more than that (measured,
    BENCHMARKS.md). Elsewhere W is FBGEMM's packed copy
    (models/formats/fp16_kernel.py, padded for row invariance); `packed_nbytes` counts that copy, which is
    not a tensor. Either way the weights are W rounded to fp16 and the sums are float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_fp16 = None
        if kernels.available() and fp16_gemv.takes(weight):
            self.register_buffer("tiles", fp16_gemv.pack_tiles(weight))
        else:
            self.tiles = None
            self.packed_fp16 = prepack_fp16(weight)
            self.packed_nbytes = weight.numel() * 2
        self.handle = register(self)  # how a compiled step names these weights
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def c_linear(self) -> Linear | None:
        """How decoder_layer.c reads these weights: the tiles; None without them (FBGEMM's copy)."""
        if self.tiles is None:
            return None
        return Linear(FP16_TILES, self.tiles.data_ptr(), None, None, 0, pointer(self.bias), 0)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] float32 -> rows W^T [M, N] float32 (no bias); a row's bits do not depend on M."""
        if self.tiles is not None and kernels.enabled():
            return fp16_gemv.fp16_matmul(rows, self.tiles, self.out_features)
        if self.packed_fp16 is None:  # SPECDRAFT_KERNELS=0: PyTorch's own kernel, on a copy made once
            self.packed_fp16 = prepack_fp16(fp16_gemv.unpack_rows(self.tiles, 0, self.out_features))
        return fp16_mm(rows, self.packed_fp16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.specdraft.fp16_linear(rows, self.handle, self.out_features)
        elif self.tiles is not None and kernels.enabled():
            y = fp16_gemv.fp16_matmul(rows, self.tiles, self.out_features, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        else:
            y = self.matmul(rows)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


INT8_PACK_MULTIPLE = 16  # _weight_int8pack_mm crashes (segfault) on other input widths


def compact_matrix(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, dtype: torch.dtype) -> nn.Module | None:
    """`weight` [N, K] (and bias) as a `fmt` module, or None where no kernel takes its shape."""
    if fmt == "fp16":
        return Fp16Linear(weight, bias)
    if fmt in BLOCK_FORMATS:
        n, k = weight.shape
        if n % q8_act_linear.OUT_BLOCK or k % q8_act_linear.ACT_GROUP:
            return None
        blocks = q8_act_linear.int8_blocks(weight) if fmt == "q8" else q8_act_linear.int4_blocks(weight)
        return q8_act_linear.Q8ActLinear(blocks, bias)
    if fmt == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return Int4Linear(weight, bias, dtype)
    if fmt not in ("int8", "int4"):
        raise ValueError(f"unknown weight format {fmt!r}")
    # int4 on a width its groups do not divide: int8 keeps it compact.
    return Int8Linear(weight, bias, dtype) if weight.shape[1] % INT8_PACK_MULTIPLE == 0 else None


def compact_linear(linear: nn.Linear, fmt: str, dtype: torch.dtype) -> nn.Module:
    """The packed version of `linear`, or `linear` itself where no kernel takes its input width."""
    return compact_matrix(linear.weight, linear.bias, fmt, dtype) or linear


def compact_weights(model: nn.Module, fmt: str, blocks: dict[str, Blocks] | None = None) -> list[str]:
    """Replace every nn.Linear of the decoder layers and the LM head by its `fmt` version, in place
    (what StreamingCompactor already compacted while loading is left as it is).

    The head that scores all V tokens becomes `model.packed_head`. The embedding table stays
    unpacked (input lookups, the screened head and the MTP drafter's clustered head read its
    rows): in the model's dtype, or in fp16 under "fp16" (`narrow_tables`), or as the checkpoint
    stores it under q8 / q4. "gguf" takes the source file's blocks
    (loading.gguf_blocks.read_blocks). Returns notes for the user.
    """
    if fmt == "dtype":
        return []
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r} (use {', '.join(WEIGHT_FORMATS)})")
    if fmt == "gguf":
        return _gguf_weights(model, blocks)
    if fmt == "gguf-q8":
        q8_act_linear.require_kernel()  # before anything changes
        notes = [n.replace("--weights gguf", "--weights gguf-q8") for n in _gguf_weights(model, blocks)]
        kept = q8_act_linear.use_q8_activations(model)
        if isinstance(model.packed_head, q8_act_linear.Q8ActLinear):
            # what still reads the float32 table (input embeddings, the MTP drafter's candidate
            # scores) reads it in fp16: rows rounded at 2^-11, well inside the int8 rows' 2^-8,
            # and half its bytes (335 MB less for Gemma 3 270M, half a draft step's gathers)
            narrow_tables(model)
        if kept:
            notes.append(f"--weights gguf-q8: {len(kept)} matrix(es) of shapes the int8 kernel does not take keep "
                         f"float32 rows: {', '.join(kept[:4])}" + (" ..." if len(kept) > 4 else ""))
        return notes
    dtype = model.dtype
    check_compactable(fmt, dtype, model.head_weight.device.type)
    if hasattr(model, "fuse_projections"):
        model.fuse_projections()  # fewer, wider kernel calls per layer
    for child in _compactable_modules(model):
        if hasattr(child, "compact_experts"):
            child.compact_experts(lambda w: compact_matrix(w, None, fmt, dtype))
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.Linear and sub is not model.lm_head:
                setattr(child, attr, compact_linear(sub, fmt, dtype))
    if model.packed_head is None:
        compact_head(model, model.head_weight, fmt, dtype)
    own_small_tensors(model)
    return []


def _compactable_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose linears a format packs: the decoder layers', and the model's own ones other
    than the LM head (Gemma 4's per-layer input projection is read every step too)."""
    return [m for m in model.modules() if m is not model.lm_head]


def check_compactable(fmt: str, dtype: torch.dtype, device: str) -> None:
    if device != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"--weights {fmt} needs the CPU in bfloat16 or float32 (torch's packed kernels); "
                         f"this model runs in {dtype} on {device}")
    if fmt in ("fp16",) + BLOCK_FORMATS and dtype != torch.float32:
        raise ValueError(f"--weights {fmt} computes in float32; this model runs in {dtype}")
    if fmt in BLOCK_FORMATS:
        q8_act_linear.require_kernel()


def compact_head(model: nn.Module, head: torch.Tensor, fmt: str, dtype: torch.dtype) -> None:
    """`model.packed_head` from the [V, H] head weight in `fmt`, computing in `dtype`."""
    if fmt in BLOCK_FORMATS:
        model.packed_head = compact_matrix(head, None, fmt, dtype) or Int8Head(head.to(dtype), dtype)
    elif fmt == "fp16":
        model.packed_head = Fp16Linear(head, None)  # greedy steps screen with it (models/formats/screened_head.py)
        narrow_tables(model)
    elif fmt == "int8" or head.shape[1] % INT4_GROUP:  # the compiled int8 head takes any width
        model.packed_head = Int8Head(head, dtype)  # compiles on first use; Runtime.load warms it up
    else:
        model.packed_head = Int4Linear(head, None, dtype)


def _gguf_weights(model: nn.Module, blocks: dict[str, Blocks] | None) -> list[str]:
    """--weights gguf: every linear whose GGUF blocks rebuild its float32 weight bit for bit
    becomes a BlockLinear; the rest stay float32 (named in the returned note)."""
    if not blocks:
        raise ValueError("--weights gguf keeps a GGUF file's quantised blocks: it needs a model loaded "
                         "from a .gguf file or a preset")
    if model.head_weight.device.type != "cpu" or model.dtype != torch.float32:
        raise ValueError(f"--weights gguf computes in float32 on the CPU; this model runs in {model.dtype} "
                         f"on {model.head_weight.device.type}")
    block_linear.library()  # a missing compiler is reported before anything changes
    for name, module in model.named_modules():
        if type(module) is nn.Linear and f"{name}.weight" in blocks:
            module.gguf_blocks = blocks[f"{name}.weight"]  # carried through fusion (layers.stack_linears)
    if hasattr(model, "fuse_projections"):
        model.fuse_projections()
    kept: list[str] = []
    for child_name, child in list(model.layers.named_modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is not nn.Linear:
                continue
            source = sub.__dict__.pop("gguf_blocks", None)
            packed = None if source is None else block_linear.exact_block_linear(sub.weight, sub.bias, source)
            if packed is None:
                kept.append(f"layers.{child_name}.{attr}")
            else:
                setattr(child, attr, packed)
    head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    head = blocks.get(head_name)
    if head is not None:
        model.packed_head = block_linear.exact_block_linear(model.head_weight, None, head)
    if model.packed_head is None:
        kept.append("the LM head")
    own_small_tensors(model)
    return [f"--weights gguf: no exact GGUF blocks for {len(kept)} weight(s), kept in float32: {', '.join(kept[:4])}"
            + (" ..." if len(kept) > 4 else "")] if kept else []


SMALL_TENSOR = 1 << 22  # elements: norms and biases, not tables


def own_small_tensors(model: nn.Module) -> None:
    """Copy the model's small tensors into memory of their own.

    A checkpoint loads zero-copy: a tensor that needs no conversion is a view of the file's
    memory map, and any one of them keeps the whole map, and every page of it that packing read,
    counted in the process's resident memory (Gemma 3 270M in float32: +1 GB after packing).
    Once the linears are packed, what stays of the checkpoint is small (norms, biases) unless a
    table is kept as loaded; copying the small ones releases the map otherwise.
    """
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.numel() < SMALL_TENSOR:
                t.data = t.data.clone()


def narrow_tables(model: nn.Module) -> None:
    """Store the token table (and an untied head's dense copy) in fp16 under --weights fp16 and gguf-q8.

    The head already scores with the fp16-rounded table (its packed copy); what else reads the
    table (input embeddings, the screened head's exact rescoring, the MTP drafter's clustered
    head) then reads the same fp16 values, widened exactly to float32 where they are used, and
    the model holds half the bytes: 335 MB less for Gemma 3 270M's 262144 x 640 table. It is
    kept in 2 MB pages (models/formats/huge_pages.py): the drafter reads its rows all over.
    """
    for module in (model.embed_tokens, model.lm_head):
        if module is not None and module.weight.dtype == torch.float32:
            module.weight = nn.Parameter(huge_copy(module.weight.detach(), torch.float16), requires_grad=False)


def head_scores(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's raw scores [..., V] (no softcap): in the model's dtype, or float32 from the
    int8 head, whose loop accumulates in float32 anyway."""
    packed = getattr(model, "packed_head", None)
    return F.linear(hidden, model.head_weight) if packed is None else packed(hidden)
