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
from specdraft.models.formats.block_linear import BlockLinear, Blocks, TwoLevel
from specdraft.models.formats.huge_pages import empty_huge, huge_copy
from specdraft.models.kernels import build
from specdraft.models.kernels.decoder_layer import Q8_ACT, Linear, pointer

OUT_BLOCK = 16  # outputs interleaved per 64-byte step (q8_act_gemv.c)
ACT_GROUP = 32  # inputs per activation scale
BYTES, NIBBLES, SIGNED, SIXBITS = 0, 1, 2, 3  # q8_act_gemv.c's code layouts
HALF_SCALES, TWO_LEVEL = 4, 8  # q8_act_gemv.c's flags on `layout`: fp16 scales, K-quant scales
SUPER = 256  # inputs per factor of two-level scales


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
        return u[:, :, 0] | (u[:, :, 1] << 4)
    return codes.view(n // OUT_BLOCK, OUT_BLOCK, k // 4, 4).permute(0, 2, 1, 3)  # a view: copied once, by the caller


def interleave_sixbits(codes: torch.Tensor) -> torch.Tensor:
    """Unsigned codes u < 64 [N, K] -> per block of 16 outputs and quad of 4 steps (16 inputs):
    the low nibbles as `interleave_codes` keeps them (128 bytes), then a byte per (output, input)
    slot holding the 4 steps' high 2 bits, step j in bits 2j and 2j + 1 (64 bytes)."""
    n, k = codes.shape
    nib = interleave_codes(codes & 15, nibbles=True).reshape(n // OUT_BLOCK, k // 16, 128)
    high = (codes >> 4).view(n // OUT_BLOCK, OUT_BLOCK, k // 16, 4, 4).permute(0, 2, 1, 4, 3)  # [.., out, in, step]
    two = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
    return torch.cat([nib, two.reshape(n // OUT_BLOCK, k // 16, 64)], dim=-1)


def by_output_block(t: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, K/G] -> [N/16, K/G, 16], the order the kernel reads them."""
    n, groups = t.shape
    return t.view(n // OUT_BLOCK, OUT_BLOCK, groups).permute(0, 2, 1).contiguous()


def two_level_bytes(parts: TwoLevel) -> torch.Tensor:
    """K-quant scales as q8_act_gemv.c reads them: per block of 16 outputs, the int8 multipliers
    [K/G, 16], then the fp16 factors [K/256, 16], as bytes."""
    blocks = parts.multipliers.shape[0] // OUT_BLOCK
    multipliers = by_output_block(parts.multipliers).view(torch.uint8).view(blocks, -1)
    factors = by_output_block(parts.factors).view(torch.uint8).view(blocks, -1)
    return torch.cat([multipliers, factors], dim=1).contiguous()


def _exact_parts(values: torch.Tensor | None, parts: TwoLevel | None, group: int) -> bool:
    """Whether the parts multiply back to exactly these values (so the kernel's scales are the same)."""
    if values is None or parts is None or values.shape[1] * group % SUPER:
        return False
    factors = parts.factors.float().repeat_interleave(SUPER // group, dim=1)
    return factors.shape == values.shape and bool((parts.multipliers.float() * factors == values).all())


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
        six = not self.nibbles and span <= 63  # Q6_K, Q5_0/1: a nibble plane and a 2-bit plane
        # The kernel's layout (q8_act_gemv.c). AVX2's 16-bit pair sums are exact for unsigned codes
        # spanning at most 129 values; wider ones (Q8_0, int8_blocks) go signed there, with |c|
        # against rows signed by c.
        signed = span > 129 and not build.library_is_avx512()
        self.layout = NIBBLES if self.nibbles else SIXBITS if six else SIGNED if signed else BYTES
        if signed:
            self.code_base = 0
            codes = blocks.codes.view(torch.uint8)  # the int8 bits as they are
            self.code_max = int(blocks.codes.to(torch.int16).abs().max())
        else:
            codes = (blocks.codes.to(torch.int16) - base).to(torch.uint8)
            self.code_max = span
        packed = interleave_sixbits(codes) if six else interleave_codes(codes, self.nibbles)
        # 2 MB pages: a step streams every matrix once, and with 4 KB pages each 4 KB costs a TLB
        # miss (a page walk) on the way (BENCHMARKS.md: the gain, measured)
        self.register_buffer("packed_codes", huge_copy(packed))
        self.register_buffer("scales", None)
        self.register_buffer("offsets", None)
        self._pack_scales(blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    # GGUF formats gguf_repack.c lays out straight from the file: (format id, code base, largest
    # unsigned code, group, code layout, scale form, bytes a super-block of 256 values)
    FROM_FILE = {"Q8_0": (0, -128, 255, 32, BYTES, HALF_SCALES, 8 * 34), "Q4_K": (1, 0, 15, 32, NIBBLES, TWO_LEVEL, 144),
                 "Q6_K": (2, -32, 63, 16, SIXBITS, TWO_LEVEL, 210)}

    @classmethod
    def from_file(cls, raw: torch.Tensor, fmt: str, n: int, k: int) -> "Q8ActLinear | None":
        """The linear of an [n, k] matrix whose GGUF bytes are `raw` (uint8), laid out in C straight
        from them (kernels/gguf_repack.c: the same outputs as packing the decoded blocks); None
        where that path does not take the format or shape."""
        if fmt not in cls.FROM_FILE or n % OUT_BLOCK or k % SUPER or not kernel_available():
            return None
        fid, base, top, group, layout, form, per_super = cls.FROM_FILE[fmt]
        if raw.numel() != n * k // SUPER * per_super:
            return None
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.group = n, k, group
        self.nibbles = layout == NIBBLES
        signed = layout == BYTES and not build.library_is_avx512()
        self.layout = SIGNED if signed else layout
        self.code_base, self.code_max = (0, 128) if signed else (base, top)
        code_bytes = {BYTES: k * n, NIBBLES: k * n // 2, SIXBITS: k * n * 3 // 4}[layout]
        blocks = n // OUT_BLOCK
        if form == HALF_SCALES:
            scales = empty_huge((blocks, k // group, OUT_BLOCK), torch.float16)
        else:
            scales = torch.empty(blocks, (k // group) * OUT_BLOCK + (k // SUPER) * OUT_BLOCK * 2, dtype=torch.uint8)
        offsets = torch.empty_like(scales) if fmt == "Q4_K" else None
        codes = empty_huge((blocks, code_bytes // blocks), torch.uint8)
        build.library().gguf_repack(raw.data_ptr(), fid, n, k, int(signed), codes.data_ptr(), scales.data_ptr(),
                                    None if offsets is None else offsets.data_ptr(), torch.get_num_threads())
        self.register_buffer("packed_codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        self.bias = None
        return self

    def _pack_scales(self, blocks: Blocks) -> None:
        """The per-group scales (and offsets) in the fewest bytes that give the kernel the same float32
        numbers: two-level as a K-quant file stores them, fp16 where each scale is exactly one (Q8_0's
        are) and there are no offsets, else float32."""
        scales, offsets, group = blocks.scales.float(), blocks.offsets, blocks.group
        if _exact_parts(scales, blocks.scale_parts, group) and (
                offsets is None or _exact_parts(offsets.float(), blocks.offset_parts, group)):
            self.scales = two_level_bytes(blocks.scale_parts)
            self.offsets = None if offsets is None else two_level_bytes(blocks.offset_parts)
            return
        if offsets is None and bool((scales.half().float() == scales).all()):
            scales = scales.half()
        self.scales = by_output_block(scales)
        self.offsets = None if offsets is None else by_output_block(offsets.float())

    @property
    def kernel_layout(self) -> int:
        """`layout` as q8_act_gemv.c takes it: the codes' layout and the scales' form (two-level
        scales are kept as bytes, fp16 ones as float16)."""
        form = {torch.uint8: TWO_LEVEL, torch.float16: HALF_SCALES}.get(self.scales.dtype, 0)
        return self.layout | form

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
