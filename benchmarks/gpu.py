"""GPU: agentkv against mlx-lm on the same GPU, side by side in one process.

Random-weight models of real shapes (4-bit weights, group 64, float16 scales; the
embedded tokenizer; built here, nothing downloaded), natural text as prompts (Python's help
topics), greedy decoding, times taken from outside as a user sees them:

* ``decode``: for each context, mlx-lm's ``stream_generate`` (its float16 KV cache; its
  4-bit KV where the backend runs it) and ``agentkv.Engine`` (the default 4-bit KV, and
  ``kv_bits=16``) prefill the prompt cold and generate ``decode_tokens`` tokens: time to
  the first token, and decode tokens/s = (tokens - 1) / time after the first token.
* ``hot``: the longest context's agent (or prompt cache, for mlx-lm) takes a turn adding
  ``hot_tokens`` tokens of text: time to the first token.
* ``batch``: ``batch`` agents of ``batch_context`` tokens each decode together: aggregate
  tokens/s (agentkv: a hot turn of every agent through ``generate_many``; mlx-lm:
  ``batch_generate``'s generation rate).
* ``step_anatomy``: one decode step at ``batch_context`` tokens taken apart (building the
  step and its graph, evaluating it, settling the pool, sampling), for agentkv's arms and
  mlx-lm's.
* ``kernel``: the paged attention kernel alone at ``kernel_context`` tokens (one layer,
  one decode query per query head, the default format) against ``mx.fast.
  scaled_dot_product_attention`` over float16 keys and values, ``CALLS`` independent calls
  an evaluation: microseconds a call, the KV bytes each reads, and those bytes per second as
  a fraction of the GPU's copy bandwidth (a device copy measured here) and of its nominal
  bandwidth where the GPU is known.

``shapes``: ``smollm2-135m`` (SmolLM2-135M's shape: 30 layers, 9 query / 3 KV heads of 64)
and ``llama3-8b`` (Llama-3-8B's: 32 layers, 32 / 8 heads of 128, vocabulary cut to 49,152).
``qwen3-0.6b`` is Qwen3-0.6B's (28 layers, 16 / 8 heads of 128, each query and key head
RMS-normed before RoPE). ``tiny`` (2 layers) only checks the harness, on any device;
``tiny-qwen3`` and ``tiny-gemma3`` are its Qwen3 and Gemma 3 (the tests' GPU emulation runs
them).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from .common import emit, median_ms, progress

SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rope_theta=500000.0, tie_word_embeddings=False),
    # Qwen3's attention: an RMS norm of each query and key head before RoPE
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2,
                       intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, rope_theta=1000000.0),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                       intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True),
    # Gemma 3's: the same norms (of 1 + weight), a 32-token window every other layer here
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=128, num_hidden_layers=2,
                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, query_pre_attn_scalar=64, sliding_window=32,
                        sliding_window_pattern=2),
}  # fmt: skip
CALLS = 20  # kernel calls per timed evaluation in the kernel rows
# Nominal memory bandwidth (GB/s) by the GPU's name as nvidia-smi gives it
NOMINAL_GBPS = {"H200": 4800, "H100 80GB HBM3": 3350, "H100 NVL": 3900, "H100 PCIe": 2000}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_dir(given: str | None) -> Path:
    """Where the tokenizer files come from: ``given``, else the embedded model's."""
    if given:
        path = Path(given)
    else:
        from agentkv.model.load import ensure_embedded_model

        path = ensure_embedded_model()
    missing = [f for f in TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"agentkv: error: {given} has no {', '.join(missing)}")
    return path


def build_model(shape: str, root: Path, tokenizer: Path) -> Path:
    """A random-weight 4-bit model of ``shape`` (a llama unless it names another
    ``model_type``) as an mlx-lm directory."""
    import importlib
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    config = {
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 65536,
        **SHAPES[shape],
    }
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4)
    config["quantization"] = {"group_size": 64, "bits": 4}
    path = root / shape
    path.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, path / name)
    del model, weights
    return path


