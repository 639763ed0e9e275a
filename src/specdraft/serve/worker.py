"""The engine's own thread: it takes requests and aborts from the web server's event loop,
steps the engine while there is work, and hands tokens and results back to each request's
asyncio queue. The engine itself is never touched from another thread."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from specdraft.device import release_free_memory
from specdraft.errors import SpecdraftError
from specdraft.serve.metrics import Metrics
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import Request

log = logging.getLogger("specdraft.serve")
IDLE_WAIT_S = 0.05


class QueueFull(Exception):
    """The batch and the waiting queue are full."""


@dataclass
class Sink:
    """Where a request's events go: ("tokens", ids, sources), ("done", result), ("error", status, message)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue

    def put(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.limit = engine.max_batch_size + max_queue
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[int, Sink] = {}
        self.lock = threading.Lock()
        self.outstanding = 0  # submitted and not finished (guarded by lock)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(("stop",))
        self.thread.join(timeout=10)

    def submit(self, req: Request, sink: Sink) -> None:
        with self.lock:
            if self.outstanding >= self.limit:
                raise QueueFull(f"server busy: {self.outstanding} requests in flight (batch + queue limit "
                                f"{self.limit}); retry later")
            self.outstanding += 1
        req.on_tokens = lambda ids, sources: sink.put("tokens", ids, sources)
        self.commands.put(("add", req, sink))

    def abort(self, request_id: int) -> None:
        self.commands.put(("abort", request_id))

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                finished = self.engine.step()
            except Exception:  # a bug, not a user mistake: fail what is in flight, keep serving
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all("internal error while generating")
                continue
            for result in finished:
                self._finish(result)
            self.metrics.observe_engine(len(self.engine.waiting), self.engine.num_running, self.engine.timer.totals)
            if not self.engine.has_work():
                release_free_memory()  # idle: give the heap's free pages back (see its docstring)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, req, sink = cmd
            try:
                self.engine.add(req)
            except SpecdraftError as e:
                self._release()
                sink.put("error", 400, str(e))
                return
            self.sinks[req.id] = sink
        elif cmd[0] == "abort":
            result = self.engine.abort(cmd[1])
            if result is not None:
                self._finish(result)

    def _finish(self, result) -> None:
        self.metrics.observe_result(result)
        sink = self.sinks.pop(result.request_id, None)
        self._release()
        if sink is not None:
            sink.put("done", result)

    def _release(self) -> None:
        with self.lock:
            self.outstanding -= 1

    def _fail_all(self, message: str) -> None:
        for request_id in list(self.sinks):
            self.engine.abort(request_id)
            self._release()
            self.sinks.pop(request_id).put("error", 500, message)
