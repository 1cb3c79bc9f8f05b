"""`AsyncLLMEngine`: an `LLMEngine` driven by one background thread, streamed to asyncio.

Every engine call (add, abort, step) happens on the engine thread, so the engine needs no
locks and an event loop is never blocked by model compute. Callers talk to it through a
command queue; each request gets an ``asyncio.Queue`` on the caller's own event loop that
receives `RequestOutput`s as they are produced. Leaving ``generate`` early (a client
disconnect, a task cancellation, a ``break``) aborts the request and frees its blocks.

Imports the engine, threading and asyncio only; nothing web/db.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from engine.engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed)."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            return False


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, name: str = "tiergate-engine") -> None:
        self.engine = engine
        self._commands: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- caller side (any thread / event loop) ------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       experts_per_token: int | None = None,
                       request_id: str | None = None, *, speculative: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises the engine's validation errors before the first one."""
        rid = request_id or f"areq-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        added: concurrent.futures.Future[str] = concurrent.futures.Future()

        def add() -> None:
            if not added.set_running_or_notify_cancel():  # the caller gave up before we got here
                return
            try:
                self.engine.add_request(prompt_token_ids, params, experts_per_token, rid,
                                        speculative=speculative, cache_salt=cache_salt)
            except BaseException as err:
                added.set_exception(err)
                return
            self._streams[rid] = stream
            added.set_result(rid)

        self._submit(add)
        finished = False
        try:
            await asyncio.wrap_future(added)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._submit(do)

    async def run_on_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` between steps on the engine thread (for stats and admin)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def do() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as err:
                fut.set_exception(err)

        self._submit(do)
        return await asyncio.wrap_future(fut)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, command: Callable[[], None]) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._commands.append(command)
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a bug or a bad batch: fail every live request, keep serving
                log.exception("engine step failed")
                self._fail_all(err)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                if not stream.put(out) and not out.finished:
                    self._streams.pop(out.request_id, None)
                    self.engine.abort(out.request_id)
        self._run_commands()  # let late callers register, so they are failed rather than left waiting
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _run_commands(self) -> None:
        while self._commands:
            try:
                self._commands.popleft()()
            except Exception:  # a command must never take the engine thread down
                log.exception("engine command failed")

    def _fail_all(self, err: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.put(err)
        self._streams.clear()
