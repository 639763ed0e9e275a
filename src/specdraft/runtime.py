"""A loaded target ready to generate: model + tokenizer on a device, in a dtype."""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.config import ModelConfig
from specdraft.device import dtype_name, release_free_memory, resolve_device
from specdraft.loading import PRESETS, describe_folder, load_folder, matrix_parameters, resolve_model
from specdraft.loading.footprint import Footprint, check_fits
from specdraft.models.formats.choice import (LARGE_MODEL_PARAMETERS, check_choices, resolve_dtype, resolve_prefill_dtype,
                                             resolve_weights)
from specdraft.models.formats import int8_head, q8_act_linear
from specdraft.models.formats.block_linear import use_prompt_dtype
from specdraft.models.compile import compile_steps
from specdraft.models.formats.quant import INT8_PACK_MULTIPLE, Int8Head, compact_weights
from specdraft.models.formats.screened_head import screen_head
from specdraft.tokenizer import Tokenizer


def generation_eos_ids(folder: Path) -> list[int]:
    """Chat checkpoints often list their end-of-turn token only in generation_config.json."""
    path = folder / "generation_config.json"
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


CPU_SPECULATE_BELOW = 4
DEFAULT_CONTEXT = 4096  # KV positions the memory check counts when the caller names none


def _warm_up_int8_head(head: Int8Head, progress: bool) -> None:
    """Compile the int8 head's loops now, so no generation is timed with a compile in it; say so
    when it took a while (the first run on a machine, before Inductor's cache has them)."""
    t0 = time.perf_counter()
    try:
        int8_head.warm_up(head.in_features)
    except Exception as e:  # Inductor needs a C++ compiler; without one every head call takes the packed kernel
        if head.in_features % INT8_PACK_MULTIPLE:
            raise
        head.compiled = False
        print(f"specdraft: note: the compiled int8 LM head is unavailable ({type(e).__name__}); "
              "using torch's packed int8 kernel, about 2x slower there", file=sys.stderr)
        return
    seconds = time.perf_counter() - t0
    if progress and seconds > 5:
        print(f"specdraft: compiled the int8 LM head in {seconds:.0f} s (cached for later runs)", file=sys.stderr)


