"""Small builders shared by the unit tests (synthetic specs and caches)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from agentkv import _ext
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.format.quant import V1, KVQuant, native_layout
from agentkv.format.spec import LayerKind, LayerSpec, ModelCacheSpec
from agentkv.kernels import PagedQuery
from agentkv.kernels.types import HostIndex, as_units
from agentkv.kv.cache import AgentKVCache
from agentkv.pool.arena import WritePlan
from agentkv.store.format import encode_segment_header


def synthetic_spec(
    layers=2, heads=2, dim=64, windows=None, weights_id="synthetic"
) -> ModelCacheSpec:
    kinds = tuple(
        LayerSpec(LayerKind.SLIDING, w) if w else LayerSpec(LayerKind.FULL)
        for w in (windows or [None] * layers)
    )
    return ModelCacheSpec("synthetic", layers, heads, dim, dim, kinds, False, "float32", weights_id)


def filled_caches(spec: ModelCacheSpec, tokens: int, quant=None, seed=0) -> list[AgentKVCache]:
    """Caches holding ``tokens`` random tokens, fed in a few uneven chunks."""
    quant = quant or KVQuant(**V1)
    mx.random.seed(seed)
    caches = [AgentKVCache(quant, window=layer.window) for layer in spec.layers]
    done = 0
    for size in _chunks(tokens):
        for cache in caches:
            k = mx.random.normal((1, spec.kv_heads, size, spec.key_head_dim))
            v = mx.random.normal((1, spec.kv_heads, size, spec.value_head_dim))
            cache.update_and_fetch(k, v)
        done += size
    mx.eval([x for c in caches for x in c.components])
    return caches


def _chunks(n):
    sizes, left = [], n
    step = 197
    while left:
        sizes.append(min(step, left))
        left -= sizes[-1]
        step = 61 if step == 197 else 197
    return sizes


def text_for(tokens: int, seed=0) -> tuple[list[int], np.ndarray, bytes]:
    """Token ids, tiling spans and the text they cover (4 bytes per token)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=tokens).tolist()
    text = b"".join(f"{i:03d} ".encode() for i in ids)
    ends = np.arange(1, tokens + 1, dtype=np.int64) * 4
    spans = np.stack([ends - 4, ends], axis=1)
    return ids, spans, text


def held_arrays(cache: AgentKVCache) -> list[np.ndarray]:
    keys, values = cache.keys_and_values()
    return [np.array(x) for x in (*keys, *values)]


def assert_same_cache(got: AgentKVCache, want: AgentKVCache) -> None:
    """``got`` holds the tokens ``want`` holds, bit for bit: the same positions, every held
    row of every component, and in format 2 the float16 tail rows of the channel group still
    filling (where the newest keys are until their group completes)."""
    assert (got.offset, got.start, got.held) == (want.offset, want.start, want.held)
    if not want.held:
        return
    for x, y in zip(held_arrays(got), held_arrays(want), strict=True):
        assert np.array_equal(x, y)
    filling = want.offset % want.quant.channel_tokens if want.quant.channel_keys else 0
    if filling:
        assert np.array_equal(
            np.array(got.tail[..., :filling, :]), np.array(want.tail[..., :filling, :])
        )


def positional_caches(spec: ModelCacheSpec, tokens: int, quant=None) -> list[AgentKVCache]:
    """Caches whose token t depends only on t (so any prefix of any save is comparable)."""
    quant = quant or KVQuant(**V1)
    t = mx.arange(tokens, dtype=mx.float32)[None, None, :, None]
    h = mx.arange(spec.kv_heads, dtype=mx.float32)[None, :, None, None]
    d = mx.arange(spec.key_head_dim, dtype=mx.float32)[None, None, None, :]
    caches = []
    for layer_index, layer in enumerate(spec.layers):
        cache = AgentKVCache(quant, window=layer.window)
        keys = mx.sin(t * 0.37 + h * 1.1 + d * 0.05 + layer_index)
        values = mx.cos(t * 0.21 + h * 0.7 + d * 0.11 + layer_index)
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    mx.eval([x for c in caches for x in c.components])
    return caches


def text_for_count(tokens: int):
    """Like text_for, but token i is a function of i only."""
    ids = [(i * 7919) % 1000 for i in range(tokens)]
    text = b"".join(f"{i:03d} ".encode() for i in ids)
    ends = np.arange(1, tokens + 1, dtype=np.int64) * 4
    return ids, np.stack([ends - 4, ends], axis=1), text


