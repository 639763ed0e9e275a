"""`specdraft models`: the presets, and whether each is converted and cached here."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("models", help="list model presets and their cache state",
                       description="List the model presets. A preset is converted from its GGUF package "
                                   "on first use and cached under $SPECDRAFT_CACHE (default ~/.cache/specdraft).")
    p.set_defaults(run=run)


def run(args) -> int:
    from specdraft.drafters import shipped_drafter_path
    from specdraft.loading.presets import DEFAULT_MODEL, PRESETS, cache_root, is_converted, preset_dir

    print(f"cache: {cache_root()}")
    for name, preset in PRESETS.items():
        folder = preset_dir(name)
        state = f"cached at {folder}" if is_converted(folder) else f"not converted yet (needs: {preset.install})"
        drafter = "shipped MTP drafter" if shipped_drafter_path(name) else "no shipped drafter"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {preset.description}\n    {state}; {drafter}")
    return 0