@dataclass
class Runtime:
    name: str
    folder: Path
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    notes: list[str] = field(default_factory=list)

    weights: str = "dtype"
    prefill_dtype: torch.dtype | None = None  # prompts' arithmetic with gguf weights (use_prompt_dtype)

    footprint: Footprint | None = None  # the memory estimate checked before loading
    context: int = DEFAULT_CONTEXT  # positions per row that estimate counted

    @classmethod
    def load(cls, name_or_path: str, dtype: str = "auto", device: str = "auto", progress: bool = True,
             weights: str = "auto", compile: bool = False, prefill_dtype: str = "auto", context: int | None = None,
             batch_size: int = 1, prefix_cache_bytes: int = 0) -> "Runtime":
        """Load a target. weights: auto | dtype | int8 | int4 | fp16 | gguf | gguf-q8 | q8 | q4
        (models.formats.choice.resolve_weights); compile: route decode/verify forwards through a
        torch.compile'd step (models/compile.py); prefill_dtype: auto | float32 | bfloat16,
        prompts' arithmetic with gguf weights (models.formats.choice.resolve_prefill_dtype).
        `context` x `batch_size` positions of KV cache are counted in the memory check that runs
        before any weight is read (loading/footprint.py; default context DEFAULT_CONTEXT), with the
        `prefix_cache_bytes` a server's prefix cache may keep."""
        dev = resolve_device(device)
        check_choices(dtype, weights, prefill_dtype)
        if weights != "auto":  # a format that cannot run here fails before any work
            resolve_weights(weights, dev, resolve_dtype(dtype, dev, weights), dtype_chosen=dtype == "auto")
            resolve_prefill_dtype(prefill_dtype, weights, False)
        desc = _direct_gguf(name_or_path, weights, dtype, dev, prefill_dtype)
        if desc is not None:
            return cls._load_gguf(name_or_path, desc, dev, progress, compile, context, batch_size, prefix_cache_bytes)

        def plan(folder: Path | None, described: tuple | None = None) -> tuple:
            """Dtype, format and the memory check, from config.json alone (for a Hub id: before its
            download), or from `described` (config, model on the meta device: a GGUF's header)."""
            cfg, shape = describe_folder(folder) if described is None else described
            blocks = weights == "auto" and _has_blocks(name_or_path, folder)
            large = matrix_parameters(shape) >= LARGE_MODEL_PARAMETERS
            dt = resolve_dtype(dtype, dev, weights, gguf_blocks=blocks, large=large)
            # int8 rows (gguf-q8) where the CPU has the kernel, unless prompts in a float dtype are asked for
            int8_rows = blocks and prefill_dtype == "auto" and q8_act_linear.kernel_available()
            fmt = resolve_weights(weights, dev, dt, dtype_chosen=dtype == "auto", gguf_blocks=blocks,
                                  int8_rows=int8_rows, large=large)
            prompts = resolve_prefill_dtype(prefill_dtype, fmt, dtype_chosen=dtype == "auto")
            ctx = min(context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
            return dt, fmt, prompts, ctx, check_fits(shape, name_or_path, fmt, dt, ctx, batch_size,
                                                     prefix_cache=prefix_cache_bytes)

        _check_conversion(name_or_path, plan, weights, dtype, dev, prefill_dtype, context, batch_size)
        folder = resolve_model(name_or_path, progress, before_download=plan)
        dt, fmt, prompts, context, footprint = plan(folder)
        model, cfg, notes = load_folder(folder, dt, dev, fmt)
        notes += compact_weights(model, fmt, _source_blocks(name_or_path, folder) if fmt.startswith("gguf") else None)
        if prompts is not None:
            use_prompt_dtype(model, prompts)
        if isinstance(getattr(model, "packed_head", None), Int8Head):
            _warm_up_int8_head(model.packed_head, progress)
        screen_head(model)  # float32 dense heads: greedy argmax from an fp16 screen, exact
        if compile:
            compile_steps(model, announce=progress)
        eos = cfg.eos_token_ids + generation_eos_ids(folder)
        rt = cls(name_or_path, folder, model, cfg, Tokenizer(folder, eos), dev, dt, notes, fmt, prompts, footprint,
                 context)
        gc.collect()  # packing's and the tokenizer's temporaries, then their freed heap back to the OS:
        release_free_memory()  # ~190 MB less resident memory for Gemma 3 270M (gguf weights)
        return rt

    @classmethod
    def _load_gguf(cls, name: str, desc, dev: torch.device, progress: bool, compile: bool, context: int | None,
                   batch_size: int, prefix_cache_bytes: int = 0) -> "Runtime":
        """A Gemma 4 GGUF from its own blocks (loading/gguf_direct.py): the memory check from the
        header first, then the weights straight from the file's map into the int8 kernel's
        linears (gguf-q8 arithmetic); no float model, no converted folder."""
        from specdraft.loading.footprint import check_gguf_fits
        from specdraft.loading.gguf_direct import describe_model, load_gguf, tokenizer_folder

        cfg, shape = describe_model(desc)
        context = min(context or DEFAULT_CONTEXT, cfg.max_position_embeddings)
        footprint = check_gguf_fits(shape, desc, name, context, batch_size, prefix_cache=prefix_cache_bytes)
        model, cfg, notes = load_gguf(desc, progress)
        folder = tokenizer_folder(desc)
        if compile:
            compile_steps(model, announce=progress)
        eos = cfg.eos_token_ids + generation_eos_ids(folder)
        rt = cls(name, folder, model, cfg, Tokenizer(folder, eos), dev, torch.float32, notes, "gguf-q8", None,
                 footprint, context)
        gc.collect()
        release_free_memory()
        return rt

    @property
    def verify_width_budget(self) -> int | None:
        """The widest verification that costs about one row block: the packed int8/int4 kernels
        stream the weights once per 4 rows, so on this CPU widths 2-4 cost 1.2-1.4x a plain step
        and width 5 twice it (`specdraft steps`, BENCHMARKS.md). None: no such step in cost (the
        C kernels of fp16 and gguf weights: their cost grows row by row, and the adaptive policy
        reads it from its measurements)."""
        return 4 if self.weights in ("int8", "int4") else None

    @property
    def speculate_below(self) -> int | None:
        """The fixed policy's rule (--draft-policy fixed): rows from which a round runs plain instead
        of drafting: on a CPU a K+1-token verify for 4 rows costs ~3x a plain step for them
        (`specdraft steps`), more than drafts return. The adaptive policy decides from measured costs."""
        return CPU_SPECULATE_BELOW if self.device.type == "cpu" else None

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def nbytes(self) -> int:
        """Bytes of weights and packed buffers (the KV cache is counted apart)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        packed = sum(getattr(m, "packed_nbytes", 0) for m in self.model.modules())  # FBGEMM's fp16 copies
        return sum(t.numel() * t.element_size() for t in tensors) + packed

    @property
    def mapped_bytes(self) -> int:
        """Of nbytes(), the tables kept as views of the checkpoint file (resident only as rows are read)."""
        return getattr(self.model, "mapped_bytes", 0)


def _direct_gguf(name_or_path: str, weights: str, dtype: str, dev: torch.device, prefill_dtype: str):
    """The description of a GGUF file that loads from its own blocks with these settings (a Gemma 4
    target; --weights auto or gguf-q8 in float32 on a CPU where the int8 kernel runs), else None:
    other formats convert the file into a float32 folder first (small models)."""
    from specdraft.loading.gguf_description import describe_gguf
    from specdraft.loading.presets import gguf_source

    path = Path(name_or_path).expanduser()
    if path.suffix != ".gguf" or not path.is_file() or name_or_path in PRESETS:
        return None
    if weights not in ("auto", "gguf-q8") or dtype not in ("auto", "float32") or dev.type != "cpu":
        return None
    if prefill_dtype != "auto" or not q8_act_linear.kernel_available() or gguf_source(name_or_path) is None:
        return None
    desc = describe_gguf(path)
    return desc if desc.direct else None


def _has_blocks(name_or_path: str, folder: Path | None) -> bool:
    """Whether --weights gguf can load this model here: blocks saved by the conversion or a GGUF
    source, and the C kernels build."""
    from specdraft.loading.gguf_blocks import BLOCKS_FILE
    from specdraft.loading.presets import gguf_source
    from specdraft.models.kernels import build

    saved = folder is not None and (folder / BLOCKS_FILE).exists()
    return (saved or gguf_source(name_or_path) is not None) and build.available()


def _check_conversion(name_or_path: str, plan, weights: str, dtype: str, dev: torch.device, prefill_dtype: str,
                      context: int | None, batch_size: int) -> None:
    """Before a .gguf file is converted into a float32 folder (the formats other than its own
    blocks load from one), refuse in one line what cannot fit: the converted model in the
    format asked for (`plan`, from the header), and the conversion itself, which holds every
    weight in float32 (footprint.check_gguf_conversion_fits, naming --weights gguf-q8 where the
    file runs from its own blocks and that fits)."""
    from specdraft.loading.footprint import check_gguf_conversion_fits, estimate_gguf
    from specdraft.loading.gguf_description import describe_gguf
    from specdraft.loading.gguf_direct import describe_model
    from specdraft.loading.presets import unconverted_gguf

    source = unconverted_gguf(name_or_path)
    if source is None:
        return
    desc = describe_gguf(source)
    cfg, shape = describe_model(desc)
    _, fmt, _, ctx, _ = plan(None, (cfg, shape))
    direct = None
    if desc.direct and q8_act_linear.kernel_available() and dev.type == "cpu" and dtype in ("auto", "float32") \
            and prefill_dtype == "auto":
        direct = estimate_gguf(shape, desc, ctx, batch_size)
    check_gguf_conversion_fits(desc, name_or_path, fmt, direct)


def _source_blocks(name_or_path: str, folder: Path) -> dict:
    """The quantised blocks of the GGUF file a preset or a .gguf path came from (--weights gguf):
    saved by the conversion, or read once from the file for a folder converted before that."""
    from specdraft.errors import SpecdraftError
    from specdraft.loading.gguf_blocks import BLOCKS_FILE, load_blocks, save_blocks
    from specdraft.loading.gguf_file import read_blocks
    from specdraft.loading.presets import gguf_source

    saved = folder / BLOCKS_FILE
    if saved.exists():
        return load_blocks(saved)
    source = gguf_source(name_or_path)
    if source is None:
        raise SpecdraftError(f"--weights gguf keeps a GGUF file's quantised blocks, and {name_or_path} is not a "
                             "preset or a .gguf file; use --weights fp16 or dtype")
    blocks = read_blocks(source)
    save_blocks(blocks, saved)
    return blocks