# The fused CPU attention against float attention over the same dequantized KV. Where it
# runs in float (keys per token, per-channel keys of 8 bits or in a tail, values of 2 or 8
# bits or in groups of 32) it agrees within float32 rounding of sums of a few thousand terms:
FLOAT_ATOL = 3e-5
# Its integer paths take exact integer dots against int16 codes: 4-bit keys of complete
# channel groups against the folded query's codes, 4-bit values in groups of 64 against the
# codes of each tile's softmax weights, each set of codes scaled to its largest element. The
# codes' rounding (1 part in 2 * 32,512 of the largest) puts outputs up to ~1e-4 off on
# values of unit scale (docs/compute.md): far under what 4-bit values themselves are off
# (~1/30 of their range), over float rounding. Comparisons that run an integer path take:
FUSED_ATOL = 2e-4


def attention_atol(quant) -> float:
    """The tolerance of the fused CPU attention over ``quant``'s KV against float attention:
    FUSED_ATOL where one of its integer paths runs, else FLOAT_ATOL."""
    integer_values = quant.value_bits == 4 and quant.group_size == 64
    integer_keys = quant.channel_keys and quant.key_bits == 4
    return FUSED_ATOL if integer_values or integer_keys else FLOAT_ATOL


TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "scripts"
DATA = TESTS / "data"


# -- the block pool ---------------------------------------------------------------------


def pool_for(spec: ModelCacheSpec, quant=None, blocks: int = 24):
    """A small pool for ``spec`` (its arenas are committed only as blocks fill)."""
    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.pool import KVPool

    quant = quant or KVQuant(**V1)
    return KVPool(spec, quant, pool_bytes=spec.bytes_per_token(quant) * BLOCK_TOKENS * blocks)


def _kv_for(spec: ModelCacheSpec, layer: int, start: int, count: int, *, rng, positional: bool):
    shape_k = (1, spec.kv_heads, count, spec.key_head_dim)
    shape_v = (1, spec.kv_heads, count, spec.value_head_dim)
    if not positional:
        return (
            mx.array(rng.standard_normal(shape_k).astype(np.float32)),
            mx.array(rng.standard_normal(shape_v).astype(np.float32)),
        )
    t = mx.arange(start, start + count, dtype=mx.float32)[None, None, :, None]
    h = mx.arange(spec.kv_heads, dtype=mx.float32)[None, :, None, None]
    dk = mx.arange(spec.key_head_dim, dtype=mx.float32)[None, None, None, :]
    dv = mx.arange(spec.value_head_dim, dtype=mx.float32)[None, None, None, :]
    return (
        mx.sin(t * 0.37 + h * 1.1 + dk * 0.05 + layer),
        mx.cos(t * 0.21 + h * 0.7 + dv * 0.11 + layer),
    )


def fill_table(pool, tokens: int, *, seed=0, positional=False, ids=None, table=None):
    """A table holding ``tokens`` tokens (ids ``text_for``'s unless given) whose KV is random
    (or, ``positional``, a function of the token's position), written in uneven chunks
    through the same scatters the model's forward pass uses."""
    spec = pool.spec
    rng = np.random.default_rng(seed)
    ids = list(ids) if ids is not None else text_for(tokens, seed)[0]
    table = table or pool.new_table(pool.seed())
    arena = pool.arena
    for size in _chunks(tokens - table.length):
        start = table.length
        table.grow(size, arena.copy_rows)
        plan = WritePlan(arena, [table], [start], size)
        for layer in range(spec.num_layers):
            k, v = _kv_for(spec, layer, start, size, rng=rng, positional=positional)
            arena.append(layer, k, v, plan)
        arena.settle()
        table.written(ids[start : start + size])
    return table


