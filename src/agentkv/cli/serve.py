"""``agentkv serve``: the HTTP server (uvicorn) over one Engine.

Startup, in this order, each failure one line and a non-zero exit: the port is bound (a
port in use fails at once), the default model loads, then the server listens and says
"serving".
"""

from __future__ import annotations

import errno
import gc
import ipaddress
import logging
import os
import re
import socket
from pathlib import Path

from ..errors import AgentKVError
from .output import progress

API_KEY_ENV = "AGENTKV_API_KEY"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args) -> int:
    from ..server import create_app
    from ..server.models import ModelRouter, describe

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and api_key is None:
        progress(
            f"agentkv: warning: serving on {args.host} without an API key: anyone who can "
            f"reach it can use it (set --api-key or ${API_KEY_ENV})"
        )
    _configure_logging(args.log_level)
    checked_engine_options(_engine_options(args))  # before the port, before any model
    try:
        served = describe(args.model or [None])
        ttl = args.model_idle_ttl
        if ttl is None:
            ttl = 600.0 if len(served) > 1 else 0.0
        router = ModelRouter(served, _engine_factory(args), idle_ttl=ttl or None)
        sockets = bind_sockets(args.host, args.port)
        try:
            progress(f"agentkv: loading {router.default}...")
            router.load_default()
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
    except AgentKVError as exc:  # a model's error can hold a hub's multi-line message
        raise AgentKVError(" ".join(str(exc).split())) from None
    try:
        app = create_app(
            router=router,
            api_key=api_key,
            max_body_bytes=args.max_body_mb << 20,
            default_max_tokens=args.default_max_tokens,
            close_engine=True,
            responses_dir=Path(args.cache_dir) / "responses" if args.cache_dir else None,
        )
        started = _run_uvicorn(app, sockets, args, _serving_line(args.host, sockets, router))
    finally:
        engine = router.engine
        if engine is not None:  # the app's shutdown closed it, unless startup failed
            engine.close()
    if not started:
        raise AgentKVError("the server did not start (see the log above)")
    return 0


def _serving_line(host: str, sockets: list[socket.socket], router) -> str:
    port = sockets[0].getsockname()[1]  # the one bound (--port 0: a free one)
    return (
        f"agentkv: serving {', '.join(router.models)} on http://{host}:{port} "
        "(OpenAI /v1/chat/completions and /v1/responses, Anthropic /v1/messages, "
        "agents /v1/agents)"
    )


def _configure_logging(log_level: str) -> None:
    level = getattr(logging, log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ours = logging.getLogger("agentkv")
    ours.setLevel(min(level, ours.getEffectiveLevel()))


# The command line's name of each Engine option it sets.
_FLAGS = {
    "weights": "--weights",
    "kv_bits": "--kv-bits",
    "key_bits": "--key-bits",
    "kv_format": "--kv-format",
    "kv_wide_layers": "--kv-wide-layers",
    "pool_bytes": "--pool-memory",
    "kv_swap_budget": "--kv-swap-budget",
    "kv_swap_read_ahead": "--kv-swap-read-ahead",
    "draft_tokens": "--draft-tokens",
    "max_batch": "--max-batch",
    "max_queue": "--max-queue",
    "schedule": "--schedule",
}


def checked_engine_options(options: dict) -> dict:
    """``options``, checked as the Engine checks them, before any model loads; an error
    names the command line's options (``--kv-swap-budget``), not the Engine's."""
    from ..engine.config import EngineConfig

    try:
        EngineConfig(**options)
    except AgentKVError as exc:
        names = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")
        raise AgentKVError(names.sub(lambda m: _FLAGS[m.group(1)], str(exc))) from None
    return options


def _engine_options(args) -> dict:
    """The Engine options the command line sets (but the model: each served model's)."""
    return {
        "cache_dir": args.cache_dir,
        "store_url": args.store,
        "kv_bits": args.kv_bits,
        "key_bits": args.key_bits,
        "pool_bytes": args.pool_memory,
        "kv_swap_budget": args.kv_swap_budget,
        "kv_swap_read_ahead": args.kv_swap_read_ahead,
        "draft_tokens": args.draft_tokens,
        "max_batch": args.max_batch,
        "max_queue": args.max_queue,
        "schedule": args.schedule,
        **engine_format(args),
    }


def _engine_factory(args):
    """``source -> Engine`` with the command line's engine options."""
    from ..engine import Engine

    options = _engine_options(args)

    def make(source):
        engine = Engine(model=source, **options)
        # agent clients declare tools on nearly every request: the grammar's token table is
        # built now, off the first request's path (it took ~0.6 s of that request's TTFT)
        engine.grammars.warm_in_background()
        freeze_heap()
        return engine

    return make


def freeze_heap() -> None:
    """Keep what the process holds so far (the model's, the tokenizer's, the libraries'
    objects) out of Python's collector for good: a full collection walks every tracked object
    and stops every thread meanwhile, 30-100 ms in a served process, which landed on
    whichever request was running (measured: a 102 ms pause inside a turn's fetch from the
    agent store; docs/server.md). Garbage made later is collected as before; what an earlier
    call froze is looked at again first, so a model swapped out since (its reference cycles
    included) is collected, not kept for good."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``port`` on every address ``host`` names (as uvicorn binds them), not
    yet listening; an ``AgentKVError`` that says why if one cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise AgentKVError(f"cannot serve on {host!r}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: IPv4 gets a socket of its own
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        why = "in use (another server? --port picks another)"
        if exc.errno != errno.EADDRINUSE:
            why = exc.strerror or str(exc)
        raise AgentKVError(f"cannot serve on {host}:{port}: {why}") from None
    return sockets


def _run_uvicorn(app, sockets: list[socket.socket], args, serving: str) -> bool:
    """Serve ``app`` on ``sockets`` until a signal ends it; print ``serving`` once it
    listens. Whether it started."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                freeze_heap()  # the server's own objects too
                progress(serving)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    server = Server(config)
    try:
        server.run(sockets=sockets)
    except SystemExit:  # uvicorn's way out of a failed startup (it logged why)
        return False
    return server.started


def engine_format(args) -> dict:
    """``Engine`` options for ``--weights``, ``--kv-format`` and ``--kv-wide-layers`` (unset
    or ``auto``: the engine's defaults)."""
    options = {}
    for name in ("weights", "kv_format", "kv_wide_layers"):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    return options
