"""Build the C kernels beside this file into one shared library, once, and load it."""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.cache_dir import cache_root
from specdraft.device import cpu_flags, cpu_vendor
from specdraft.errors import SpecdraftError

HERE = Path(__file__).resolve().parent
SOURCES = sorted(HERE.glob("*.c"))
HEADERS = sorted(HERE.glob("*.h"))
# No FMA contraction: block_gemv.c rebuilds w = s*c - o with llama.cpp's two roundings.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
# On CPUs that have them, block_gemv.c and int8_screen.c take 16-lane and VNNI loops (#ifdef
# __AVX512F__ / __AVX512VNNI__): a greedy step 1.07 / 1.15 / 1.02 / 1.10x faster at widths 1 / 2 / 4 / 8
# on a 2-core Zen 4 EPYC, alternated in one process (BENCHMARKS.md). SPECDRAFT_KERNEL_ISA=avx2
# builds the AVX2 loops anywhere.
AVX512 = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq",
          "avx512_vnni": "-mavx512vnni"}

# Intel CPUs: the int8 matrix kernel fetches the next block ahead from one row on, not two
# (q8_act_gemv.c, FETCH_ROWS): a Xeon's prefetcher falls behind a one-row pass, a Zen 4's does not.
INTEL = ["-DFETCH_ROWS=1"]

_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # name: argument types (every kernel returns nothing)
    "block_gemv": [_PTR] * 5 + [_I64] * 4 + [_INT],
    "block_dequantize": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "block_gemv_packed": [_PTR] * 4 + [_I64, _PTR] + [_I64] * 3 + [_INT],
    "unpack_codes": [_PTR, _I64, _PTR, _I64, _I64, _INT],
    "attend_rows": [_PTR] + [_I64] * 3 + [_PTR, _PTR] + [_I64] * 4 + [_PTR] + [_I64] * 2 + [_PTR]
                   + [_I64] * 6 + [_FLOAT, _FLOAT, _PTR, _INT],
    "attend_rows_kv": [_PTR] + [_I64] * 3 + [_PTR, _PTR] + [_I64] * 4 + [_INT, _PTR] + [_I64] * 2 + [_PTR]
                      + [_I64] * 6 + [_FLOAT, _FLOAT, _PTR, _INT],
    "attend_prefill": [_PTR] + [_I64] * 3 + [_PTR, _PTR] + [_I64] * 4 + [_INT, _PTR] + [_I64] * 2 + [_PTR]
                      + [_I64] * 6 + [_FLOAT, _FLOAT, _INT],
    "q8_quantize_rows": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT],
    "q8_act_quantize": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT],
    "q8_act_gemv": [_PTR] * 5 + [_INT, _INT, _INT] + [_PTR] * 3 + [_I64] * 4 + [_INT],
    "q8_gemv": [_PTR] * 5 + [_I64] * 3 + [_INT],
    "screen_candidates": [_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT],
    "rescore_candidates": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT],
    "argmax_rows": [_PTR, _I64, _I64, _PTR, _INT],
    "sample_rows": [_PTR, _I64, _I64, _PTR, _PTR, _INT],
    "truncated_probs": [_PTR, _I64, _I64, _I64, _FLOAT, _I64, _PTR, _PTR, _INT],
    "score_rows": [_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _INT],
    "draft_head": [_PTR, _PTR, _INT, _PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 9 + [_I64, _I64, _INT],
    "rms_norm_rows": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT],
    "residual_norms": [_PTR, _INT] + [_PTR] * 5 + [_I64, _I64, _FLOAT, _INT],
    "qk_rope_write": [_PTR] + [_I64] * 5 + [_PTR, _PTR, _FLOAT] + [_PTR] * 5 + [_I64, _I64, _PTR, _I64, _I64, _INT],
    "gated_act": [_PTR, _I64, _I64, _INT, _PTR, _INT],
    "fp16_gemv": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "decoder_layer": [_PTR] * 5 + [_INT],
    "decoder_stack": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _INT],
    "draft_step": [_PTR, _PTR, _PTR, _I64] + [_PTR] * 8 + [_INT],
    "gemma4_stack": [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _INT],
    "gemma4_timers": [_INT, _PTR],
    "gguf_repack": [_PTR, _INT, _I64, _I64, _INT, _PTR, _PTR, _PTR, _INT],
}


class KernelUnavailable(SpecdraftError):
    pass


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def avx512_here() -> bool:
    """Whether this CPU has every AVX-512 extension the wide loops use."""
    return set(AVX512) <= cpu_flags()


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The kernels for this CPU, chosen once per process: with the AVX-512 loops where it has
    them (unless SPECDRAFT_KERNEL_ISA=avx2, or the compiler cannot build them), else the AVX2 ones."""
    if os.environ.get("SPECDRAFT_KERNEL_ISA", "").lower() != "avx2" and avx512_here():
        try:
            return library_for(True)
        except KernelUnavailable:
            pass
    return library_for(False)


@lru_cache(maxsize=2)
def library_for(avx512: bool) -> ctypes.CDLL:
    """The compiled kernels, built once per sources, compiler and flags into $SPECDRAFT_CACHE/kernels."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise KernelUnavailable("the C kernels need an x86 CPU with AVX2 and FMA")
    flags = FLAGS + (list(AVX512.values()) if avx512 else []) + (INTEL if cpu_vendor() == "GenuineIntel" else [])
    digest = hashlib.sha256(" ".join([_compiler(), *flags]).encode())
    for source in SOURCES + HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    target = cache_root() / "kernels" / f"specdraft-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            try:
                subprocess.run([_compiler(), *flags, "-o", str(built), *map(str, SOURCES)], check=True,
                               capture_output=True, text=True, timeout=180)
            except FileNotFoundError:
                raise KernelUnavailable(f"no C compiler found ({_compiler()!r}) to build specdraft's CPU kernels; "
                                        f"install gcc or set CC") from None
            except subprocess.CalledProcessError as e:
                raise KernelUnavailable(f"building specdraft's CPU kernels failed:\n{e.stderr.strip()}") from None
            os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    lib = ctypes.CDLL(str(target))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.decoder_layer_scratch.argtypes, lib.decoder_layer_scratch.restype = [_PTR, _I64, _I64], _I64
    lib.decoder_stack_scratch.argtypes, lib.decoder_stack_scratch.restype = [_PTR, _PTR, _I64], _I64
    lib.gemma4_stack_scratch.argtypes, lib.gemma4_stack_scratch.restype = [_PTR, _PTR, _I64], _I64
    lib.omp_region_seconds.argtypes, lib.omp_region_seconds.restype = [_INT, _INT], ctypes.c_double
    lib.draft_step_scratch.argtypes, lib.draft_step_scratch.restype = [_PTR, _PTR, _PTR, _I64], _I64
    lib.attend_work.argtypes, lib.attend_work.restype = [_I64] * 5, _I64
    lib.specdraft_avx512 = avx512
    return lib


def library_is_avx512() -> bool:
    """Whether `library()` is the build with the AVX-512 loops."""
    return library().specdraft_avx512


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernels build and load here (x86 with AVX2, a C compiler); asked once per process."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def enabled() -> bool:
    """Whether eager steps use the attention and norm kernels: where they build, unless
    SPECDRAFT_KERNELS=0 (PyTorch's ops then, the reference they are tested against)."""
    return os.environ.get("SPECDRAFT_KERNELS", "1") != "0" and available()


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels serve this forward: float32 on the CPU, no autograd, not being compiled."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and enabled())
