"""The package's import graph: no cycles, arrows only point down the layers below, and every
module imports on its own.

The graph counts every `import` naming a specdraft module, at module level and inside
functions alike (a lazy import that closes a circle is still a circle, just a later-failing
one). A package's `__init__` running before its submodules is not counted as an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import specdraft

ROOT = Path(specdraft.__file__).parent
SKIP_IMPORT = {"specdraft.__main__"}  # running it is the CLI itself
# Top to bottom; a module may import its own layer and those below. Modules directly under
# specdraft/ (config, tokenizer, sampling, kv_cache, errors...) are the ground floor, 0. Inside
# models/, kernels know nothing of weight formats, and formats nothing of architectures.
LAYER = {"cli": 6, "serve": 6, "bench": 5, "training": 5, "runtime": 4, "engine_builder": 4, "speculative": 3,
         "drafters": 2, "loading": 1.5, "models": 1.4, "models.architectures": 1.3, "models.formats": 1.2,
         "models.kernels": 1.1}


def layer(module: str) -> float:
    """The layer of the longest LAYER key that `module` lies in (specdraft.models.formats.quant:
    models.formats)."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER:
            return LAYER[".".join(parts[:n])]
    return 0


def module_names() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("specdraft",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The specdraft modules a file imports (`from pkg import sub` names the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs if len(subs) == len(node.names) else subs | {node.module}
    return found & known


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    modules = module_names()
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_imports_point_down() -> None:
    modules = module_names()
    up = [f"{name} -> {dep}" for name, path in modules.items() if name not in SKIP_IMPORT
          for dep in sorted(imports_of(path, set(modules))) if layer(dep) > layer(name)]
    assert up == []


def test_layers_inside_a_package_count() -> None:
    assert layer("specdraft.models.kernels.build") < layer("specdraft.models.formats.quant")
    assert layer("specdraft.models.formats.quant") < layer("specdraft.models.architectures.gemma4")
    assert layer("specdraft.models.architectures.gemma4") < layer("specdraft.models.compile")
    assert layer("specdraft.kv_cache") == 0 and layer("specdraft.cli.main") == 6


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_imports_on_its_own() -> None:
    """One fresh interpreter; before each module, every specdraft module is forgotten, so each
    import starts from nothing (torch stays loaded: it is not ours, and it keeps this fast)."""
    names = sorted(set(module_names()) - SKIP_IMPORT)
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'specdraft' or m.startswith('specdraft.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