def prompt_text(tokenizer, tokens: int, *, offset: int = 0) -> str:
    """About ``tokens`` tokens of English prose and code (Python's help topics)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k].strip() for k in sorted(topics))
    while len(text) < 6 * (tokens + offset):
        text += "\n\n" + text
    ids = tokenizer.encode(text[: 6 * (tokens + offset)])[offset : offset + tokens]
    return tokenizer.decode(ids)


class Timing:
    """A generation timed from outside: first token, then the rest."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = None
        self.last = None
        self.tokens = 0

    def token(self, count: int = 1) -> None:
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now
        self.tokens += count

    def row(self) -> dict:
        after = (self.last or self.start) - (self.first or self.start)
        return {
            "ttft_ms": round(((self.first or self.start) - self.start) * 1000, 1),
            "decode_tps": round((self.tokens - 1) / after, 1) if after > 0 else None,
            "tokens": self.tokens,
        }


def mlx_lm_generate(model, tokenizer, prompt, max_tokens: int, **options) -> dict:
    import mlx_lm

    timing = Timing()
    try:
        for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **options):
            timing.token()
    except Exception as exc:  # e.g. a KV format the backend has no kernel for
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return timing.row()


def agentkv_generate(engine, agent: str, prompt: str, max_tokens: int) -> tuple[dict, str]:
    """A turn through ``stream_generate``, timed by its pieces (the first comes with the first
    token, the last with the last); its row and its text. Each agent is its own tenant (its
    id as the cache salt), so a cold turn prefills its whole prompt: the prompts all begin
    with the same text, whose blocks it would otherwise share with the agents before it."""
    timing = Timing()
    stream = engine.stream_generate(agent, prompt, max_tokens=max_tokens, cache_salt=agent)
    for _ in stream:
        timing.token()
    result = stream.result
    timing.tokens = len(result.tokens)
    row = timing.row()
    row.update(engine_ttft_ms=round(result.stats.ttft_ms, 1),
               engine_decode_tps=round(result.stats.decode_tps, 1),
               cache=result.stats.cache, reused_tokens=result.stats.reused_tokens)  # fmt: skip
    return row, result.text


def run(
    shapes=("smollm2-135m", "llama3-8b"),
    contexts=(1024, 8192, 32768),
    *,
    decode_tokens: int = 128,
    prefill_context: int = 4096,
    hot_tokens: int = 100,
    batch: int = 8,
    batch_context: int = 1024,
    kernel_context: int = 32768,
    tokenizer: str | None = None,
    as_json: bool = False,
) -> list[dict]:
    import mlx.core as mx

    from agentkv import kernels

    gpu = [b for b in ("metal", "cuda") if b in kernels.available_backends()]
    if not gpu and "tiny" not in shapes:
        raise SystemExit("agentkv: error: bench gpu needs MLX's GPU (Metal or CUDA); none here")
    source = tokenizer_dir(tokenizer)
    rows: list[dict] = []
    extra = {"gpu": gpu_name(), "copy_gbps": round(copy_gbps(1 << 30 if gpu else 64 << 20), 1)}
    extra["nominal_gbps"] = next((v for k, v in NOMINAL_GBPS.items() if k in extra["gpu"]), None)
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-gpu-") as tmp:
        for shape in shapes:
            progress(f"gpu: building the {shape} model...")
            path = build_model(shape, Path(tmp) / "models", source)
            settings = dict(
                contexts=contexts, decode_tokens=decode_tokens, prefill_context=prefill_context,
                hot_tokens=hot_tokens, batch=batch, batch_context=batch_context,
                kernel_context=kernel_context,
            )  # fmt: skip
            rows += measure_shape(shape, path, Path(tmp) / f"kv-{shape}", extra, **settings)
            mx.clear_cache()
    emit("gpu", rows, as_json, extra)
    return rows


