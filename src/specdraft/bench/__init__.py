"""`specdraft bench`: Spec-Bench style measurements, specdraft next to its peers.

questions.py  input files and prompt formatting
methods.py    the one interface every method runs behind, and specdraft's own (plain/mtp/mtp+ngram/ngram/draft-model)
peers.py      the same weights through transformers (hf, hf-pld) and llama.cpp (llama-cpp, llama-cpp-pld)
llama_server.py, llama_native.py  llama.cpp's own server (and its MTP drafting, llama-cpp-mtp), built once
memory.py     resident memory: load deltas and peaks while generating
metrics.py    pure arithmetic on the raw records
report.py     results.json, results.md and the printed table
plots.py      PNG figures (matplotlib, Agg)
runner.py     orchestration: load, build each method, warm up, interleave, measure, write
"""

from specdraft.bench.llama_native import ggml_cpu_flags
from specdraft.drafters.kinds import DRAFTER_KINDS, MTP_KINDS

# plain decoding a second time, as its own method: identical work, so its speedup over plain in a cell is
# what timing noise alone reads there (the yardstick for a cell where a method looks slower than plain).
CONTROL = "plain-again"
SPECDRAFT_METHODS = ("plain", *(kind for kind in DRAFTER_KINDS if kind != "none"), CONTROL)
PEER_METHODS = ("hf", "hf-pld", "llama-cpp", "llama-cpp-pld", "llama-cpp-mtp")
ALL_METHODS = SPECDRAFT_METHODS + PEER_METHODS
DEFAULT_METHODS = ("plain", "mtp", "mtp+ngram", "ngram", "draft-model", "hf", "hf-pld", "llama-cpp", "llama-cpp-pld")
# Methods that read an MTP drafter take another one as METHOD@FOLDER (e.g. mtp@runs/more), so two
# drafters can be compared in one interleaved run; specdraft's methods take another weight format
# as METHOD:WEIGHTS (e.g. plain,plain:gguf-q8), loaded beside the run's.
DRAFTER_METHODS = ("auto", *MTP_KINDS)


# A drafter method run with simulated acceptance (drafters/simulated.py) is named METHOD~PROFILE,
# e.g. auto~vllm-26b: the name marks its rows as simulated in every table.
SIMULATED = "~"


def method_profile(name: str) -> str | None:
    """'auto~vllm-26b' -> 'vllm-26b': the simulated-acceptance profile; None: real acceptance."""
    _, sep, profile = name.partition(SIMULATED)
    return profile if sep else None


def split_method(name: str) -> tuple[str, str | None]:
    """'mtp@runs/x' -> ('mtp', 'runs/x'); 'auto:gguf-q8' -> ('auto', None); 'plain' -> ('plain', None)."""
    head, sep, folder = name.partition(SIMULATED)[0].partition("@")
    return head.partition(":")[0], (folder if sep else None)


def method_weights(name: str) -> str | None:
    """'auto:gguf-q8@runs/x' -> 'gguf-q8': the weight format the method asks for; None: the run's."""
    _, sep, weights = name.partition(SIMULATED)[0].partition("@")[0].partition(":")
    return weights if sep else None


# The default llama.cpp build crashes on CPUs with AMX; this one does not, and takes every other
# vector extension this CPU has (bench/llama_native.ggml_cpu_flags).
LLAMA_CPP_BUILD = f'CMAKE_ARGS="{" ".join(ggml_cpu_flags())}" pip install llama-cpp-python'
