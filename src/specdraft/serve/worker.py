"""The engine's own thread: it takes requests and aborts from the web server's event loop,
steps the engine while there is work, and hands tokens and results back to each request's
asyncio queue. The engine itself is never touched from another thread.

Every engine call is guarded, so no error ends the thread:
- `add` fails (before the request joins the batch): that request fails;
- `step` or `abort` fails: the batch's rows share the cache and buffers, whose state is now
  unknown, so the requests in the batch fail, the engine is reset (cache freed) and the queued
  requests, which never touched the cache, are added again;
- delivering a result fails: that request fails.
A failed request gets ("error", 500, ...). If the reset itself fails, or MAX_FAILURES engine
calls fail with no step succeeding in between, the worker gives up: every request fails,
`fatal` says why, and `on_fatal` is called (the server answers 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from specdraft.device import release_free_memory
from specdraft.errors import SpecdraftError
from specdraft.serve.metrics import Metrics
from specdraft.speculative.engine import Engine
from specdraft.speculative.request import GenerationResult, Request

log = logging.getLogger("specdraft.serve")
IDLE_WAIT_S = 0.05
MAX_FAILURES = 3  # consecutive failed engine calls before the worker gives up


class QueueFull(Exception):
    """The batch and the waiting queue are full."""


class Unavailable(Exception):
    """The worker takes no more requests: the server is shutting down, or the engine failed."""


@dataclass
class Sink:
    """Where a request's events go: ("tokens", ids, sources), ("done", result),
    ("error", status, message, code). `stream`: whether it wants token events."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    stream: bool = True

    def put(self, *event: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[str], None] | None = None):
        self.engine, self.metrics, self.on_fatal = engine, metrics, on_fatal
        self.limit = engine.max_batch_size + max_queue
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.requests: dict[int, tuple[Request, Sink]] = {}  # submitted, not answered (engine thread only)
        self.lock = threading.Lock()
        self.outstanding = 0  # submitted and not answered (guarded by lock)
        self.draining = False  # no new requests (guarded by lock)
        self.fatal: str | None = None  # why the worker gave up (guarded by lock)
        self.deadline: float | None = None  # drain: when what is left gets aborted
        self.drain_seconds = 0.0
        self.failures = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.commands.put(("stop",))
        self.thread.join(timeout=10)

    def submit(self, req: Request, sink: Sink) -> None:
        if sink.stream:
            req.on_tokens = lambda ids, sources: sink.put("tokens", ids, sources)
        with self.lock:  # the command goes in under the lock: a give-up then sees every add
            if self.fatal is not None:
                raise Unavailable(f"the engine failed and the server is restarting ({self.fatal}); retry shortly")
            if self.draining:
                raise Unavailable("the server is shutting down; retry shortly")
            if self.outstanding >= self.limit:
                raise QueueFull(f"server busy: {self.outstanding} requests in flight (batch + queue limit "
                                f"{self.limit}); retry later")
            self.outstanding += 1
            self.commands.put(("add", req, sink))

    def abort(self, request_id: int) -> None:
        self.commands.put(("abort", request_id))

    def drain(self, timeout: float) -> None:
        """Take no new requests; those in flight get `timeout` seconds, then fail with 503."""
        with self.lock:
            self.draining = True
        self.commands.put(("drain", time.monotonic() + timeout, timeout))

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._take_commands(block=not self.engine.has_work())
                self._check_deadline()
                if self.engine.has_work() and not self.stopping.is_set():
                    self._step()
                self._observe()
            self._fail_everything(503, "the server stopped before the request finished", "shutting_down")
        except BaseException as e:  # a bug in this loop itself: nothing here can be trusted any more
            log.exception("the engine thread failed")
            self._give_up(f"{type(e).__name__}: {e}")

    def _take_commands(self, block: bool) -> None:
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
            self._add(cmd[1], cmd[2])
        elif cmd[0] == "abort":
            self._abort(cmd[1])
        elif cmd[0] == "drain":
            self.deadline, self.drain_seconds = cmd[1], cmd[2]

    def _add(self, req: Request, sink: Sink) -> None:
        self.requests[req.id] = (req, sink)
        try:
            self.engine.add(req)
        except SpecdraftError as e:  # the request itself cannot run here
            self._fail(req.id, 400, str(e))
        except Exception as e:
            log.exception("adding a request to the engine failed")
            self._fail(req.id, 500, _internal("admitting the request", e))
            self.failures += 1
            if not self.engine.has_work():  # a failed first allocation may leave a half-built cache
                self._reset(_internal("admitting a request", e))

    def _abort(self, request_id: int) -> None:
        if request_id not in self.requests:
            return  # answered already
        try:
            result = self.engine.abort(request_id)
        except Exception as e:
            log.exception("aborting a request failed; resetting the engine")
            self._fail(request_id, 500, _internal("aborting the request", e))
            self.failures += 1
            self._reset(_internal("generating", e))
            return
        if result is not None:
            self._finish(result)
        else:  # not in the engine (its add failed): nothing left to free
            self._fail(request_id, 500, "internal error: the request was lost")

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the batch and resetting the engine")
            self.failures += 1
            self._reset(_internal("generating", e))
            return
        self.failures = 0
        for result in finished:
            self._finish(result)
        if not self.engine.has_work():
            try:
                release_free_memory()  # idle: give the heap's free pages back (see its docstring)
            except Exception:
                log.exception("releasing free memory failed")

    def _reset(self, message: str) -> None:
        """Fail the batch, free the cache, add the queued requests again (or give up)."""
        try:
            queued = self.engine.reset()
        except Exception as e:
            log.exception("resetting the engine failed")
            self._give_up(f"the engine could not be reset after an error ({type(e).__name__}: {e})")
            return
        if self.failures >= MAX_FAILURES:
            self._give_up(f"{self.failures} engine errors in a row, the last: {message}")
            return
        again = [r for r in queued if r.id in self.requests]
        kept = {r.id for r in again}
        for request_id in [i for i in self.requests if i not in kept]:
            self._fail(request_id, 500, message)
        for req in again:
            self._add(req, self.requests[req.id][1])

    def _finish(self, result: GenerationResult) -> None:
        entry = self.requests.pop(result.request_id, None)
        if entry is None:
            return
        self._release()
        try:
            self.metrics.observe_result(result)
            entry[1].put("done", result)
        except Exception as e:
            log.exception("delivering a result failed")
            _send(entry[1], "error", 500, _internal("finishing the request", e), "internal_error")

    def _fail(self, request_id: int, status: int, message: str, code: str | None = None) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        self._release()
        code = code or ("internal_error" if status >= 500 else None)
        _send(entry[1], "error", status, message, code)

    def _release(self) -> None:
        with self.lock:
            self.outstanding -= 1

    def _check_deadline(self) -> None:
        if self.deadline is None or time.monotonic() < self.deadline or not self.requests:
            return
        log.warning("drain time is up: aborting %d requests", len(self.requests))
        self._fail_everything(503, f"the server is shutting down: the request did not finish within the "
                                   f"{self.drain_seconds:g} s drain", "shutting_down")

    def _fail_everything(self, status: int, message: str, code: str) -> None:
        try:
            self.engine.reset()
        except Exception:
            log.exception("resetting the engine failed")
        for request_id in list(self.requests):
            self._fail(request_id, status, message, code)

    def _give_up(self, reason: str) -> None:
        with self.lock:
            self.fatal = reason
        log.error("specdraft: the engine cannot go on: %s", reason)
        self.stopping.set()
        self._fail_everything(500, f"internal error: the engine failed ({reason})", "internal_error")
        while True:  # adds that came in before `fatal` was set
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._release()
                _send(cmd[2], "error", 503, f"the engine failed ({reason}); retry shortly", "engine_failed")
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:
                log.exception("on_fatal failed")

    def _observe(self) -> None:
        try:
            self.metrics.observe_engine(len(self.engine.waiting), self.engine.num_running, self.engine.timer.totals)
        except Exception:
            log.exception("updating the engine metrics failed")


def _internal(doing: str, e: BaseException) -> str:
    return f"internal error while {doing} ({type(e).__name__}); the request was not completed"


def _send(sink: Sink, *event: Any) -> None:
    try:
        sink.put(*event)
    except Exception:  # the event loop is gone: nobody is left to answer
        log.warning("could not deliver %s to a request", event[0])
