"""Weight shards fetched into huggingface_hub's cache so that a download cut off in one run
resumes in the next, from the byte where it stopped.

huggingface_hub (2.x) downloads each file into a temporary file unique to its process and
deletes that file when the download fails: a cut transfer is retried within the run, but a run
that gives up (the network down for longer than its retries, Ctrl-C, a crash) keeps nothing,
and the next run fetches the shard from its first byte again (hours for a 10 GB shard on a slow
line). So each safetensors shard the loader needs is fetched here first, into the cache's own
`blobs/<etag>.incomplete` (the name huggingface_hub gives a blob being fetched), appended to
with an HTTP Range from its current length, under huggingface_hub's lock for that blob, and
renamed to `blobs/<etag>` once whole: its size checked by the download, its content against
the etag (a SHA-256 for LFS files, a git blob hash otherwise). snapshot_download then finds the
blob and only links it into the snapshot. Files stored with Xet, where the hf_xet package is
installed, are left to huggingface_hub, whose Xet client keeps the chunks it fetched.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urlparse

from specdraft.errors import SpecdraftError

PARTIAL = ".incomplete"
HASH_BLOCK = 1 << 24


def fetch_shards(repo: str, rev: str | None, names: list[str], options: dict) -> None:
    """Fetch the safetensors files among `names` into the cache (see the module docstring);
    `options`: hub._options(). Errors are huggingface_hub's and the network's, for the caller
    to put in one line; what was fetched stays for the next run."""
    import huggingface_hub as hf
    from huggingface_hub.file_download import repo_folder_name

    cache = Path(options["cache_dir"] or hf.constants.HF_HUB_CACHE)
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    for name in names:
        if not name.endswith(".safetensors"):
            continue
        url = hf.hf_hub_url(repo, name, revision=rev, endpoint=options["endpoint"])
        meta = hf.get_hf_file_metadata(url, token=options["token"], endpoint=options["endpoint"])
        if meta.etag is None or (meta.xet_file_data is not None and _xet_available()):
            continue
        blob = cache / folder / "blobs" / meta.etag
        lock = cache / ".locks" / folder / f"{meta.etag}.lock"
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with hf.utils.WeakFileLock(str(lock)):
            if not blob.exists():
                _fetch(url, meta, blob, name, options["token"])


def _fetch(url: str, meta, blob: Path, name: str, token: str | None) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    partial = blob.with_name(blob.name + PARTIAL)
    if partial.exists() and meta.size is not None and partial.stat().st_size > meta.size:
        partial.unlink()  # longer than the file: not a prefix of it
    # Authorization goes to the Hub only, not to a storage host it redirects to (as huggingface_hub does)
    same_host = urlparse(meta.location).netloc == urlparse(url).netloc
    headers = build_hf_headers(token=token) if same_host else build_hf_headers(token=False)
    with partial.open("ab") as f:
        http_get(meta.location, f, resume_size=f.tell(), headers=headers, expected_size=meta.size,
                 displayed_filename=name)
    if not _matches(partial, meta.etag):
        partial.unlink()
        raise SpecdraftError(f"{name} arrived with other contents than the Hub lists (etag {meta.etag}); it was "
                             "removed: run the command again to fetch it anew")
    os.replace(partial, blob)


def _matches(path: Path, etag: str) -> bool:
    """Whether the file's content hashes to `etag`: SHA-256 (LFS files, 64 hex digits) or git's
    blob SHA-1 (40); another form of etag cannot be checked and passes."""
    if len(etag) == 64:
        digest = hashlib.sha256()
    elif len(etag) == 40:
        digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    else:
        return True
    with path.open("rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest() == etag


def _xet_available() -> bool:
    try:
        from huggingface_hub.utils import is_xet_available
    except ImportError:
        return False
    return is_xet_available()
