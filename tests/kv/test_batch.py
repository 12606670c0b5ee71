"""BatchQuantizedKVCache: mlx-lm's BatchGenerator batching agentkv Q4 caches, in format 1
(per-token keys) and format 2 (per-channel keys with each row's filling group in a
float16 tail)."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_same_cache, positional_caches, synthetic_spec
from mlx_lm.generate import BatchGenerator, generate_step

from agentkv import make_prompt_cache
from agentkv.format.quant import V1, V2, KVQuant
from agentkv.kv.batch import BatchQuantizedKVCache
from agentkv.kv.cache import AgentKVCache

FORMATS = [KVQuant(**V1), KVQuant(**V2)]
IDS = ["v1", "v2"]

CONTEXTS = [
    "The history of the harbour town begins with a fire. " * 12,
    "Once upon a time in a small village there lived a baker who",
    "Python is a programming language that " * 30,
    "Notes: ",
]
FOLLOW = [" Then", " and the bread", " It is used", " the meeting"]


@pytest.fixture(scope="module", params=[*FORMATS, None], ids=[*IDS, "engine's"])
def model_and_caches(engine, request):
    """Caches of the embedded model per context: every layer in one format, or (None) as
    ``make_prompt_cache`` makes them: the engine's format, 8-bit keys in its wide layers."""
    model, tok = engine.loaded.model, engine.loaded.tokenizer
    caches = []
    for text in CONTEXTS:
        if request.param is None:
            layer_caches = make_prompt_cache(engine.loaded)
            assert [c.quant for c in layer_caches] == [
                engine.quant.layer(i) for i in range(len(model.layers))
            ]
            wide = engine.quant.wide_layers[0]
            assert layer_caches[wide].quant.key_bits == 8 and layer_caches[0].quant.key_bits == 4
        else:
            layer_caches = [AgentKVCache(request.param) for _ in model.layers]
        model(mx.array([tok.encode(text)]), cache=layer_caches)
        mx.eval([c.components for c in layer_caches])
        caches.append(layer_caches)
    return model, tok, caches


def copies(layer_caches):
    return [AgentKVCache.from_state(c.state) for c in layer_caches]


def solo_tokens(model, tok, caches, follow, steps=32):
    ids = tok.encode(follow, add_special_tokens=False)
    stream = generate_step(mx.array(ids), model, prompt_cache=copies(caches), max_tokens=steps)
    return [int(t) for (t, _), _ in zip(stream, range(steps))]


