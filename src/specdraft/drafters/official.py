"""Google's official Gemma 4 assistants (`google/gemma-4-<size>-it-assistant`) for `--drafter auto`.

The target is named by its Hub id, or by a folder whose config.json names it (`_name_or_path`)
or that sits in the Hugging Face cache (`models--google--gemma-4-E2B-it/snapshots/...`). The
assistant comes from the local Hugging Face cache, or unless HF_HUB_OFFLINE is set is fetched
after saying so; it must fit the target by the two configs (mtp/checkpoint.check_drafter_fits).
Wherever it cannot be had, `auto` runs prompt lookup and says why.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from specdraft.errors import SpecdraftError

GEMMA4_IT = re.compile(r"google/gemma-4-(?P<size>[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*?)-it")
GEMMA4_TYPES = ("gemma4", "gemma4_text")
ASSISTANT_SIZE = "about 0.2-0.9 GB"


def assistant_id(name: str, config: dict, folder: Path | None = None) -> str | None:
    """The official assistant's Hub id for a Gemma 4 instruction-tuned target, else None."""
    types = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
    if not types & set(GEMMA4_TYPES):
        return None
    candidates = [name.split("@")[0], str(config.get("_name_or_path", ""))]
    if folder is not None:
        candidates += [p.removeprefix("models--").replace("--", "/", 1) for p in Path(folder).parts
                       if p.startswith("models--")]
    for c in candidates:
        m = GEMMA4_IT.fullmatch(c.strip())
        if m is not None:
            return f"google/gemma-4-{m.group('size')}-it-assistant"
    return None


def find_assistant(name: str, folder: Path, progress: bool = True) -> Path | None:
    """The official assistant's folder for this target (cached, or fetched), or None after a
    note saying why prompt lookup runs instead."""
    from specdraft.drafters.mtp.checkpoint import check_drafter_fits
    from specdraft.loading import hub
    from specdraft.loading.presets import read_config

    aid = assistant_id(name, read_config(folder), folder)
    if aid is None:
        return None
    found = hub.cached_folder(aid, text_only=False)
    if found is None and hub.offline():
        _note(f"{aid} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; using prompt lookup")
        return None
    if found is None:
        if progress:
            _note(f"fetching Gemma 4's MTP assistant {aid} ({ASSISTANT_SIZE}) for --drafter auto")
        try:
            found = hub.resolve(aid, progress, text_only=False)
        except SpecdraftError as e:
            _note(f"{e}; using prompt lookup")
            return None
    try:
        check_drafter_fits(found, str(folder))
    except SpecdraftError as e:
        _note(f"{aid} does not fit this target ({e}); using prompt lookup")
        return None
    return found


def _note(text: str) -> None:
    print(f"specdraft: note: --drafter auto: {text}", file=sys.stderr, flush=True)
