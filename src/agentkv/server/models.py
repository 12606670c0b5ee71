"""The models one server serves, one loaded at a time (hot-swap).

``agentkv serve --model A --model B``: a request's ``model`` field picks its model. Only
one model (one Engine, one block pool) is in memory at a time: a request for the other
model waits until every request in flight on the loaded one has finished, then the
loaded engine is closed — its agents flushed to disk, its pool released — and the other
is loaded. Agents are stored per model fingerprint, so A's agents resume warm when A
comes back. A model that has had no request for ``idle_ttl`` seconds is unloaded (its
memory given back); the next request loads it again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from ..errors import AgentKVError

log = logging.getLogger("agentkv.server")

EMBEDDED = "embedded"  # `--model embedded`: the embedded default, beside other models


@dataclass
class ServedModel:
    name: str  # the id clients send as `model`
    source: str | None  # what Engine(model=...) takes; None: the embedded default
    context_limit: int | None  # from the model's config, when it says


@dataclass
class _Slot:
    engine: object | None = None
    name: str | None = None
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)


def describe(sources: list[str | None]) -> list[ServedModel]:
    """Names and context limits of the models to serve, without loading any; a local path
    that is not there, or holds no model, fails here (``ModelImportError``)."""
    from ..model.load import EMBEDDED_NAME, check_model_source, resolve_model

    out, seen = [], set()
    for source in sources or [None]:
        if source == EMBEDDED:
            source = None
        if source is None:
            name, limit = EMBEDDED_NAME, None
            try:
                path, _ = resolve_model(None)
                limit = _context_from(Path(path))
            except AgentKVError:
                pass  # fetched when it is loaded; the engine checks the context then
        else:
            check_model_source(source)
            path = Path(source).expanduser()
            name = path.stem if path.suffix == ".gguf" else path.name if path.exists() else source
            limit = _context_from(path) if path.is_dir() else None
        if name.lower() in seen:
            raise AgentKVError(f"two models are named {name!r}; serve each under one name")
        seen.add(name.lower())
        out.append(ServedModel(name, source, limit))
    return out


def _context_from(path: Path) -> int | None:
    try:
        limit = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return limit if isinstance(limit, int) and limit > 0 else None


class ModelRouter:
    def __init__(self, models: list[ServedModel], make_engine, *, idle_ttl: float | None = None):
        self.models = {m.name: m for m in models}
        self.default = models[0].name
        self._make_engine = make_engine  # source -> Engine
        self.idle_ttl = idle_ttl
        self._slot = _Slot()
        self._lock = asyncio.Lock()
        self._idle = asyncio.Condition()
        self.swaps = 0
        self._reaper: asyncio.Task | None = None

    @classmethod
    def around(cls, engine) -> ModelRouter:
        """A router serving one engine that is already loaded."""
        model = ServedModel(engine.loaded.name, None, engine.context_limit)
        router = cls([model], lambda source: engine)
        router._slot.engine, router._slot.name = engine, model.name
        return router

    # -- names ------------------------------------------------------------------------------

    def canonical(self, name: str) -> str | None:
        for known in self.models:
            if known.lower() == name.lower():
                return known
        return None

    @property
    def loaded(self) -> str | None:
        return self._slot.name

    @property
    def engine(self):
        """The engine in memory now (None if none is loaded)."""
        return self._slot.engine

    # -- loading ----------------------------------------------------------------------------

    def load_default(self) -> None:
        """Load the default model now, on this thread, before the server runs (so a model
        that cannot load fails the start, before any request can come)."""
        model = self.models[self.default]
        self._slot.engine, self._slot.name = self._make_engine(model.source), model.name
        self.swaps += 1

    async def start(self) -> None:
        """Load the default model (so the server is ready) and start the idle reaper."""
        await self.acquire(self.default)
        self.release(self.default)
        if self.idle_ttl:
            self._reaper = asyncio.create_task(self._reap())

    async def acquire(self, name: str):
        """The engine of ``name`` for one request (``release`` it when the request is done);
        swaps models first if another one is loaded."""
        async with self._lock:
            slot = self._slot
            if slot.name != name:
                async with self._idle:
                    await self._idle.wait_for(lambda: slot.in_flight == 0)
                await self._unload()
                model = self.models[name]
                log.info("agentkv: loading model %s", name)
                engine = await anyio.to_thread.run_sync(self._make_engine, model.source)
                slot.engine, slot.name = engine, name
                self.swaps += 1
            slot.in_flight += 1
            slot.last_used = time.monotonic()
            return slot.engine

    def release(self, name: str) -> None:
        slot = self._slot
        slot.in_flight -= 1
        slot.last_used = time.monotonic()

        async def notify():
            async with self._idle:
                self._idle.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def _unload(self) -> None:
        slot = self._slot
        if slot.engine is None:
            return
        engine, slot.engine, slot.name = slot.engine, None, None
        log.info("agentkv: unloading model %s (every agent is on disk)", engine.loaded.name)
        await anyio.to_thread.run_sync(engine.close)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.idle_ttl))
            async with self._lock:
                slot = self._slot
                idle = time.monotonic() - slot.last_used
                if slot.engine is not None and slot.in_flight == 0 and idle >= self.idle_ttl:
                    await self._unload()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        async with self._lock:
            await self._unload()