@pytest.mark.parametrize(
    "agents", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_batch_generator_equals_each_agent_alone(model_and_caches, agents):
    model, tok, caches = model_and_caches
    assert len({c[0].offset for c in caches[:agents]}) == agents  # unequal lengths
    alone = [solo_tokens(model, tok, caches[i], FOLLOW[i]) for i in range(agents)]
    gen = BatchGenerator(model, max_tokens=32)
    uids = gen.insert(
        [tok.encode(f, add_special_tokens=False) for f in FOLLOW[:agents]],
        max_tokens=[32] * agents,
        caches=[copies(c) for c in caches[:agents]],
    )
    got = {u: [] for u in uids}
    for _ in range(32 * agents + 64):  # a bound: each row ends within its 32 tokens
        responses = gen.next_generated()
        if not responses:
            break
        for r in responses:
            got[r.uid].append(r.token)
    else:
        pytest.fail("the batch generator did not finish")
    assert [got[u] for u in uids] == alone


@pytest.mark.parametrize("quant", FORMATS, ids=IDS)
def test_the_batch_stays_quantized_and_rows_come_back_exactly(quant):
    spec = synthetic_spec(layers=1, heads=2)
    rows = [positional_caches(spec, n, quant)[0] for n in (300, 17, 0, 512)]
    batch = AgentKVCache.merge(rows)
    assert isinstance(batch, BatchQuantizedKVCache)
    assert [x.dtype for x in batch.keys] == [mx.uint32, mx.float16, mx.float16]
    assert batch.left_padding.tolist() == [212, 495, 512, 0]
    assert batch.offset.tolist() == [300, 17, 0, 512]
    for i, original in enumerate(rows):
        back = batch.extract(i)
        assert back.start == 0
        assert_same_cache(back, original)


@pytest.mark.parametrize("quant", FORMATS, ids=IDS)
def test_update_filter_extend_and_mask(quant):
    spec = synthetic_spec(layers=1, heads=2)
    a, b = (positional_caches(spec, n, quant)[0] for n in (40, 10))
    batch = BatchQuantizedKVCache.merge([a, b])
    mask = batch.make_mask(3)
    assert mask.shape == (2, 1, 3, 43)
    rows, cols = np.arange(3)[:, None] + 40, np.arange(43)[None, :]  # query i is row 40 + i
    want = [(cols <= rows) & (cols >= pad) for pad in (0, 30)]  # causal, past the padding
    assert np.array_equal(np.array(mask)[:, 0], np.stack(want))
    new = mx.random.normal((2, 2, 3, 64))
    keys, _ = batch.update_and_fetch(new, new)
    assert keys[0].shape[2] == 43 and batch.offset.tolist() == [43, 13]
    solos = [AgentKVCache.from_state(c.state) for c in (a, b)]
    for i, solo in enumerate(solos):
        solo.update_and_fetch(new[i : i + 1], new[i : i + 1])
        assert_same_cache(batch.extract(i), solo)
    batch.filter([1])  # the padding row 0 needed is dropped with it
    assert batch.left_padding.tolist() == [0] and batch.size() == 13
    assert_same_cache(batch.extract(0), solos[1])
    added = positional_caches(spec, 20, quant)[0]
    batch.extend(BatchQuantizedKVCache.merge([added]))
    assert batch.left_padding.tolist() == [7, 0] and batch.offset.tolist() == [13, 20]
    assert_same_cache(batch.extract(0), solos[1])
    assert_same_cache(batch.extract(1), added)


@pytest.mark.parametrize("quant", FORMATS, ids=IDS)
def test_state_round_trip_then_one_more_step_is_identical(quant):
    """Format 2: row 0's 34 keys (and row 1's last 7) are in the tails, not the key rows."""
    spec = synthetic_spec(layers=1, heads=2)
    rows = [positional_caches(spec, n, quant)[0] for n in (33, 70)]
    batch = AgentKVCache.merge(rows)
    clone = BatchQuantizedKVCache.from_state(batch.state)
    for i in range(2):
        assert_same_cache(clone.extract(i), batch.extract(i))
    step = mx.random.normal((2, 2, 1, 64))
    k1, v1 = batch.update_and_fetch(step, step)
    k2, v2 = clone.update_and_fetch(step, step)
    for x, y in zip((*k1, *v1), (*k2, *v2), strict=True):
        assert mx.array_equal(x, y)
    for i, row in enumerate(rows):
        alone = AgentKVCache.from_state(row.state)
        alone.update_and_fetch(step[i : i + 1], step[i : i + 1])
        assert_same_cache(clone.extract(i), batch.extract(i))
        assert_same_cache(batch.extract(i), alone)
    single = positional_caches(spec, 33, quant)[0]
    again = AgentKVCache.from_state(single.state)
    assert_same_cache(again, single)
    for cache in (single, again):
        cache.update_and_fetch(step[:1], step[:1])
    assert_same_cache(again, single)


@pytest.mark.parametrize("quant", FORMATS[1:], ids=IDS[1:])
def test_a_trim_into_a_group_leaves_each_row_as_its_cache_alone(quant):
    """Per-channel rows cut inside a quantized group get its kept keys back in their tails,
    and the next tokens complete the group with the same bits as each cache alone."""
    spec = synthetic_spec(layers=1, heads=2)
    rows = [positional_caches(spec, n, quant)[0] for n in (150, 90)]
    batch = AgentKVCache.merge(rows)
    assert batch.trim(30) == 30  # row 0: 150 -> 120, inside [64, 128); row 1: 90 -> 60
    new = mx.random.normal((2, 2, 10, 64))
    batch.update_and_fetch(new, new)
    for i, original in enumerate(rows):
        alone = AgentKVCache.from_state(original.state)
        alone.trim(30)
        alone.update_and_fetch(new[i : i + 1], new[i : i + 1])
        assert_same_cache(batch.extract(i), alone)