class Rows(list):
    """The rows so far, each also printed to stderr as it comes (a run cut short by a time
    limit keeps what it measured)."""

    def append(self, row: dict) -> None:
        super().append(row)
        progress("gpu: row " + json.dumps(row))

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def guarded(rows: Rows, what: dict, fn) -> None:
    """Run one arm; a failure becomes a row saying so, and the next arm runs."""
    try:
        rows += fn()
    except Exception as exc:
        rows.append({**what, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})


def measure_shape(shape: str, path: Path, kv: Path, extra: dict, **s) -> list[dict]:
    import mlx_lm

    from agentkv import Engine, kernels

    rows = Rows()
    longest = max(max(s["contexts"]), s["prefill_context"]) + s["decode_tokens"] + s["hot_tokens"]
    model, tokenizer = mlx_lm.load(str(path))
    arms = {"agentkv-q4": {}, "agentkv-kv16": {"kv_bits": 16}}
    engines = {}
    for name, options in arms.items():
        progress(f"gpu: {shape}: starting agentkv ({name})...")
        start = time.perf_counter()
        pool = _pool_bytes(path, options, longest, s["batch"] * (s["batch_context"] + 512))
        engines[name] = Engine(model=str(path), cache_dir=kv / name, pool_bytes=pool, **options)
        rows.append({"shape": shape, "arm": name, "measure": "start_s",
                     "value": round(time.perf_counter() - start, 2)})  # fmt: skip
    # what runs agentkv's attention for this shape: its kernels, unless the first engine's
    # warm-up check (engine/warmup.py; its cost is in that arm's start_s) turned them off
    extra.setdefault("gpu_kernels", {})[shape] = kernels.gpu.kernels_state()
    try:
        progress(f"gpu: {shape}: warming up every arm (the GPU compiles kernels at first use)...")
        _warm_up(model, tokenizer, engines)
        contexts = sorted(set(s["contexts"]) | {s["prefill_context"]})
        replies = {}
        for context in contexts:
            prompt = prompt_text(tokenizer, context)
            n = s["decode_tokens"] if context in s["contexts"] else 2
            progress(f"gpu: {shape}: {context} tokens...")
            mlx_arms = {"mlx-lm-fp16": {}}
            if context == min(contexts):
                mlx_arms["mlx-lm-q4"] = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 0}
            for name, options in mlx_arms.items():
                row = mlx_lm_generate(model, tokenizer, prompt, n, **options)
                rows.append({"shape": shape, "arm": name, "context": context, **row})
            for name, engine in engines.items():

                def turn(name=name, engine=engine, context=context, prompt=prompt, n=n):
                    row, replies[name, context] = agentkv_generate(
                        engine, f"ctx{context}", prompt, n
                    )
                    return [{"shape": shape, "arm": name, "context": context, **row}]

                guarded(rows, {"shape": shape, "arm": name, "context": context}, turn)
        longest = max(s["contexts"])
        what = {"shape": shape}
        shortest = min(s["contexts"])
        guarded(rows, what, lambda: _pipeline(shape, tokenizer, engines, replies, shortest, s))
        guarded(rows, what, lambda: _hot(shape, model, tokenizer, engines, replies, longest, s))
        guarded(rows, what, lambda: _batch(shape, model, tokenizer, engines, s))
        engine = engines["agentkv-q4"]
        if kernels.gpu.kernels_on():  # else there is no kernel of agentkv's to time
            guarded(rows, what, lambda: _kernel(shape, engine, s["kernel_context"], extra))
        at = s["batch_context"]
        for name, engine in engines.items():
            guarded(rows, {**what, "arm": name}, lambda e=engine, n=name: _anatomy(shape, n, e, at))
        guarded(rows, what, lambda: _mlx_lm_anatomy(shape, model, at))
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def _warm_up(model, tokenizer, engines) -> None:
    """Every arm once, untimed: a cold prompt over more keys than one part, a hot turn, a
    batch of two (so neither side's first-use compilation lands in a timed row)."""
    import mlx.core as mx
    import mlx_lm

    # (on the CPU, where the harness runs in the tests, a shorter one: no kernel compiles)
    prompt = prompt_text(tokenizer, 700 if mx.default_device() != mx.cpu else 64)
    mlx_lm_generate(model, tokenizer, prompt, 4)
    mlx_lm.batch_generate(model, tokenizer, [tokenizer.encode(prompt)] * 2, max_tokens=4)
    for engine in engines.values():
        first = engine.generate("warm-up", prompt, max_tokens=4)
        engine.generate("warm-up", prompt + first.text + " and so on", max_tokens=4)
        engine.generate_many([("warm-a", prompt), ("warm-b", prompt[:1000])], max_tokens=4)