def table_arrays(pool, table, tokens: int | None = None) -> list[np.ndarray]:
    """Every (layer, component) of the table's first ``tokens`` tokens as [heads, n, width]."""
    from agentkv.format.geometry import BLOCK_TOKENS

    n = table.length if tokens is None else tokens
    arena = pool.arena
    heads = pool.spec.kv_heads
    t = np.arange(n)
    blocks = np.asarray(table.blocks, dtype=np.int64)[t // BLOCK_TOKENS]
    rows = (blocks[None, :] * heads + np.arange(heads)[:, None]) * BLOCK_TOKENS + t % BLOCK_TOKENS
    out = []
    for layer in arena.arrays:
        for array in layer:
            out.append(
                np.array(mx.take(array, mx.array(rows.reshape(-1)), axis=0)).reshape(heads, n, -1)
            )
    return out


def held_kv(eng, agent: str, tokens: int) -> tuple[list[np.ndarray], int]:
    """The agent's KV in the pool for tokens [0, tokens), every (layer, component) as
    [heads, n, width]; and the first token its sliding layers still hold (the rows of the
    blocks before it were handed back when the window passed them)."""
    from agentkv.format.geometry import BLOCK_TOKENS

    table = eng.residency.get(agent).table
    arrays = table_arrays(eng.pool, table, tokens)
    arena = eng.pool.arena
    if arena.ct:  # format 2: the filling group's keys are the tail's, not the arena rows'
        full = tokens // arena.ct * arena.ct
        per_layer = len(arena.components[0])
        arrays = [
            a[:, :full] if i % per_layer < arena.key_parts else a for i, a in enumerate(arrays)
        ]
        arrays += list(arena.read_tail(table.tail, tokens - full))
    return arrays, table.window_from * BLOCK_TOKENS


def cache_arrays(caches: list[AgentKVCache]) -> list[np.ndarray]:
    """The same arrays from contiguous caches (``AgentStore.load_caches``)."""
    return [x[0] for c in caches for x in held_arrays(c)]


def tiny_llama_dir(root: Path, *, seed: int = 3, layers: int = 2) -> Path:
    """A tiny random-weight llama with the embedded model's tokenizer, as an mlx-lm directory."""
    import json

    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    root.mkdir(parents=True)
    mx.save_safetensors(str(root / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (root / "config.json").write_text(json.dumps(config))
    copy_tokenizer(root)
    return root


TOKENIZER_ENV = "AGENTKV_TEST_TOKENIZER"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(root: Path) -> None:
    """The embedded model's tokenizer files into the model directory ``root``: from
    ``$AGENTKV_TEST_TOKENIZER`` (a folder holding them) where set, as on a lent GPU machine
    that has no room for the embedded model's package, else from the embedded model."""
    import shutil

    if TOKENIZER_ENV in os.environ:
        source = Path(os.environ[TOKENIZER_ENV])
    else:
        from agentkv.model.load import ensure_embedded_model

        source = ensure_embedded_model()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, root / name)


def write_segment(path, pool, table, first_block, end_token, layout=0):
    """Pack blocks [first_block, blocks_for(end_token)) of ``table`` into a segment file,
    its regions in ``layout`` (0 planes, 1 groups; csrc/core/block_io.h)."""
    spec = pool.spec
    slots = table.blocks[first_block : -(-end_token // BLOCK_TOKENS)]
    counts = [
        min(BLOCK_TOKENS, end_token - (first_block + i) * BLOCK_TOKENS) for i in range(len(slots))
    ]
    packed, records = pool.arena.pack(slots, counts, [layout] * len(slots))
    header, blocks = encode_segment_header(
        agent_id="a",
        fingerprint=spec.fingerprint,
        generation=1,
        components=spec.components(pool.quant),
        first_block=first_block,
        packed=records,
    )
    path.write_bytes(header + packed.tobytes())
    refs = [(0, len(header) + off, ln, crc, t) for _, off, ln, crc, t in blocks]
    return (str(path), len(header) + packed.nbytes, _ext.crc32c(header[8:]), layout), refs


def gather_segments(spec, quant, segments, blocks, tokens, spans):
    comps = spec.components(quant)
    return _ext.gather_blocks(
        spec.num_layers,
        BLOCK_TOKENS,
        native_layout(comps),
        segments,
        blocks,
        tokens,
        spans,
    )


def save_agent(root: Path, pool, table, agent_id: str = "a"):
    """Save ``table`` (``text_for``'s text) as agent ``agent_id`` of a store of the pool's
    format under ``root``, as the engine's writer does; the store."""
    from agentkv.store.agent_store import AgentStore, DurableState, build_save_job

    _, spans, text = text_for(table.length)
    store = AgentStore(root, pool.spec, "synthetic", pool.quant)
    store.ensure_layout()
    job = build_save_job(
        pool.arena, table, agent_id=agent_id, keep=0, tokens=table.token_ids(), spans=spans,
        text=text, messages=None,
    )  # fmt: skip
    store.write(job, DurableState())
    return store


def disk_reads(files) -> None:
    """Drop the files from the page cache, so their next reads go to the storage. Whether
    KVSwap then counts them as reads from disk is RWF_NOWAIT's answer, which storage that
    serves a page while the call waits gives as "cached" (this project's VMs, now and then):
    a test that needs the read-ahead path pins it (``KVSwapSet.read_ahead_always``). No
    probe read here: a read of a dropped page starts the kernel's readahead, which brings
    the file back."""
    from agentkv.benchmarks.kvswap import drop_page_cache

    drop_page_cache(files)


# -- kernels ------------------------------------------------------------------------------


def random_components(comps, rows, capacity, seed):
    """Random bits for one layer: [rows, heads, capacity, width] per component."""
    rng = np.random.default_rng(seed)
    out = []
    for c in comps:
        bits = rng.integers(
            0,
            2**32 if c.dtype == "uint32" else 2**16,
            size=(rows, c.heads, capacity, c.width),
            dtype=np.uint64,
        )
        dtype = np.uint32 if c.dtype == "uint32" else np.uint16
        a = mx.array(bits.astype(dtype))
        out.append(a if c.dtype == "uint32" else mx.view(a, mx.float16))
    return tuple(out)


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(as_units(a), as_units(b))


def jagged_batch(quant, lengths, *, heads=2, q_heads=4, queries=1, seed=0, dim=64):
    spec = synthetic_spec(layers=1, heads=heads, dim=dim)
    pool = pool_for(spec, quant, blocks=sum(-(-n // BLOCK_TOKENS) for n in lengths) + 2)
    tables = [fill_table(pool, n, seed=seed + i) for i, n in enumerate(lengths)]
    width = max(len(t.blocks) for t in tables)
    table = np.full((len(tables), width), -1, dtype=np.int32)
    for b, t in enumerate(tables):
        table[b, : len(t.blocks)] = t.blocks
    rng = np.random.default_rng(seed + 100)
    q = mx.array(rng.standard_normal((len(lengths), q_heads, queries, dim)).astype(np.float32))
    paged = PagedQuery(
        pool.arena.keys(0),
        pool.arena.values(0),
        mx.array(table),
        mx.array(lengths, dtype=mx.int32),
        heads,
        BLOCK_TOKENS,
        quant.key_bits,
        quant.value_bits,
        quant.group_size,
        0,
        None,
        host=HostIndex(table, np.asarray(lengths, np.int32)),
    )
    return pool, tables, q, paged


def dense_rows_both_ways(paged, L: int, rows, dtype=mx.float32) -> list:
    """Each row's (keys, values) for a prefill chunk of ``L`` queries, by ``rows`` (a backend's
    ``dense_rows``: kernels/dense_rows.metal) and by MLX's operations, as kernels/dense.py
    takes them: [((keys, values), (want_keys, want_values))] a row."""
    from agentkv.kernels import dense

    pairs = []
    for b in range(len(paged.host.lengths)):
        n = int(paged.host.lengths[b])
        first = dense.first_key(paged, n, L)
        own = dense._own_groups(paged, b, n, L)
        src, count = dense._sources(paged, b, first, n, own)
        pairs.append(
            (rows(paged, src, count, dtype), dense._gathered(paged, b, first, n, own, dtype))
        )
    return pairs


def format_2_batch(window: int = 0, q_heads: int = 4, new: int = 3):
    """A jagged batch over format 2 tables with tails (300, 64, 127 and 5 tokens, each then
    given ``new`` ones through a pool step): (pool, queries [4, q_heads, new, 64], PagedQuery)."""
    from agentkv.format.quant import V2
    from agentkv.pool.step import PagedStep

    spec = synthetic_spec(layers=1, heads=2)
    pool = pool_for(spec, KVQuant(**V2))
    tables = [fill_table(pool, n, seed=i) for i, n in enumerate([300, 64, 127, 5])]
    for t in tables:
        t.grow(new, pool.arena.copy_rows)
    rng = np.random.default_rng(11)
    kv = mx.array(rng.standard_normal((2, 4, 2, new, 64)).astype(np.float32))
    q = mx.array(rng.standard_normal((4, q_heads, new, 64)).astype(np.float32))
    step = PagedStep(pool.arena, spec, tables, new)
    keys, values = step.caches[0].update_and_fetch(kv[0], kv[1])
    pool.arena.settle()
    paged = PagedQuery(
        tuple(keys), tuple(values), step.tables, step.lengths, 2, 256, 4, 4, 64, window, None,
        64, pool.arena.tails[0], step.plan.tail_slots, step.host,
    )  # fmt: skip
    return pool, q, paged
