"""Prometheus metrics of one server (its own registry, served at ``GET /metrics``)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine.planner import Plan
from ..engine.results import ChatResult
from ..kernels.attention import paths_used

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def turn_load(router) -> dict:
    """The loaded engine's turns ``waiting`` and ``running`` (none while no model is loaded)."""
    engine = router.engine
    return engine.scheduler.load() if engine is not None else {"waiting": 0, "running": 0}


class Metrics:
    """Counters of the server's turns and gauges of the loaded model's engine (0 while no
    model is loaded)."""

    def __init__(self, router):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "agentkv_requests", "HTTP requests answered", ["api", "status"], registry=r
        )
        self.turns = Counter(
            "agentkv_turns", "finished chat turns by cache outcome", ["cache"], registry=r
        )
        self.tokens = Counter(
            "agentkv_tokens",
            "tokens of finished turns: prompt = reused + prefilled; generated; shared "
            "(of the reused, those from other agents' blocks)",
            ["kind"],
            registry=r,
        )
        self.ttft = Histogram(
            "agentkv_ttft_seconds", "time to first token", buckets=TTFT_BUCKETS, registry=r
        )
        _add_gauges(r, router)

    def turn(self, result: ChatResult) -> None:
        s = result.stats
        self.turns.labels(s.cache).inc()
        self.tokens.labels("prompt").inc(s.prompt_tokens)
        self.tokens.labels("reused").inc(s.reused_tokens)
        self.tokens.labels("shared").inc(s.shared_tokens)
        self.tokens.labels("prefilled").inc(s.prefill_tokens)
        self.tokens.labels("generated").inc(s.generated_tokens)
        if s.generated_tokens:
            self.ttft.observe(s.ttft_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _add_gauges(r: CollectorRegistry, router) -> None:
    """The gauges of the loaded engine (its KV bytes, pool, turns) and of the process."""
    Gauge("agentkv_kv_resident_bytes", "KV cache bytes held in memory", registry=r).set_function(
        _of_engine(router, lambda e: e.resident_bytes())
    )
    Gauge(
        "agentkv_kv_disk_bytes", "KV cache bytes stored on disk for this model", registry=r
    ).set_function(_of_engine(router, lambda e: e.disk_bytes()))
    blocks = Gauge(
        "agentkv_pool_blocks",
        "KV pool blocks by state: capacity, used (held by agents), shared (by more than "
        "one), cached (held by none, kept findable), free, reserved (for running turns)",
        ["state"],
        registry=r,
    )
    fields = {
        "capacity": "capacity_blocks",
        "used": "used_blocks",
        "shared": "shared_blocks",
        "cached": "cached_blocks",
        "free": "free_blocks",
        "reserved": "reserved_blocks",
    }
    for state, field in fields.items():
        blocks.labels(state).set_function(
            _of_engine(router, lambda e, field=field: getattr(e.pool_stats(), field))
        )
    Gauge(
        "agentkv_pool_block_bytes", "bytes of one pool block (every layer)", registry=r
    ).set_function(_of_engine(router, lambda e: e.pool_stats().block_bytes))
    Gauge("agentkv_model_swaps", "models loaded since the server started", registry=r).set_function(
        lambda: router.swaps
    )
    calls = Gauge(
        "agentkv_attention_calls",
        "attention calls over agentkv caches by path (fused_cpu: agentkv's kernel, "
        "quantized_matmul: MLX's), since the process started",
        ["path"],
        registry=r,
    )
    for path in paths_used():
        calls.labels(path).set_function(lambda path=path: paths_used()[path])

    steps = Gauge(
        "agentkv_decode_steps",
        "decode steps of the loaded model's engine by plan (engine/planner.py): one (a turn "
        "alone, one token), draft (a turn alone with a draft), batch (several, one token "
        "each), both (several, drafts among them)",
        ["plan"],
        registry=r,
    )
    for plan in Plan:
        steps.labels(plan.value).set_function(
            _of_engine(router, lambda e, plan=plan: e.scheduler.plans[plan])
        )
    _add_store_gauges(r, router)
    Gauge("agentkv_turns_waiting", "turns queued", registry=r).set_function(
        lambda: turn_load(router)["waiting"]
    )
    Gauge("agentkv_turns_running", "turns prefilling or decoding", registry=r).set_function(
        lambda: turn_load(router)["running"]
    )


STORE_EVENTS = [
    ("fetch", "ok"), ("fetch", "unavailable"), ("fetch", "damaged"),
    ("commit", "ok"), ("commit", "unavailable"), ("commit", "conflict"), ("commit", "dropped"),
]  # fmt: skip


def _add_store_gauges(r: CollectorRegistry, router) -> None:
    """The fleet's object store (``--store``: docs/fleet.md): 0 without one."""
    events = Gauge(
        "agentkv_store_events",
        "object store fetches and commits by outcome since the model loaded (fetch: an agent "
        "another server ran; commit conflict: a lost race; unavailable: the store not reached)",
        ["op", "outcome"],
        registry=r,
    )
    for op, outcome in STORE_EVENTS:
        events.labels(op, outcome).set_function(
            _of_fleet(router, lambda f, key=(op, outcome): f.counts[key])
        )
    moved = Gauge(
        "agentkv_store_bytes", "bytes sent to and read from the object store", ["direction"],
        registry=r,
    )  # fmt: skip
    for direction in ("up", "down"):
        moved.labels(direction).set_function(
            _of_fleet(router, lambda f, d=direction: f.objects.traffic.snapshot()[1][d])
        )
    Gauge(
        "agentkv_kv_saved_bytes",
        "bytes the agents' saves wrote to the cache directory since the model loaded",
        registry=r,
    ).set_function(_of_engine(router, lambda e: e.writer.bytes_written))
    Gauge(
        "agentkv_store_pending_uploads", "agents waiting for their commit to the store", registry=r
    ).set_function(_of_fleet(router, lambda f: f.pending))


def _of_fleet(router, read):
    return _of_engine(router, lambda e: read(e.fleet) if e.fleet is not None else 0)


def _of_engine(router, read):
    """A gauge's reading of the loaded engine (0 while no model is loaded)."""

    def value():
        engine = router.engine
        return read(engine) if engine is not None else 0

    return value
