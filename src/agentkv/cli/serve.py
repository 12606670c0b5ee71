"""``agentkv serve``: the HTTP server (uvicorn) over one Engine."""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
from pathlib import Path

API_KEY_ENV = "AGENTKV_API_KEY"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args) -> int:
    import uvicorn

    from ..engine import Engine
    from ..server import create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(args.host) and api_key is None:
        print(
            f"agentkv: warning: serving on {args.host} without an API key: anyone who can "
            f"reach it can use it (set --api-key or ${API_KEY_ENV})",
            file=sys.stderr,
        )
    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    ours = logging.getLogger("agentkv")
    ours.setLevel(min(level, ours.getEffectiveLevel()))
    from ..server.models import ModelRouter, describe

    served = describe(args.model or [None])
    ttl = args.model_idle_ttl
    if ttl is None:
        ttl = 600.0 if len(served) > 1 else 0.0

    def make_engine(source):
        return Engine(
            model=source,
            cache_dir=args.cache_dir,
            kv_bits=args.kv_bits,
            key_bits=args.key_bits,
            **engine_format(args),
            pool_bytes=args.pool_memory,
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            schedule=args.schedule,
        )

    router = ModelRouter(served, make_engine, idle_ttl=ttl or None)
    names = ", ".join(m.name for m in served)
    print(f"agentkv: loading {served[0].name}...", file=sys.stderr, flush=True)
    app = create_app(
        router=router,
        api_key=api_key,
        max_body_bytes=args.max_body_mb << 20,
        default_max_tokens=args.default_max_tokens,
        close_engine=True,
        responses_dir=Path(args.cache_dir) / "responses" if args.cache_dir else None,
    )
    print(
        f"agentkv: serving {names} on http://{args.host}:{args.port} "
        "(OpenAI /v1/chat/completions and /v1/responses, Anthropic /v1/messages, "
        "agents /v1/agents)",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
        )
    finally:
        engine = router.engine
        if engine is not None:  # the app's shutdown closed it, unless startup failed
            engine.close()
    return 0


def engine_format(args) -> dict:
    """``Engine`` options for ``--kv-format`` and ``--kv-wide-layers`` (unset or ``auto``:
    the engine's defaults)."""
    options = {}
    for name in ("kv_format", "kv_wide_layers"):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    return options
