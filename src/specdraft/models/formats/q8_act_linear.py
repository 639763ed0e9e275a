"""Linears over GGUF blocks with int8 activations, on x86 CPUs with AVX2 (--weights gguf-q8).

The same weights as --weights gguf (models/formats/block_linear.py), w = s * c - o per group, but each
input row is rounded to int8 per 32 inputs (llama.cpp's Q8_0 activations) and multiplied by the
codes as integers, 64 products an instruction with AVX-512 VNNI, 32 with AVX2, the same bits
either way (kernels/q8_act_gemv.c). --weights gguf computes
the float32 model exactly up to the order of sums and spends one float32 multiply-add a weight
and a row; here a row costs about a third of that, so a verification of K + 1 positions costs
little more than one step. What it costs in quality against float32 is measured, not assumed
(BENCHMARKS.md).

Every (output, row) pair is summed in one fixed order whatever the number of rows, so
speculative output still equals plain output. Prompts take the same kernel (its integer
products run near a bf16 GEMM's speed there and need no second copy of the weights).
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models.formats.block_linear import BlockLinear, Blocks
from specdraft.models.kernels import build
from specdraft.models.kernels.decoder_layer import Q8_ACT, Linear, pointer

OUT_BLOCK = 16  # outputs interleaved per 64-byte step (q8_act_gemv.c)
ACT_GROUP = 32  # inputs per activation scale
HALF_SCALES = 4  # q8_act_gemv.c's flag on `layout`: fp16 scales


def kernel_available() -> bool:
    """Whether this CPU and build run the kernel: any build of the kernels (AVX2, or AVX-512 with
    VNNI: the same integers and the same float32 epilogue, so the same bits)."""
    return build.available()


def require_kernel() -> None:
    if not kernel_available():
        raise SpecdraftError("--weights gguf-q8 needs an x86 CPU with AVX2 (and a C compiler); "
                             "use --weights gguf")


def interleave_codes(codes: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Unsigned codes u [N, K] -> the kernel's layout: per block of 16 outputs and step of 4 inputs,
    the 16 outputs' 4 codes (64 bytes); nibbles: two steps a byte, step 2j low, 2j + 1 high."""
    n, k = codes.shape
    if nibbles:
        u = codes.view(n // OUT_BLOCK, OUT_BLOCK, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
        return (u[:, :, 0] | (u[:, :, 1] << 4)).contiguous()
    return codes.view(n // OUT_BLOCK, OUT_BLOCK, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def by_output_block(t: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, K/G] -> [N/16, K/G, 16], the order the kernel reads them."""
    n, groups = t.shape
    return t.view(n // OUT_BLOCK, OUT_BLOCK, groups).permute(0, 2, 1).contiguous()


def q8_act_mm(rows: torch.Tensor, codes: torch.Tensor, layout: int, base: int, code_max: int, scales: torch.Tensor,
              offsets: torch.Tensor | None, n: int, group: int) -> torch.Tensor:
    """rows [M, K] float32 -> [M, N] float32 (see the module docstring); code_max: the largest code
    as the layout keeps it (unsigned, or |c| for signed bytes), which bounds the AVX2 loop's sums."""
    rows = rows.float().contiguous()
    m, k = rows.shape
    out = torch.empty(m, n, dtype=torch.float32)
    if not m:
        return out
    threads, lib = torch.get_num_threads(), build.library()
    q = torch.empty(m, k, dtype=torch.int8)
    a, b, sums = torch.empty(m, k // group), torch.empty(m, k // group), torch.empty(m, k // group, dtype=torch.int32)
    lib.q8_act_quantize(rows.data_ptr(), m, k, group, q.data_ptr(), a.data_ptr(), b.data_ptr(), sums.data_ptr(),
                        threads)
    lib.q8_act_gemv(q.data_ptr(), a.data_ptr(), b.data_ptr(), sums.data_ptr(), codes.data_ptr(), layout, base,
                    code_max, scales.data_ptr(), None if offsets is None else offsets.data_ptr(), out.data_ptr(), m,
                    n, k, group, threads)
    return out


def int8_blocks(weight: torch.Tensor, group: int = ACT_GROUP) -> Blocks:
    """Float weights [N, K] -> symmetric int8 codes with one float32 scale per `group` inputs
    (GGUF's Q8_0 layout): what Q8ActLinear reads, ~1.1 bytes a weight against fp16's 2."""
    return symmetric_blocks(weight, 127, group)


def int4_blocks(weight: torch.Tensor, group: int = ACT_GROUP) -> Blocks:
    """Float weights [N, K] -> symmetric 4-bit codes (-7..7) with one float32 scale per `group`
    inputs (GGUF's Q4_0 idea): Q8ActLinear keeps them two a byte, ~0.63 bytes a weight."""
    return symmetric_blocks(weight, 7, group)


def symmetric_blocks(weight: torch.Tensor, top: int, group: int = ACT_GROUP, chunk: int = 8192) -> Blocks:
    """codes = round(w / s) in [-top, top], s = max|w| / top per group of inputs; `chunk` rows at a
    time, so a 262k-row table needs no float32 copy of itself."""
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=torch.float32)
    for lo in range(0, n, chunk):
        grouped = weight[lo : lo + chunk].detach().float().view(-1, k // group, group)
        s = grouped.abs().amax(-1) / top
        q = torch.round(grouped / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None])
        codes[lo : lo + chunk] = q.to(torch.int8).view(-1, k)
        scales[lo : lo + chunk] = s
    return Blocks(codes, scales, None, group)


class Q8ActLinear(nn.Module):
    """y = x W^T + b with W kept as GGUF blocks and x rounded to int8 per 32 inputs; float32 in and out."""

    @staticmethod
    def takes(blocks: Blocks) -> bool:
        """Whether the kernel takes these blocks: outputs in blocks of 16, inputs in blocks of 32,
        groups of 16 or 32, codes spanning at most 256 values."""
        n, k = blocks.codes.shape
        return (n % OUT_BLOCK == 0 and k % ACT_GROUP == 0 and blocks.group in (16, 32)
                and int(blocks.codes.max()) - int(blocks.codes.min()) <= 255)

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None):
        super().__init__()
        if not self.takes(blocks):
            raise ValueError(f"--weights gguf-q8 takes no {tuple(blocks.codes.shape)} matrix in groups of {blocks.group} "
                             f"(outputs in blocks of {OUT_BLOCK}, inputs in blocks of {ACT_GROUP}, 256 codes at most)")
        n, k = blocks.codes.shape
        self.out_features, self.in_features, self.group = n, k, blocks.group
        self.code_base = base = int(blocks.codes.min())
        span = int(blocks.codes.max()) - base
        self.nibbles = span <= 15  # 4-bit codes (Q4_K, Q4_0/1) stay two a byte
        # The kernel's layout (q8_act_gemv.c): 0 unsigned bytes, 1 nibbles, 2 signed bytes. AVX2's
        # 16-bit pair sums are exact for unsigned codes spanning at most 129 values; wider ones
        # (Q8_0, int8_blocks) go signed there, with |c| against rows signed by c.
        signed = span > 129 and not build.library_is_avx512()
        self.layout = 1 if self.nibbles else 2 if signed else 0
        if signed:
            self.code_base = 0
            codes = blocks.codes.view(torch.uint8)  # the int8 bits as they are
            self.code_max = int(blocks.codes.to(torch.int16).abs().max())
        else:
            codes = (blocks.codes.to(torch.int16) - base).to(torch.uint8)
            self.code_max = span
        self.register_buffer("packed_codes", interleave_codes(codes, self.nibbles))
        scales = blocks.scales.float()
        # fp16 scales where each is exactly its float32 value (Q8_0's are, as the file stores them)
        # and there are no offsets: the same numbers in half the bytes (the head reads 6% less)
        half = blocks.offsets is None and bool((scales.half().float() == scales).all())
        self.register_buffer("scales", by_output_block(scales.half() if half else scales))
        self.register_buffer("offsets", None if blocks.offsets is None else by_output_block(blocks.offsets.float()))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def kernel_layout(self) -> int:
        """`layout` as q8_act_gemv.c takes it: the codes' layout, with HALF_SCALES for fp16 scales."""
        return self.layout | (HALF_SCALES if self.scales.dtype == torch.float16 else 0)

    def c_linear(self) -> Linear:
        """How decoder_layer.c reads these weights (Q8_ACT plus the codes' layout)."""
        return Linear(Q8_ACT + self.kernel_layout, self.packed_codes.data_ptr(), self.scales.data_ptr(),
                      pointer(self.offsets), self.group, pointer(self.bias), self.code_base, self.code_max)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        mm = q8_act_mm_op if torch.compiler.is_compiling() else q8_act_mm
        y = mm(rows, self.packed_codes, self.kernel_layout, self.code_base, self.code_max, self.scales, self.offsets,
               self.out_features, self.group)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


q8_act_mm_op = torch.library.custom_op("specdraft::q8_act_mm", q8_act_mm, mutates_args=())


@q8_act_mm_op.register_fake
def _(rows, codes, layout, base, code_max, scales, offsets, n, group):
    return rows.new_empty(rows.shape[0], n, dtype=torch.float32)


def use_q8_activations(model: nn.Module) -> list[str]:
    """Every BlockLinear of the decoder layers, and the LM head's, that the kernel takes becomes a
    Q8ActLinear: the head's greedy argmax and sampled logits then come from int8 rows like every
    layer's (no exact screen: these logits are the format's own), and a wide verify costs about as
    little there as in the layers. Returns the names of those it does not take (they keep float32 rows)."""
    require_kernel()
    places = [(f"layers.{name}.{attr}", child, attr) for name, child in model.layers.named_modules()
              for attr, _ in child.named_children()]
    kept = []
    for name, owner, attr in places + [("the LM head", model, "packed_head")]:
        sub = getattr(owner, attr)
        if type(sub) is not BlockLinear:
            continue
        blocks = sub.blocks
        if Q8ActLinear.takes(blocks):
            setattr(owner, attr, Q8ActLinear(blocks, sub.bias))
        else:
            kept.append(name)
    return kept
