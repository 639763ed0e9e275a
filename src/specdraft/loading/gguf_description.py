"""One GGUF file described once from its header: the config it implies, its tensor table and
what each tensor takes, for the memory check, the drafter-fit check and the loader alike.

Parsing the header of a real-size Gemma 4 file (262k vocabulary strings) takes about a second;
the description is kept per file (path, size and mtime), so a command that checks memory, checks
a drafter against the target and then loads it reads the header once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.loading.gguf_blocks import SUPPORTED_BLOCK_FORMATS
from specdraft.loading.gguf_reader import GGUFFile, GGUFTensor

# Tensor types the direct loader reads: block formats (their codes go straight into the int8
# kernel's linears) and plain floats (small tensors, and matrices compacted as checkpoints are).
FLOAT_TYPES = ("F32", "F16", "BF16")
DIRECT_TYPES = SUPPORTED_BLOCK_FORMATS + FLOAT_TYPES
DIRECT_ARCHS = ("gemma4",)


@dataclass
class GGUFDescription:
    path: Path
    reader: GGUFFile
    arch: str
    config: dict[str, Any]  # the Hugging Face config.json the file implies (gguf_file.gguf_config)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)

    def stored_bytes(self, name: str) -> int:
        return int(self.tensors[name].data.nbytes)

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def unsupported_tensor(self) -> tuple[str, str] | None:
        """(name, type) of the first text-decoder tensor whose type the direct loader cannot read."""
        from specdraft.loading.gguf_file import hf_name

        for name, t in self.tensors.items():
            if t.tensor_type.name not in DIRECT_TYPES and hf_name(name, self.arch) is not None:
                return name, t.tensor_type.name
        return None

    @property
    def direct(self) -> bool:
        """Whether the file's own blocks load straight into the model (no converted folder): a
        Gemma 4 target with a tied head (every published Gemma 4 is tied)."""
        return self.arch in DIRECT_ARCHS and "output.weight" not in self.tensors


def describe_gguf(path: str | Path) -> GGUFDescription:
    """The description of the GGUF file at `path` (one-line SpecdraftErrors for a missing, corrupt
    or unsupported file)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SpecdraftError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _describe(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _describe(path: str, size: int, mtime_ns: int) -> GGUFDescription:
    from specdraft.loading.gguf_file import gguf_config, open_gguf

    reader = open_gguf(Path(path))
    config = gguf_config(Path(path), reader)
    return GGUFDescription(Path(path), reader, str(reader.value("general.architecture")), config,
                           {t.name: t for t in reader.tensors})


def assistant_config_dict(path: Path) -> dict[str, Any]:
    """A gemma4-assistant GGUF's drafter config (the Gemma 4 assistant config.json), header only."""
    from specdraft.loading.gguf_gemma4 import GEMMA4_ASSISTANT

    desc = describe_gguf(path)
    if desc.arch != GEMMA4_ASSISTANT:
        raise SpecdraftError(f"{path}: GGUF architecture {desc.arch!r} is not a drafter (expected {GEMMA4_ASSISTANT!r})")
    return desc.config


def assistant_state(path: Path) -> dict[str, Any]:
    """A gemma4-assistant GGUF's weights in float32 under their Hugging Face names, in memory (the
    drafter is small: E2B's is 78M parameters); no converted folder is written."""
    from specdraft.loading.gguf_file import float_state

    assistant_config_dict(path)  # refuses a file that is not a drafter
    return float_state(Path(path), describe_gguf(path).reader, progress=False)
