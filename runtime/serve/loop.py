"""``EngineLoop``: one thread owns the engine and steps it; asyncio handlers submit requests and read their events.

The engine is not thread-safe, so every call on it (add, abort, step) happens on the loop's thread, fed by a command
queue. A batch's events go to one ``asyncio.Queue`` of the event loop that submitted it; a handler that stops
listening (its client went away, a stop string matched) aborts its request, which frees its cache blocks at once.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future

from runtime.engine import Engine, SamplingParams
from runtime.engine.sequence import TokenEvent

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.error: str | None = None  # why the loop's thread stopped, when it died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="hybrid-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def submit(self, prompts: list, params: list[SamplingParams]) -> tuple[list[int], asyncio.Queue]:
        """Queue a batch (checked whole: the engine's ValueError / TypeError, nothing queued): the request ids and the
        one queue their ``TokenEvent``s arrive on; each request's last event has ``finished`` True."""
        if not self.alive:
            raise RuntimeError(f"the engine loop has stopped ({self.error})")
        done: Future = Future()
        self._commands.put(("add", prompts, params, asyncio.get_running_loop(), done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: int) -> None:
        """End a request and stop delivering its events (nothing more arrives on its queue)."""
        self._commands.put(("abort", request_id))

    def end_requests(self) -> None:
        """End every request now (finish reason "abort"; the server is shutting down): each stream gets its last
        event and closes cleanly instead of being cut."""
        self._commands.put(("end",))

    def close(self, timeout: float = 30.0) -> None:
        """Abort what is left and stop the thread."""
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # -- the loop's thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished()
                try:  # block while there is nothing to step; between steps take what came in
                    command = self._commands.get(block=idle)
                except queue.Empty:
                    command = None
                while command is not None:
                    if command[0] == "stop":
                        self._end_all("abort", None)
                        return
                    self._do(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self.engine.has_unfinished():
                    self._step()
        except BaseException as e:  # noqa: BLE001  (reported to every listener and by /health)
            self.error = f"{type(e).__name__}: {e}"
            log.exception("hybrid serve: the engine loop stopped")
            self._end_all("error", self.error)

    def _do(self, command) -> None:
        if command[0] == "add":
            _, prompts, params, loop, done = command
            try:
                ids = self.engine.add_requests(prompts, params)
            except Exception as e:  # noqa: BLE001  (the submitter's 400)
                done.set_exception(e)
                return
            box: asyncio.Queue = asyncio.Queue()
            for rid in ids:
                self._listeners[rid] = (loop, box)
            done.set_result((ids, box))
        elif command[0] == "end":
            self._end_all("abort", None)
        elif command[0] == "abort":
            rid = command[1]
            if self._listeners.pop(rid, None) is not None:
                self.engine.abort(rid)

    def _step(self) -> None:
        try:
            events = self.engine.step()  # a failing step fails its requests inside (their error events)
        except Exception as e:  # noqa: BLE001  (scheduling itself failed: every request ends, the loop goes on)
            log.exception("hybrid serve: an engine step failed")
            self._end_all("error", f"{type(e).__name__}: {e}")
            return
        self._deliver(events, self._listeners)

    def _deliver(self, events: list[TokenEvent], listeners: dict) -> None:
        """Hand each event to its request's queue, one call per event loop; a finished request stops listening. A
        request whose event loop has closed is aborted."""
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for e in events:
            target = listeners.get(e.request_id)
            if target is None:
                continue
            per_loop.setdefault(target[0], []).append((target[1], e))
            if e.finished:
                del listeners[e.request_id]
        for loop, items in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody listens any more
                for _, e in items:
                    if listeners.pop(e.request_id, None) is not None:
                        self.engine.abort(e.request_id)

    def _end_all(self, reason: str, message: str | None) -> None:
        """Every listened-to request ends now with ``reason``."""
        listeners, self._listeners = self._listeners, {}
        for rid in listeners:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001  (a broken engine: the request still gets its last event)
                pass
        self._deliver([TokenEvent(rid, None, True, reason, message) for rid in listeners], listeners)


def _put_all(items) -> None:
    for box, event in items:
        box.put_nowait(event)
