"""Linears over a GGUF file's own quantised blocks (--weights gguf), on a small AVX2 kernel.

The float32 model converted from a GGUF holds weights that are exactly fl(fl(s * c) - o) for
int8 codes c and per-group scales s and offsets o (loading/gguf_blocks.py). This format keeps
c, s and o (about 1.1-1.25 bytes a weight, against fp16's 2 and float32's 4; 0.75 for 4-bit
codes, kept two a byte where the AVX-512 kernel reads them so) and multiplies by the same
float32 weights: kernels/block_gemv.c rebuilds each weight with llama.cpp's two roundings and
sums the products in float32. Quality is therefore the float32 model's, up to
the order of a sum.

Every (output, row) pair is summed in one fixed order, so a row's result does not depend on the
rows beside it (row-invariant by construction, no padding): speculative output equals plain
output. Prompts take a GEMM where it is faster, chosen by the forward's width (tokens a row),
never by how many rows share the call: in float32, chunks wider than KERNEL_ROWS multiply the
dequantised weights (a 16-row chunk: dequantising and a GEMM 74 ms, the kernel 30; even near 80
rows); after `use_prompt_dtype(model, torch.bfloat16)`, chunks wider than SHORT_FORWARD multiply
a bf16 copy of them kept from load (CPUs with AMX or AVX512-BF16: prompts 2.1x faster on Gemma 3
270M, per-token KL 6e-4 against float32 prompts, BENCHMARKS.md). Decode steps, verifications
and drafting always take the kernel, and the engine prefills chunks of at most SHORT_FORWARD
tokens apart from longer ones.

The kernel is C, built on first use by the system C compiler (`cc`, or $CC) into the cache
folder and loaded with ctypes (models/kernels): torch has no CPU kernel for these block formats, and on an AVX2
CPU its own int8/int4 kernels are slower than fp16 here (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.kv_cache import SHORT_FORWARD
from specdraft.models.kernels import build
from specdraft.models.kernels.decoder_layer import BLOCKS, PACKED_BLOCKS, Linear, pointer

KERNEL_ROWS = 64  # float32 prompts: chunks wider than this take the GEMM (see above)

@dataclass
class TwoLevel:
    """Per-group values as K-quants store them: values[n, g] = multipliers[n, g] * factors[n, g * group // 256],
    exact in float32 (a 6-bit or int8 multiplier times an fp16 factor per 256 inputs)."""

    multipliers: torch.Tensor  # int8 [N, K / group]
    factors: torch.Tensor  # float16 [N, K / 256]


@dataclass
class Blocks:
    """w[n, k] = fl(fl(scales[n, k // group] * codes[n, k]) - offsets[n, k // group])."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / group]
    offsets: torch.Tensor | None  # float32 [N, K / group]; None: all zero
    group: int
    scale_parts: TwoLevel | None = None  # scales as the file keeps them (K-quants), where known
    offset_parts: TwoLevel | None = None

    def dequantized(self) -> torch.Tensor:
        """The float32 weights, rounded as llama.cpp rounds them (a multiply, then a subtract)."""
        w = self.codes.float() * self.scales.repeat_interleave(self.group, dim=1)
        return w if self.offsets is None else w - self.offsets.repeat_interleave(self.group, dim=1)

    def rows(self, index: torch.Tensor) -> "Blocks":
        offsets = None if self.offsets is None else self.offsets[index]
        return Blocks(self.codes[index], self.scales[index], offsets, self.group)

    def regrouped(self, group: int) -> "Blocks":
        """The same weights with groups of `group` (a divisor of self.group): scales repeated."""
        if group == self.group:
            return self
        factor = self.group // group
        offsets = None if self.offsets is None else self.offsets.repeat_interleave(factor, dim=1)
        return Blocks(self.codes, self.scales.repeat_interleave(factor, dim=1), offsets, group)


def stack_blocks(parts: list[Blocks]) -> Blocks:
    """The blocks of the weights stacked row-wise (fused projections): the smallest group, and
    zero offsets where a part has none (fl(x - 0) = x, so its weights do not change)."""
    group = min(p.group for p in parts)
    parts = [p.regrouped(group) for p in parts]
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat([p.offsets if p.offsets is not None else torch.zeros_like(p.scales) for p in parts])
    else:
        offsets = None
    return Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets, group)


KernelUnavailable = build.KernelUnavailable


def library():
    """The compiled kernels (models/kernels), with a message that names this weights option."""
    try:
        return build.library()
    except KernelUnavailable as e:
        raise KernelUnavailable(f"--weights gguf: {e}; or use --weights fp16") from None


def kernel_available() -> bool:
    return build.available()


def block_mm(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
             group: int, base: int = 0) -> torch.Tensor:
    """rows [M, K] float32 -> rows @ W^T [M, N] float32 for W given as blocks (see Blocks): int8
    codes [N, K], or uint8 [N, K/2] 4-bit codes packed by `pack_nibbles` (groups of 32) with
    their `base`."""
    rows = rows.float().contiguous()
    m, k = rows.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m and codes.dtype == torch.uint8:
        library().block_gemv_packed(rows.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                    None if offsets is None else offsets.data_ptr(), base, out.data_ptr(),
                                    m, n, k, torch.get_num_threads())
    elif m:
        library().block_gemv(rows.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                             None if offsets is None else offsets.data_ptr(), out.data_ptr(),
                             m, n, k, group, torch.get_num_threads())
    return out


def packs_nibbles(blocks: "Blocks") -> int | None:
    """The base b of 4-bit codes (every code in b..b+15, groups of 32) when the kernels here take
    them packed two a byte (the AVX-512 build: one permute a weight; the AVX2 build would unpack
    them, slower than reading int8 codes), else None."""
    n, k = blocks.codes.shape
    if blocks.group != 32 or k % 32 or not n or not build.available() or not build.library_is_avx512():
        return None
    lo, hi = int(blocks.codes.min()), int(blocks.codes.max())
    return lo if hi - lo <= 15 else None


def pack_nibbles(codes: torch.Tensor, base: int) -> torch.Tensor:
    """int8 codes [N, K] in base..base+15 -> uint8 [N, K/2]: per group of 32, byte j holds code j
    (minus base) in its low nibble and code 16 + j in its high one (block_gemv.c)."""
    n, k = codes.shape
    u = (codes.to(torch.int16) - base).to(torch.uint8).view(n, k // 32, 2, 16)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_nibbles(nibbles: torch.Tensor, base: int) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K/2] -> int8 codes [N, K]."""
    n, half = nibbles.shape
    codes = torch.empty(n, 2 * half, dtype=torch.int8)
    library().unpack_codes(nibbles.data_ptr(), base, codes.data_ptr(), n, 2 * half, torch.get_num_threads())
    return codes


def block_dequantize(blocks: "Blocks", out: torch.Tensor | None = None) -> torch.Tensor:
    """blocks.dequantized() in one pass of the kernel (the same bits: a multiply, then a subtract),
    into `out` (float32, contiguous) if given."""
    n, k = blocks.codes.shape
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out.view(n, k)
    library().block_dequantize(blocks.codes.data_ptr(), blocks.scales.data_ptr(),
                               None if blocks.offsets is None else blocks.offsets.data_ptr(), out.data_ptr(),
                               n, k, blocks.group, torch.get_num_threads())
    return out


_scratch = torch.empty(0)


def scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of `numel` elements, reused by every float32 prompt GEMM: a fresh one per
    call costs more in page faults (tens of MB a forward) than dequantising into it."""
    global _scratch
    if _scratch.numel() < numel:
        _scratch = torch.empty(numel, dtype=torch.float32)
    return _scratch[:numel]


# A compiled step cannot trace a ctypes call; it calls the kernel through this op. Eager calls
# block_mm directly: the op's dispatch costs tens of microseconds, ~80 times a step.
block_mm_op = torch.library.custom_op("specdraft::block_mm", block_mm, mutates_args=())


@block_mm_op.register_fake
def _(rows, codes, scales, offsets, group, base=0):
    return rows.new_empty(rows.shape[0], codes.shape[0], dtype=torch.float32)


class BlockLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks; float32 in and out."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None):
        super().__init__()
        n, k = blocks.codes.shape
        if blocks.group not in (16, 32) or k % blocks.group:
            raise ValueError(f"blocks of {blocks.group} inputs over {k} inputs: the kernel takes groups of 16 or 32")
        self.out_features, self.in_features, self.group = n, k, blocks.group
        # 4-bit codes (Q4_K, Q4_0/1) are kept two a byte where the kernel reads them so: 0.75
        # bytes a weight instead of 1.25, the same weights and the same sums (block_gemv.c)
        self.code_base = packs_nibbles(blocks)
        packed = self.code_base is not None
        self.register_buffer("codes", None if packed else blocks.codes.contiguous())
        self.register_buffer("nibbles", pack_nibbles(blocks.codes, self.code_base) if packed else None)
        self.register_buffer("scales", blocks.scales.contiguous())
        self.register_buffer("offsets", None if blocks.offsets is None else blocks.offsets.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.register_buffer("prompt_weight", None, persistent=False)  # bf16 prompts: see use_prompt_dtype

    @property
    def blocks(self) -> Blocks:
        codes = self.codes if self.nibbles is None else unpack_nibbles(self.nibbles, self.code_base)
        return Blocks(codes, self.scales, self.offsets, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-2] if x.dim() > 1 else 1  # tokens a row: a prompt's chunk takes a GEMM
        if self.prompt_weight is not None and width > SHORT_FORWARD:
            y = F.linear(x.to(torch.bfloat16), self.prompt_weight).float()
            return y if self.bias is None else y + self.bias
        if width > KERNEL_ROWS:
            weight = scratch(self.out_features * self.in_features)
            return F.linear(x.float(), block_dequantize(self.blocks, weight), self.bias)
        rows = x.reshape(-1, self.in_features)
        mm = block_mm_op if torch.compiler.is_compiling() else block_mm
        if self.nibbles is None:
            y = mm(rows, self.codes, self.scales, self.offsets, self.group)
        else:
            y = mm(rows, self.nibbles, self.scales, self.offsets, self.group, self.code_base)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def c_linear(self) -> Linear:
        """How decoder_layer.c reads these weights: codes (or nibbles), scales, offsets per group."""
        if self.nibbles is not None:
            return Linear(PACKED_BLOCKS, self.nibbles.data_ptr(), self.scales.data_ptr(), pointer(self.offsets),
                          self.group, pointer(self.bias), self.code_base)
        return Linear(BLOCKS, self.codes.data_ptr(), self.scales.data_ptr(), pointer(self.offsets), self.group,
                      pointer(self.bias), 0)

    def set_prompt_dtype(self, dtype: torch.dtype) -> None:
        """float32: prompts multiply the float32 weights (dequantised per call, exact); bfloat16:
        a bf16 copy of them, made now (2 bytes a weight)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"prompts in {dtype}: float32 or bfloat16")
        self.prompt_weight = block_dequantize(self.blocks).bfloat16() if dtype == torch.bfloat16 else None


def use_prompt_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Prompts (forwards wider than SHORT_FORWARD) through the decoder layers' block linears in
    `dtype`. The LM head keeps float32: a prompt scores only its last position."""
    for module in model.layers.modules():
        if isinstance(module, BlockLinear):
            module.set_prompt_dtype(dtype)


def exact_block_linear(weight: torch.Tensor, bias: torch.Tensor | None, blocks: Blocks) -> BlockLinear | None:
    """A BlockLinear for (weight, bias) if `blocks` rebuild the float32 weight bit for bit, else None."""
    if weight.dtype != torch.float32 or tuple(blocks.codes.shape) != tuple(weight.shape):
        return None
    if not torch.equal(blocks.dequantized(), weight):
        return None
    return BlockLinear(blocks, bias)
