"""Limits a request meets before and while its handler runs, as plain ASGI (no buffering):

- Guard, around the whole app: the Host header allow-list (a web page cannot reach a local
  server through DNS rebinding), the body cap by Content-Length, counting requests by endpoint
  and status, and a JSON 500 for anything unhandled;
- read_body: the body cap for bodies without a Content-Length (chunked) and a deadline for the
  whole body, so a slow or truncated body cannot hold a connection;
- disconnected: returns when the client hangs up, so a request nobody waits for is aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable

from specdraft.serve.metrics import Metrics
from specdraft.serve.shapes import ApiError, error

log = logging.getLogger("specdraft.serve")
MAX_BODY_BYTES = 4 * 1024 * 1024  # far above any prompt that fits a context
BODY_TIMEOUT_S = 30.0  # the whole body must arrive within this
DISCARD_BYTES = 64 * 1024 * 1024  # read past the cap (and dropped) so the client sees the 413
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/openapi.json", "/"}

Receive = Callable[[], Awaitable[dict]]


class ClientGone(Exception):
    """The client hung up before its request was read."""


def host_name(value: str) -> str:
    """The host of a Host header, without port or trailing dot, lower case ("[::1]:80" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1 : value.find("]")] if "]" in value else value[1:]
    elif value.count(":") == 1:
        value = value.split(":")[0]
    return value.rstrip(".")


class Guard:
    def __init__(self, app, metrics: Metrics, allowed_hosts: Iterable[str] | None = None,
                 max_body: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT_S):
        self.app, self.metrics, self.max_body, self.body_timeout = app, metrics, max_body, body_timeout
        hosts = LOCAL_HOSTS if allowed_hosts is None else tuple(allowed_hosts)
        self.any_host = "*" in hosts
        self.hosts = {host_name(h) for h in hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def noting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                if refusal[0] == 413:
                    await self._discard(receive, scope)
                await send_json(noting_send, *refusal)
            else:
                await self.app(scope, receive, noting_send)
        except Exception:  # an error no handler caught: JSON, not a traceback
            log.exception("unhandled error")
            if status is None:
                await send_json(noting_send, 500, error("internal server error", "server_error", "internal_error"))
        finally:
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(path, str(status or 500)).inc()

    async def _discard(self, receive: Receive, scope) -> None:
        """Read and drop an oversized body announced by Content-Length (up to DISCARD_BYTES past
        the cap): a client answered while still sending would see a reset instead of the 413."""
        size = int(dict(scope.get("headers", [])).get(b"content-length", b"0"))
        if size > self.max_body + DISCARD_BYTES:
            return
        deadline = asyncio.get_running_loop().time() + self.body_timeout
        message = {"more_body": True}
        while message.get("more_body", False):
            try:
                message = await _receive_by(receive, deadline, self.body_timeout)
            except (ApiError, ClientGone):
                return

    def _refusal(self, scope) -> tuple[int, dict] | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        host = headers.get(b"host")
        if host is not None and not self.any_host:
            name = host_name(host.decode("latin-1"))
            if name not in self.hosts:
                return 400, error(f"host {name!r} is not allowed (start the server with --allowed-hosts "
                                  f"{name} to serve it)", code="host_not_allowed")
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.max_body:
            return 413, error(f"request body over {self.max_body} bytes", code="body_too_large")
        return None


async def send_json(send, status: int, body: dict) -> None:
    """The body is not read first: the connection closes after this answer."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


async def read_body(receive: Receive, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT_S) -> bytes:
    """The request body, at most `max_bytes`, all of it within `timeout` seconds: else ApiError
    413 or 408. ClientGone if the client hangs up first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    chunks, size = [], 0
    while True:
        message = await _receive_by(receive, deadline, timeout)
        size += len(message.get("body", b""))
        if size > max_bytes:
            await _discard(receive, message, deadline, timeout)
            raise ApiError(413, f"request body over {max_bytes} bytes", code="body_too_large")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _receive_by(receive: Receive, deadline: float, timeout: float) -> dict:
    try:
        message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s", code="request_timeout") from None
    if message["type"] == "http.disconnect":
        raise ClientGone()
    return message


async def _discard(receive: Receive, message: dict, deadline: float, timeout: float) -> None:
    """Read what is left of an oversized body, up to DISCARD_BYTES: a client still sending when
    the server answers would see a reset instead of the 413."""
    dropped = 0
    while message.get("more_body", False) and dropped < DISCARD_BYTES:
        try:
            message = await _receive_by(receive, deadline, timeout)
        except (ApiError, ClientGone):
            return
        dropped += len(message.get("body", b""))


async def disconnected(receive: Receive) -> None:
    """Returns when the client hangs up (call once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
