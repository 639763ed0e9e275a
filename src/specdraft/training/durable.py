"""Files a training run can be killed in the middle of writing: atomic writes, manifests that a
resumed run verifies, and folders replaced in one rename.

A kill (SIGKILL, power loss, out of memory) may land anywhere. What survives must be either the
old state or the new one, never half of each, and nothing half-written may be trusted:

    write_atomic / write_text_atomic   write a temporary file, flush + fsync it, rename it into place
    write_manifest / manifest_problem  sizes and SHA-256 of a folder's files, written last; a
                                       resumed run checks each listed file against it
    replace_dir / recover_dir          a folder (checkpoint, best) swapped in by renames, and after a
                                       kill the newest complete one found again
    kill_point                         a test-only hook: SPECDRAFT_KILL_AT=NAME[:N] makes the process
                                       SIGKILL itself the Nth time it passes point NAME
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
KILL_ENV = "SPECDRAFT_KILL_AT"
_passed: Counter[str] = Counter()


def kill_point(name: str) -> None:
    """SIGKILL this process here if SPECDRAFT_KILL_AT names this point (NAME, or NAME:N for the
    Nth time it is reached). Tests place kills this way; unset, it costs one dict lookup."""
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _passed[name] += 1
    if _passed[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in `path` durable (a rename lives in its folder's entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) then flush + fsync + rename onto `path`: readers see the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fsync_file(tmp)
    kill_point("before-rename")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def digest(path: Path) -> dict:
    """{"bytes", "sha256"} of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The folder's manifest ({file name: digest}), or None if it has none or it does not parse."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def write_manifest(folder: Path, entries: dict[str, dict]) -> None:
    """The manifest, written atomically after the files it lists are durable."""
    write_text_atomic(folder / MANIFEST, json.dumps({"files": entries}, indent=1, sort_keys=True) + "\n")


def manifest_problem(folder: Path, names: list[str] | None = None) -> str | None:
    """Why the folder cannot be trusted (no manifest, a listed file missing, cut short or changed),
    or None when every file the manifest lists (and every one of `names`) matches it."""
    files = read_manifest(folder)
    if files is None:
        return "no readable manifest"
    for name in names or []:
        if name not in files:
            return f"{name} is not in the manifest"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {want.get('bytes')}"
        if digest(path)["sha256"] != want.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest"
    return None


def seal_dir(folder: Path) -> None:
    """fsync every file of a freshly written folder, then write its manifest (last: a folder with
    a valid manifest is complete)."""
    entries = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST):
        fsync_file(path)
        entries[path.name] = digest(path)
    write_manifest(folder, entries)


def _previous(folder: Path) -> Path:
    return folder.with_name(folder.name + ".prev")


def replace_dir(tmp: Path, folder: Path) -> None:
    """Put the sealed folder `tmp` in place of `folder`. The old one is renamed aside first and
    removed only once the new one is in place, so a kill between any two steps leaves a complete
    folder under one of the two names (recover_dir finds it)."""
    previous = _previous(folder)
    if folder.exists():
        if previous.exists():
            shutil.rmtree(previous)
        os.replace(folder, previous)
        kill_point("between-renames")
    os.replace(tmp, folder)
    fsync_dir(folder.parent)
    if previous.exists():
        shutil.rmtree(previous)


def recover_dir(folder: Path, log: Callable[[str], None] = print) -> bool:
    """After a possible kill: drop a half-written `folder`.tmp, and leave under `folder` the newest
    complete copy (itself, or the one replace_dir had renamed aside). A folder whose manifest does
    not check out is removed, not trusted. Returns whether a complete folder is there."""
    tmp, previous = folder.with_name(folder.name + ".tmp"), _previous(folder)
    if tmp.exists():
        shutil.rmtree(tmp)
    if folder.exists() and not (folder / MANIFEST).exists() and _whole_legacy(folder):
        # Written before manifests: its files checked as far as they can be, then sealed (quietly:
        # nothing for the user to do, and a refusal that follows must stay one line).
        seal_dir(folder)
    if folder.exists():
        problem = manifest_problem(folder)
        if problem is None:
            if previous.exists():
                shutil.rmtree(previous)
            return True
        log(f"{folder} is incomplete or corrupt ({problem}): not used")
        shutil.rmtree(folder)
    if previous.exists():
        problem = manifest_problem(previous)
        if problem is None:
            os.replace(previous, folder)
            fsync_dir(folder.parent)
            log(f"{folder}: the previous complete copy restored")
            return True
        log(f"{previous} is incomplete or corrupt ({problem}): not used")
        shutil.rmtree(previous)
    return False


def _whole_legacy(folder: Path) -> bool:
    """A folder from before manifests: its JSON files parse and its safetensors files' tensors
    fit inside them (a file cut short fails)."""
    from safetensors import safe_open

    try:
        for path in folder.iterdir():
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        f.get_slice(key)
        return True
    except Exception:  # anything unreadable is not to be trusted  # noqa: BLE001
        return False
