"""A stand-in for the Hugging Face Hub's HTTP API, serving folders on this machine, so the tests
exercise huggingface_hub's real download path (HF_ENDPOINT points here) without the network.

The endpoints huggingface_hub 1.x-2.x calls for snapshot_download / hf_hub_download / model_info:

    GET  /api/models/{repo}/revision/{rev}        repo_info / model_info: id, sha, siblings
    GET  /api/models/{repo}/tree/{rev}[/path]     list_repo_tree: files with size, oid, lfs
    HEAD /{repo}/resolve/{rev}/{file}             metadata: X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{file}             the bytes; `Range: bytes=N-` answers 206

Errors carry X-Error-Code as the Hub's do (RepoNotFound, RevisionNotFound, EntryNotFound,
GatedRepo), which is how huggingface_hub tells them apart. Faults for tests: a gated repository
(files need `Authorization: Bearer <token>`), and `cut`: the first GET of a file stops half-way
(with `stay_down`, the Hub then answers 503 until `down` is cleared).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class StandinHub:
    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = (), token: str = "hf_test_token"):
        self.repos = {r: Path(f) for r, f in repos.items()}
        self.gated, self.token = set(gated), token
        self.cut: set[str] = set()  # file names whose first GET stops half-way
        self.down = False
        self.stay_down = False
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "StandinHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def downloaded(self, suffix: str) -> list[tuple[str, str | None]]:
        """(path, Range) of the GETs of files ending in `suffix`."""
        return [(p, r) for m, p, r in self.log if m == "GET" and "/resolve/" in p and p.endswith(suffix)]


def _handler(hub: StandinHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            if hub.down:
                return self._error(503, None, "Hub down")
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
                if not self._known(repo, rev):
                    return
                if kind == "revision":
                    files = hub.files(repo)
                    return self._json({"id": repo, "modelId": repo, "sha": hub.sha(repo), "private": False,
                                       "gated": "manual" if repo in hub.gated else False,
                                       "siblings": [{"rfilename": f} for f in files]}, body)
                if kind == "tree":
                    return self._json([_entry(f, p) for f, p in hub.files(repo).items()], body)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                if not self._known(repo, rev):
                    return
                if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401 if "Authorization" not in self.headers else 403, "GatedRepo",
                                       "Access to this model is restricted")
                file = hub.files(repo).get(name)
                if file is None:
                    return self._error(404, "EntryNotFound", "Entry not found")
                return self._file(repo, name, file.read_bytes(), body)
            self._error(404, None, "Not found")

        def _known(self, repo: str, rev: str) -> bool:
            if repo not in hub.repos:
                self._error(404, "RepoNotFound", "Repository not found")
                return False
            if rev not in ("main", hub.sha(repo)):
                self._error(404, "RevisionNotFound", "Invalid rev id")
                return False
            return True

        def _file(self, repo: str, name: str, data: bytes, body: bool) -> None:
            start, status = 0, 200
            rng = self.headers.get("Range")
            if body and rng and rng.startswith("bytes="):
                start, status = int(rng[6:].split("-")[0]), 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in hub.cut:
                hub.cut.discard(name)
                hub.down = hub.stay_down
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def _json(self, obj, body: bool) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _error(self, status: int, code: str | None, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _entry(name: str, path: Path) -> dict:
    data = path.read_bytes()
    entry = {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
    if name.endswith(".safetensors"):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry
