"""A chat turn seen from the event loop: the engine's thread reports, asyncio awaits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio

from ..engine.job import Resumed
from ..engine.results import ChatResult

HEARTBEAT_S = 15.0


class AsyncTurn:
    """Submit a turn to the engine and follow it from asyncio.

    ``await start()`` waits until the agent's cache state is known (hot / warm /
    cold), ``pieces()`` yields text as it is generated (and ``None`` as a
    heartbeat after ``HEARTBEAT_S`` of silence), ``await finish()`` returns the
    ``ChatResult`` once the turn and its save are done. ``cancel()`` stops it
    at the next token; a cancelled turn saves no reply. ``watch(receive)``
    cancels it when the HTTP client disconnects, until ``unwatch()``.
    """

    def __init__(self, engine, agent_id: str, messages: list[dict], sampling: dict):
        self.engine = engine
        self.agent_id = agent_id
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self.resumed: Resumed | None = None
        self.ended = False
        self._watcher: asyncio.Task | None = None
        self.job = engine.submit_chat(agent_id, messages, listener=self._listen, **sampling)

    def _listen(self, event: str, value) -> None:  # on the engine's thread
        self._loop.call_soon_threadsafe(self._events.put_nowait, (event, value))

    async def start(self) -> Resumed:
        while self.resumed is None:
            event, value = await self._events.get()
            if event == "start":
                self.resumed = value
            elif event == "end":
                self.ended = True
                self.job.wait()  # raises the turn's error
                raise RuntimeError("the turn ended before it started")
        return self.resumed

    async def pieces(self) -> AsyncIterator[str | None]:
        while not self.ended:
            try:
                event, value = await asyncio.wait_for(self._events.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                yield None
                continue
            if event == "piece":
                yield value
            elif event == "end":
                self.ended = True

    async def finish(self) -> ChatResult:
        """The result, once the turn has ended and its state is on disk."""
        async for _ in self.pieces():
            pass
        result = self.job.wait()  # set: the job ended
        await anyio.to_thread.run_sync(self.engine.wait_saved, self.agent_id)
        return result

    def cancel(self) -> None:
        if not self.ended:
            self.job.cancel()

    def watch(self, receive) -> None:
        """Cancel the turn if the client goes away, from now until ``unwatch``."""

        async def watch():
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.cancel()
                    return

        self._watcher = asyncio.create_task(watch())

    async def unwatch(self) -> None:
        task, self._watcher = self._watcher, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
