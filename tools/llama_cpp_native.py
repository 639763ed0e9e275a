"""Build a native llama.cpp once into specdraft's cache, and convert Gemma 4 assistants for it.

    python tools/llama_cpp_native.py build SOURCE        # cmake a llama.cpp source tree (e.g. the one
                                                         # vendored in llama-cpp-python's sdist)
    python tools/llama_cpp_native.py convert-assistant FOLDER --source SOURCE

`specdraft bench` then finds llama-server for the llama-cpp, llama-cpp-pld and llama-cpp-mtp peers
(src/specdraft/bench/llama_native.py says where). Builds take ~10-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from specdraft.bench.llama_native import TARGETS, assistant_gguf, cmake_flags, native_root


def build(source: Path, jobs: int) -> Path:
    if not (source / "CMakeLists.txt").is_file():
        sys.exit(f"{source} is not a llama.cpp source tree (no CMakeLists.txt)")
    work = native_root() / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(work), *cmake_flags()], check=True)
    subprocess.run(["cmake", "--build", str(work), "-j", str(jobs), "--target", *TARGETS], check=True)
    out = native_root() / "bin"
    out.mkdir(parents=True, exist_ok=True)
    for path in (work / "bin").iterdir():  # the binaries and the shared libraries they load
        if path.is_file():
            shutil.copy2(path, out / path.name)
    return out


def convert_assistant(folder: Path, source: Path) -> Path:
    out = assistant_gguf(folder)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(source / "gguf-py"))
    partial = out.with_suffix(".partial")
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "q8_0",
                    "--outfile", str(partial)], check=True, env=env)
    partial.rename(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="cmake llama-server, llama-bench and llama-quantize into the cache, built for this CPU (AMX off)")
    b.add_argument("source", type=Path)
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    c = sub.add_parser("convert-assistant", help="a Gemma 4 assistant folder -> the GGUF llama-server drafts with")
    c.add_argument("folder", type=Path)
    c.add_argument("--source", type=Path, required=True, help="the llama.cpp source tree (its converter)")
    args = p.parse_args()
    if args.cmd == "build":
        print(build(args.source, args.jobs))
    else:
        print(convert_assistant(args.folder, args.source))


if __name__ == "__main__":
    main()
