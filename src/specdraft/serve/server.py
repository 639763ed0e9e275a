"""Running the app under uvicorn with a bounded drain.

On SIGTERM (or Ctrl-C) the server stops taking requests (/health and the API answer 503, the
listening socket closes), lets those in flight finish for `shutdown_timeout` seconds, then
fails what is left with a 503 error (JSON, or an error event on a stream) and exits 0. If the
engine fails for good (serve/worker.py), the server exits with status 1 so that a supervisor
restarts it.
"""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

GRACE_S = 5.0  # past the drain, uvicorn cancels whatever still holds a connection
FAILED = 1


class Server(uvicorn.Server):
    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str = "warning"):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=int(shutdown_timeout + GRACE_S))
        super().__init__(config)
        self.state = app.state.specdraft
        self.state.on_fatal = self._engine_failed
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it re-raises the signal once shut down, and the process would end by it.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
            return
        self.state.begin_drain(self.shutdown_timeout)
        self.should_exit = True

    def _engine_failed(self, reason: str) -> None:
        self.should_exit = True  # read by uvicorn's loop every tick

    @property
    def exit_status(self) -> int:
        return FAILED if self.state.fatal is not None else 0


def serve(app: FastAPI, host: str, port: int, shutdown_timeout: float) -> int:
    """Serve until SIGTERM/SIGINT or an engine failure; the process's exit status."""
    server = Server(app, host, port, shutdown_timeout)
    server.run()
    return server.exit_status