def _pool_bytes(path: Path, options: dict, longest: int, batch_tokens: int) -> int:
    """Room for the longest agent, the batch and the hot copies, in the arm's format."""
    config = json.loads((path / "config.json").read_text())
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    per_token *= 4 if options.get("kv_bits") == 16 else 1  # bytes: 2 kinds x 2 or ~0.6
    return int((3 * longest + batch_tokens) * per_token * 1.3) + (64 << 20)


def _hot(shape, model, tokenizer, engines, replies, context: int, s) -> list[dict]:
    """A turn adding ``hot_tokens`` tokens to the longest context's agent."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = prompt_text(tokenizer, context)
    more = prompt_text(tokenizer, s["hot_tokens"], offset=context + 500)
    rows = []
    for name, engine in engines.items():
        if (name, context) not in replies:
            continue  # its decode arm failed
        turn = prompt + replies[name, context] + more
        row, _ = agentkv_generate(engine, f"ctx{context}", turn, 2)
        rows.append({"shape": shape, "arm": name, "measure": "hot_turn", "context": context, **row})
    cache = make_prompt_cache(model)
    mlx_lm_generate(model, tokenizer, prompt, s["decode_tokens"], prompt_cache=cache)
    ids = tokenizer.encode(more)
    row = mlx_lm_generate(model, tokenizer, ids, 2, prompt_cache=cache)
    rows.append({"shape": shape, "arm": "mlx-lm-fp16", "measure": "hot_turn", "context": context,
                 **row})  # fmt: skip
    whole = mlx_lm_generate(model, tokenizer, prompt + more, 2)
    rows.append({"shape": shape, "arm": "mlx-lm-fp16", "measure": "whole_prompt",
                 "context": context, **whole})  # fmt: skip
    return rows


def _pipeline(shape, tokenizer, engines, replies, context: int, s) -> list[dict]:
    """Decode with the GPU's pipelined loop and without it, side by side: the agent of
    ``context`` tokens takes two more turns, one per setting (``Scheduler.pipeline``; on a
    device that does not pipeline, both rows are unpipelined)."""
    rows = []
    for name, engine in engines.items():
        if (name, context) not in replies:
            continue  # its decode arm failed
        scheduler = engine.scheduler
        text, was = prompt_text(tokenizer, context) + replies[name, context], scheduler.pipeline
        for pipelined in (was, False):
            text += "\n\nGo on."
            scheduler.pipeline = pipelined
            try:
                row, reply = agentkv_generate(engine, f"ctx{context}", text, s["decode_tokens"])
            finally:
                scheduler.pipeline = was
            text += reply
            measure = "decode_pipelined" if pipelined else "decode_unpipelined"
            rows.append({"shape": shape, "arm": name, "measure": measure, "context": context,
                         **row})  # fmt: skip
    return rows


def _batch(shape, model, tokenizer, engines, s) -> list[dict]:
    import mlx_lm

    n, context, tokens = s["batch"], s["batch_context"], s["decode_tokens"]
    prompts = [prompt_text(tokenizer, context, offset=i * 997) for i in range(n)]
    rows = []
    for name, engine in engines.items():
        agents = [f"batch{i}" for i in range(n)]
        first = engine.generate_many(list(zip(agents, prompts)), max_tokens=1)
        turns = [(a, p + r.text + "\n\nGo on:") for a, p, r in zip(agents, prompts, first)]
        start = time.perf_counter()
        results = engine.generate_many(turns, max_tokens=tokens)
        wall = time.perf_counter() - start
        made = sum(len(r.tokens) for r in results)
        rows.append({"shape": shape, "arm": name, "measure": "batch_tps", "agents": n,
                     "context": context, "value": round(made / wall, 1)})  # fmt: skip
    ids = [tokenizer.encode(p) for p in prompts]
    response = mlx_lm.batch_generate(model, tokenizer, ids, max_tokens=tokens)
    rows.append({"shape": shape, "arm": "mlx-lm-fp16", "measure": "batch_tps", "agents": n,
                 "context": context, "value": round(response.stats.generation_tps, 1)})  # fmt: skip
    return rows


def _kernel(shape, engine, context: int, extra: dict) -> list[dict]:
    """The paged attention kernel alone (layer 0, one decode query) against MLX's SDPA."""
    import mlx.core as mx
    import numpy as np

    from agentkv import kernels
    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.kernels.types import HostIndex, PagedQuery
    from agentkv.pool import KVPool

    from .common import synthetic_table

    spec, quant = engine.spec, engine.quant
    layer = next(i for i in range(spec.num_layers) if i not in quant.wide_layers)
    pool = KVPool(
        spec, quant, pool_bytes=(context // BLOCK_TOKENS + 4) * engine.pool.arena.block_bytes
    )
    table = synthetic_table(pool, context)
    arena, q_heads = pool.arena, engine.loaded.query_heads
    lq = arena.layer_quants[layer]
    ct = lq.channel_tokens if lq.channel_keys else 0
    tables = mx.array([table.blocks], dtype=mx.int32)
    host = HostIndex(
        tables=np.asarray([table.blocks], np.int32),
        lengths=np.asarray([context], np.int32),
        tail_slots=np.asarray([table.tail], np.int32) if ct else None,
    )
    paged = PagedQuery(
        arena.keys(layer), arena.values(layer), tables, mx.array([context], dtype=mx.int32),
        spec.kv_heads, BLOCK_TOKENS, lq.key_bits, lq.value_bits, lq.group_size, 0, None, ct,
        arena.tails[layer] if ct else None,
        mx.array(host.tail_slots) if ct else None, host,
    )  # fmt: skip
    dim = spec.key_head_dim
    queries = [mx.random.normal((1, q_heads, 1, dim)).astype(mx.float16) for _ in range(CALLS)]
    mx.eval(queries)
    q = queries[0]
    # CALLS calls a timed evaluation: MLX's own cost of one (~0.1 ms on CUDA) is not the kernel's
    ours = _time(lambda: [kernels.paged_attention_body(x, paged, scale=dim**-0.5) for x in queries])
    ours /= CALLS
    kv_bytes = context * sum(c.heads * c.row_bytes for c in arena.components[layer])
    keys = mx.random.normal((1, spec.kv_heads, context, dim)).astype(mx.float16)
    values = mx.random.normal((1, spec.kv_heads, context, dim)).astype(mx.float16)
    sdpa = _time(
        lambda: [
            mx.fast.scaled_dot_product_attention(x, keys, values, scale=dim**-0.5) for x in queries
        ]
    )
    sdpa /= CALLS
    rows = []
    for name, us, nbytes in (
        ("agentkv-q4", ours, kv_bytes),
        ("mlx-sdpa-fp16", sdpa, keys.nbytes + values.nbytes),
    ):
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append({
            "shape": shape, "arm": name, "measure": "attention_kernel", "context": context,
            "us": round(us, 1), "kv_bytes": nbytes, "gbps": round(gbps, 1),
            "of_copy": round(gbps / extra["copy_gbps"], 3),
            "of_nominal": round(gbps / extra["nominal_gbps"], 3) if extra["nominal_gbps"] else None,
            "launch": str(paged.launch(q)) if name == "agentkv-q4" else None,
        })  # fmt: skip
    table.release()
    return rows


ANATOMY_STEPS = 48
CPU_ANATOMY_STEPS = 6  # on the CPU the harness runs (tests): mlx-lm's float16 steps are slow


def _anatomy_steps() -> int:
    import mlx.core as mx

    return ANATOMY_STEPS if mx.default_device() != mx.cpu else CPU_ANATOMY_STEPS


def _anatomy(shape: str, name: str, engine, context: int) -> list[dict]:
    """Where one decode step's time goes in agentkv's engine (median ms of ANATOMY_STEPS
    steps, CPU_ANATOMY_STEPS on a CPU, at ``context`` tokens, the runner's own operations one
    by one on this thread while the scheduler idles): building the step and its graph,
    evaluating it, settling the arenas, sampling. What a GPU spends beyond mlx-lm's step is here."""
    import mlx.core as mx

    from agentkv import mlx_adapter
    from agentkv.pool.step import PagedStep

    runner, pool = engine.runner, engine.pool
    table = pool.new_table(pool.seed("agentkv/anatomy"))
    steps = _anatomy_steps()
    reservation = pool.reserve(-(-(context + steps + 1) // 256) + 1)
    parts: dict[str, list[float]] = {"build": [], "eval": [], "settle": [], "sample": []}
    try:
        logits = runner.forward([table], [[7] * context], reservations=[reservation])
        token = int(mx.argmax(logits, axis=-1).item())
        for _ in range(steps):
            t0 = time.perf_counter()
            table.grow(1, pool.arena.copy_rows, reservation)
            step = PagedStep(pool.arena, engine.loaded.spec, [table], 1)
            logits = mlx_adapter.last_logits(runner.model, mx.array([[token]]), step.caches)
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            pool.arena.settle()
            t3 = time.perf_counter()
            token = int(mx.argmax(logits, axis=-1).item())
            table.written([token])
            t4 = time.perf_counter()
            for key, a, b in (("build", t0, t1), ("eval", t1, t2), ("settle", t2, t3),
                              ("sample", t3, t4)):  # fmt: skip
                parts[key].append(b - a)
    finally:
        reservation.close()
        table.release()
    row = {"shape": shape, "arm": name, "measure": "step_anatomy", "context": context}
    row.update({f"{k}_ms": median_ms(v) for k, v in parts.items()})
    row["step_ms"] = round(sum(row[f"{k}_ms"] for k in parts), 3)
    return [row]


def _mlx_lm_anatomy(shape: str, model, context: int) -> list[dict]:
    """mlx-lm's decode step the same way: its model over its float16 cache, built, evaluated,
    sampled (``stream_generate`` overlaps building the next step with evaluating this one)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    # the context through the model's body alone: the head's logits for every position (all
    # but the last unused) took 18 s of the harness's CPU run for 96 tokens
    mx.eval(model.model(mx.array([[7] * context]), cache=cache), [c.state for c in cache])
    token = 7
    parts: dict[str, list[float]] = {"build": [], "eval": [], "sample": []}
    for _ in range(_anatomy_steps()):
        t0 = time.perf_counter()
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        token = int(mx.argmax(logits, axis=-1).item())
        t3 = time.perf_counter()
        for key, a, b in (("build", t0, t1), ("eval", t1, t2), ("sample", t2, t3)):
            parts[key].append(b - a)
    row = {"shape": shape, "arm": "mlx-lm-fp16", "measure": "step_anatomy", "context": context}
    row.update({f"{k}_ms": median_ms(v) for k, v in parts.items()})
    row["step_ms"] = round(sum(row[f"{k}_ms"] for k in parts), 3)
    return [row]


def _time(fn, repeats: int = 50) -> float:
    """Median microseconds of one evaluated call (after two warm-up calls)."""
    import mlx.core as mx

    for _ in range(2):
        mx.eval(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        samples.append(time.perf_counter() - start)
    return median_ms(samples) * 1000


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Bytes read and written per second by a device copy (x + 0 over ``nbytes``)."""
    import mlx.core as mx

    x = mx.zeros((nbytes // 2,), dtype=mx.float16)
    mx.eval(x)
    best = min(_time(lambda: x + 1, repeats=5) for _ in range(2))
    return 2 * nbytes / (best * 1e-6) / 1e9


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        import mlx.core as mx

        return str(mx.default_device())
