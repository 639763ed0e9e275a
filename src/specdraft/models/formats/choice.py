"""Choosing the compute dtype and the weight format: `auto` means the fastest exact-enough option
for this device, CPU and model."""

from __future__ import annotations

import torch

from specdraft.device import DTYPES, cpu_has_bf16_units
from specdraft.errors import SpecdraftError
from specdraft.models.formats.fp16_kernel import fp16_kernel_available
from specdraft.models.formats.q8_act_linear import kernel_available as q8_kernel_available

FLOAT32_WEIGHTS = ("fp16", "gguf", "gguf-q8", "q8", "q4")  # formats whose CPU kernels take float32 rows


def resolve_dtype(name: str, device: torch.device, weights: str = "auto", gguf_blocks: bool = False,
                  large: bool = False) -> torch.dtype:
    """auto = bfloat16 on CUDA or on CPUs with bf16 units, else float32; but float32 on any CPU
    where the weights run on float32 kernels: --weights fp16 or gguf, or weights auto for a model
    whose GGUF blocks the C kernels read (`gguf_blocks`): on an AVX512-BF16 EPYC those steps
    measured 1.6x faster than bfloat16 with int8 weights (BENCHMARKS.md), and float32 is exact.
    Also float32 for a `large` model with weights auto where the q8 kernel runs (see resolve_weights)."""
    if name == "auto":
        blocks = gguf_blocks or (large and device.type == "cpu" and q8_kernel_available())
        if device.type == "cpu" and (weights in FLOAT32_WEIGHTS or (weights == "auto" and blocks)):
            return torch.float32
        if device.type == "cuda" or cpu_has_bf16_units():
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise SpecdraftError(f"unknown dtype {name!r} (use auto, float32 or bfloat16)")
    return DTYPES[name]


WEIGHT_CHOICES = ("auto", "dtype", "int8", "int4", "fp16", "gguf", "gguf-q8", "q8", "q4")
# From this many parameters in its matrices a model is large: at float32 arithmetic on a CPU without
# bf16 units, auto then takes q8 (8-bit blocks, a third of fp16 bytes and cheap wide verifies)
LARGE_MODEL_PARAMETERS = 1_000_000_000
PACKABLE_DTYPES = (torch.bfloat16, torch.float32)  # what torch's packed CPU kernels take


def resolve_weights(name: str, device: torch.device, dtype: torch.dtype, dtype_chosen: bool = False,
                    gguf_blocks: bool = False, int8_rows: bool = False, large: bool = False) -> str:
    """How weights are stored: `dtype` (as --dtype says), packed int8/int4, fp16, or a GGUF
    file's own blocks (CPU only).

    When --dtype auto chose float32 (`dtype_chosen`: any CPU for a model from a GGUF file whose
    blocks the C kernels read, see resolve_dtype; else a CPU without bf16 units) auto = the
    file's blocks for such a model (`gguf_blocks`): gguf-q8 where `int8_rows` (the C kernels
    build: rows rounded to int8 per 32 inputs, as llama.cpp computes; on a VNNI CPU plain steps
    ~1.06x and verifications of 4 tokens ~1.4x faster than gguf's, on an AVX2-only EPYC plain
    decoding 1.13x; per-token KL 0.002 against float32, BENCHMARKS.md), else gguf (the file's exact float32 weights, float32 arithmetic); else fp16
    (half of float32's bytes at float32's arithmetic; torch's int8 kernels are compute-bound
    without bf16 units). auto = int8 on a CPU in bfloat16: it halves the bytes every step reads
    and its kernel gives a row the same bits whatever the number of rows (BENCHMARKS.md, weight
    formats). A float32 the user asked for stays unquantised: it is the exactness reference.
    A `large` model (LARGE_MODEL_PARAMETERS) in float32 chosen by auto takes q8 instead of fp16:
    at these sizes memory decides whether it loads at all, and 8-bit blocks are what llama.cpp
    users run."""
    if name not in WEIGHT_CHOICES:
        raise SpecdraftError(f"unknown weights {name!r} (use {', '.join(WEIGHT_CHOICES)})")
    packable = device.type == "cpu" and dtype in PACKABLE_DTYPES
    if name == "auto":
        if packable and dtype == torch.bfloat16:
            return "int8"
        if dtype_chosen and device.type == "cpu" and dtype == torch.float32:
            if gguf_blocks:
                return "gguf-q8" if int8_rows else "gguf"
            if large and q8_kernel_available():
                return "q8"
            if fp16_kernel_available():
                return "fp16"
        return "dtype"
    if name in ("int8", "int4") and not packable:
        raise SpecdraftError(f"--weights {name} runs on torch's packed CPU kernels; "
                             f"use --device cpu, or --weights dtype")
    if name in ("gguf", "gguf-q8") and (device.type != "cpu" or dtype != torch.float32):
        raise SpecdraftError(f"--weights {name} runs a CPU kernel that takes float32 rows; "
                             "use --device cpu with --dtype float32 or auto")
    if name in ("q8", "q4") and (device.type != "cpu" or dtype != torch.float32 or not q8_kernel_available()):
        raise SpecdraftError(f"--weights {name} runs a C kernel on x86 CPUs with AVX2 that takes float32 rows; "
                             "use --device cpu with --dtype float32 or auto, or --weights dtype")
    if name == "fp16" and (device.type != "cpu" or dtype != torch.float32 or not fp16_kernel_available()):
        raise SpecdraftError("--weights fp16 runs on FBGEMM's x86 CPU kernel with float32 activations; "
                             "use --device cpu with --dtype float32 or auto on an x86 CPU, or --weights dtype")
    return name


PREFILL_DTYPES = ("auto", "float32", "bfloat16")


def resolve_prefill_dtype(name: str, weights: str, dtype_chosen: bool) -> torch.dtype | None:
    """The arithmetic of prompts (forwards wider than a verification) with --weights gguf; None for
    the other formats, whose prompts run in --dtype. auto = bfloat16 where --dtype auto chose
    float32 on a CPU with bf16 units (AMX, AVX512-BF16): a bf16 GEMM runs 2.5-3x a float32 one
    there, prompts 2.1x faster in all, at a per-token KL of 6e-4 against float32 prompts
    (BENCHMARKS.md); else float32. Decode steps and verifications stay float32 either way, so
    speculative output still equals plain output. A float32 the user asked for stays float32."""
    if name not in PREFILL_DTYPES:
        raise SpecdraftError(f"unknown prefill dtype {name!r} (use {', '.join(PREFILL_DTYPES)})")
    if weights != "gguf":
        if name != "auto":
            raise SpecdraftError(f"--prefill-dtype {name} applies to --weights gguf; with --weights {weights} "
                                 "prompts run in --dtype")
        return None
    if name == "auto":
        return torch.bfloat16 if dtype_chosen and cpu_has_bf16_units() else torch.float32
    return DTYPES[name]


def check_choices(dtype: str, weights: str, prefill_dtype: str) -> None:
    """Fail on an unknown --dtype, --weights or --prefill-dtype before any work."""
    if dtype != "auto" and dtype not in DTYPES:
        raise SpecdraftError(f"unknown dtype {dtype!r} (use auto, float32 or bfloat16)")
    if weights not in WEIGHT_CHOICES:
        raise SpecdraftError(f"unknown weights {weights!r} (use {', '.join(WEIGHT_CHOICES)})")
    if prefill_dtype not in PREFILL_DTYPES:
        raise SpecdraftError(f"unknown prefill dtype {prefill_dtype!r} (use {', '.join(PREFILL_DTYPES)})")
