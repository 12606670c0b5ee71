"""The GPU backends (Metal, CUDA), on a machine where MLX sees one: the kernel bodies of
kernels/ through ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` against the reference,
and a turn of the engine on the GPU through them. Skipped where MLX has no GPU (CI, the Linux
CPU machines); there the same bodies run compiled for CPU (tests/kernels). On a GPU machine
``tests/model/test_architectures.py`` also runs on the GPU (hot == warm after a restart, a
batch == each agent alone, the KV read back == the KV saved); benchmarks/RESULTS.md records
each GPU run. ``AGENTKV_TEST_TOKENIZER`` names a folder with the embedded tokenizer's files
where the embedded model's package is not installed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    bits_equal,
    copy_tokenizer,
    dense_rows_both_ways,
    format_2_batch,
    jagged_batch,
    random_components,
    tiny_llama_dir,
)

from agentkv import Engine, kernels
from agentkv.format.quant import V1, KVQuant, hadamard
from agentkv.kernels import RowSource, attention
from agentkv.kernels import gpu as gpu_kernels

GPUS = [name for name in ("metal", "cuda") if name in kernels.available_backends()]
pytestmark = pytest.mark.skipif(not GPUS, reason="MLX sees no GPU here (Metal or CUDA)")


@pytest.fixture(params=GPUS)
def gpu(request):
    return request.param


def on(backend, fn):
    with kernels.use_backend(backend):
        return fn()


# (key bits, value bits, group), head dim, KV heads, agents' lengths
MOVES = [
    ((4, 4, 64), 64, 3, [0, 255, 256, 700]),
    ((4, 4, 32), 128, 1, [1, 513]),
    ((8, 8, 64), 256, 2, [300, 17, 64]),
    ((8, 4, 64), 64, 4, [40] * 8),
    ((4, 16, 64), 128, 2, [90, 1000]),
]


@pytest.mark.parametrize("fmt,dim,heads,lengths", MOVES)
def test_merge_and_extract_move_the_references_bits(gpu, fmt, dim, heads, lengths):
    comps = KVQuant(*fmt, **V1).components(heads, dim, dim)
    caches = [random_components(comps, 1, n + 37, seed=i) for i, n in enumerate(lengths)]
    used = max(lengths)
    sources = [RowSource(c, 0, 0, n) for c, n in zip(caches, lengths)]

    def merged():
        return kernels.merge(sources, used=used, capacity=used + 45)

    batch = on(gpu, merged)
    for a, b in zip(batch, on("reference", merged)):
        assert bits_equal(a, b)
    for row, n in enumerate(lengths):

        def extracted(row=row, n=n):
            return kernels.extract(batch, row=row, first=used - n, length=n, capacity=n + 3)

        ours = on(gpu, extracted)
        for a, b in zip(ours, on("reference", extracted)):
            assert bits_equal(a, b)
        assert bits_equal(ours[0][:, :, :n], caches[row][0][:, :, :n])


def reference(q, paged):
    """The reference in float32 on the CPU (a GPU's float32 matmul may round to TF32)."""
    with mx.stream(mx.cpu):
        out = kernels.reference.paged_attention(q, paged, scale=0.125)
        mx.eval(out)
    return out


def close(a, b, atol=3e-4):
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-3, atol=atol)


@pytest.mark.parametrize("fmt", [(4, 4, 64), (4, 4, 32), (8, 4, 64), (8, 8, 64), (2, 2, 32)])
@pytest.mark.parametrize(
    "lengths,queries,rep,window,sinks",
    [([700, 1, 256], 1, 1, 0, False), ([300, 40], 3, 3, 100, True), ([513, 17], 17, 2, 0, True)],
)
def test_paged_attention_body_agrees_with_the_reference(
    gpu, fmt, lengths, queries, rep, window, sinks
):
    lengths = [max(n, queries) for n in lengths]
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), lengths, queries=queries, q_heads=2 * rep)
    sink_values = mx.array(np.linspace(-1, 1, 2 * rep).astype(np.float32)) if sinks else None
    paged = paged._replace(window=window, sinks=sink_values)
    body = on(gpu, lambda: kernels.paged_attention_body(q, paged, scale=0.125))
    close(body, reference(q, paged))


@pytest.mark.parametrize("window,q_heads", [(0, 4), (100, 6)])
def test_paged_attention_body_reads_format_2_tails(gpu, window, q_heads):
    _, q, paged = format_2_batch(window, q_heads)
    body = on(gpu, lambda: kernels.paged_attention_body(q, paged, scale=0.125))
    close(body, reference(q, paged), atol=2e-3)


@pytest.mark.parametrize("dim,dtype", [(64, mx.float16), (128, mx.float32)])
def test_the_kernel_rotates_format_2_queries_and_output_inside_itself(gpu, dim, dtype):
    """``PagedQuery.rotate``: the kernel's own Walsh-Hadamard transforms (no operations
    around it) against MLX's transform around the kernel, over the 8K row's 128 parts too."""
    _, _, q, paged = jagged_batch(KVQuant(4, 4, 64, **V1), CONTEXTS, q_heads=6, dim=dim)
    q = q.astype(dtype)
    inside = paged._replace(rotate=True)
    assert inside.rotates_inside(q)
    body = on(gpu, lambda: kernels.paged_attention_body(q, inside, scale=0.125))
    around = on(
        gpu, lambda: hadamard(kernels.paged_attention_body(hadamard(q), paged, scale=0.125))
    )
    close(
        body.astype(mx.float32),
        around.astype(mx.float32),
        atol=3e-4 if dtype == mx.float32 else 3e-3,
    )


# The contexts the issue names (1, 5, 64, 1K, 8K) as one jagged batch, in every width
CONTEXTS = [1, 5, 64, 1024, 8192]


@pytest.mark.parametrize("fmt", [(4, 4, 64), (8, 4, 32), (2, 2, 32), (16, 16, 64), (4, 16, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_paged_attention_body_over_jagged_contexts(gpu, fmt, dtype):
    """Every row a different context, sinks, GQA of 3: pass 1 and the merge pass of the keys'
    parts (the 8K row takes 128 of them), in the engine's query dtypes."""
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), CONTEXTS, q_heads=6, heads=2, dim=128)
    sinks = mx.array(np.linspace(-1, 1, 6).astype(np.float32))
    paged = paged._replace(sinks=sinks)
    body = on(gpu, lambda: kernels.paged_attention_body(q.astype(dtype), paged, scale=0.125))
    assert body.dtype == dtype
    close(body.astype(mx.float32), reference(q, paged), atol=3e-4 if dtype == mx.float32 else 3e-3)


@pytest.mark.parametrize("window,splits", [(0, 3), (300, 0), (0, 1)])
def test_paged_attention_body_with_windows_and_forced_parts(gpu, window, splits):
    _, _, q, paged = jagged_batch(KVQuant(**V1), [1030, 7, 513], queries=5, q_heads=4)
    paged = paged._replace(window=window)
    launch = paged.launch(q, splits=splits)
    body = on(gpu, lambda: gpu_impl(gpu).paged_attention(q, paged, scale=0.125, launch=launch))
    close(body, reference(q, paged))


@pytest.mark.parametrize("ku", [1, 2, 4])
def test_paged_attention_body_with_every_count_of_keys_in_flight(gpu, ku):
    """KU (keys a team loads at once) on the GPU: each agrees with the reference over the
    issue's contexts, one part and many, and with KU = 1 within float rounding (the same
    operations in the same order; the compiler may contract them differently)."""
    _, _, q, paged = jagged_batch(KVQuant(**V1), CONTEXTS, q_heads=6, heads=2, dim=128)
    paged = paged._replace(sinks=mx.array(np.linspace(-1, 1, 6).astype(np.float32)))

    def run(launch):
        return on(gpu, lambda: gpu_impl(gpu).paged_attention(q, paged, scale=0.125, launch=launch))

    for splits in (1, 0):
        launch = paged.launch(q, splits=splits, keys_in_flight=ku)
        body = run(launch)
        close(body, reference(q, paged))
        close(body, run(launch._replace(keys_in_flight=1)), atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_the_body_and_the_dense_path_take_a_soft_cap_on_the_gpu(gpu, splits):
    """Gemma 2's soft cap (``PagedQuery.softcap``) in the kernel (one part, three) and in the
    dense prefill path, against the reference's cap."""
    from agentkv.kernels import dense

    queries = dense.DENSE_QUERIES + 1
    _, _, q, paged = jagged_batch(KVQuant(**V1), [1030, queries], queries=queries, q_heads=4)
    q, paged = q * 4.0, paged._replace(softcap=3.0)
    launch = paged.launch(q, splits=splits)
    body = on(gpu, lambda: gpu_impl(gpu).paged_attention(q, paged, scale=0.125, launch=launch))
    close(body, reference(q, paged))
    out = on(gpu, lambda: dense.paged_attention(q, paged, scale=0.125))
    close(out, reference(q, paged), atol=2e-3)


def test_paged_attention_body_gives_a_row_the_same_bits_alone_or_batched(gpu):
    """A row's parts of the keys depend on its own length: on the GPU too, batch == alone."""
    lengths = [8192, 40, 700, 1]
    _, _, q, paged = jagged_batch(KVQuant(**V1), lengths, q_heads=6)
    together = on(gpu, lambda: kernels.paged_attention_body(q, paged, scale=0.125))
    for b in range(len(lengths)):
        host = paged.host._replace(
            tables=paged.host.tables[b : b + 1], lengths=paged.host.lengths[b : b + 1]
        )
        alone = paged._replace(
            tables=paged.tables[b : b + 1], lengths=paged.lengths[b : b + 1], host=host
        )
        mine = on(
            gpu,
            lambda alone=alone, b=b: kernels.paged_attention_body(q[b : b + 1], alone, scale=0.125),
        )
        assert mx.array_equal(together[b : b + 1], mine)


@pytest.mark.parametrize("window", [0, 100])
def test_the_dense_prefill_path_on_the_gpu(gpu, window):
    """A prefill chunk's path (kernels/dense.py) through MLX's fused attention on the GPU."""
    from agentkv.kernels import dense

    queries = dense.DENSE_QUERIES + 4
    _, _, q, paged = jagged_batch(KVQuant(**V1), [1500, queries], queries=queries, q_heads=6)
    paged = paged._replace(window=window)
    out = dense.paged_attention(q.astype(mx.float16), paged, scale=0.125)
    close(out.astype(mx.float32), reference(q, paged), atol=3e-3)
    _, q2, paged2 = format_2_batch(window, new=queries)
    out2 = dense.paged_attention(q2, paged2, scale=0.125)
    close(out2, reference(q2, paged2), atol=2e-3)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.bfloat16])
@pytest.mark.parametrize("fmt", [(4, 4, 64), (8, 4, 32), (16, 16, 64)])
def test_dense_rows_gathers_what_the_operations_gather(gpu, fmt, dtype):
    """kernels/dense_rows.metal on the GPU (a prefill chunk's rows gathered and dequantized
    in one kernel) against the MLX operations it replaces, on the same GPU: within one step
    of the output type (CUDA may fuse q * scale + bias into one rounding), format 1 and
    format 2 with tails, rotated back or not; and the dense path through the kernel, as the
    engine runs it."""
    from agentkv.kernels import dense

    queries = dense.DENSE_QUERIES + 4
    _, _, q, paged = jagged_batch(KVQuant(*fmt, **V1), [1500, queries], queries=queries)
    _, q2, paged2 = format_2_batch(100, new=queries)
    rows = gpu_impl(gpu).dense_rows
    tol = {mx.float16: 1e-3, mx.bfloat16: 8e-3, mx.float32: 1e-5}[dtype]

    def on_gpu(*args):
        with kernels.use_backend(gpu):
            return rows(*args)

    for p in (paged, paged2, paged2._replace(rotate=True)):
        for got, want in dense_rows_both_ways(p, queries, on_gpu, dtype):
            for g, w in zip(got, want):
                assert g.dtype == dtype
                g = np.array(g.astype(mx.float32)).reshape(w.shape)
                np.testing.assert_allclose(g, np.array(w.astype(mx.float32)), rtol=tol, atol=tol)
    atol = 3e-3 if dtype == mx.float32 else 2e-2
    out = on(gpu, lambda: attention.paged_attention(q2.astype(dtype), paged2, scale=0.125))
    close(out.astype(mx.float32), reference(q2, paged2), atol=atol)
    rotated = paged2._replace(rotate=True)  # the rows rotated back inside the kernel
    out = on(gpu, lambda: attention.paged_attention(q2.astype(dtype), rotated, scale=0.125))
    close(out.astype(mx.float32), hadamard(reference(hadamard(q2), paged2)), atol=atol)


def gpu_impl(backend):
    from agentkv.kernels import gpu as gpu_module

    return gpu_module.for_backend(backend)


@pytest.mark.parametrize("dim,bits,group", [(64, 4, 64), (128, 4, 64), (128, 8, 32), (32, 2, 32)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32, mx.bfloat16])
def test_store_rows_stores_what_the_transform_and_mx_quantize_store(gpu, dim, bits, group, dtype):
    """kernels/store_rows.metal on the GPU (format 2's store of a step in one pass) against
    MLX's own transform and quantization on the same GPU: the keys within a float16 step,
    the values' codes the same but where a value lies on a rounding edge (the transforms may
    add in another order), their scales and biases within float16 rounding."""
    from agentkv.format.quant import V2

    rng = np.random.default_rng(dim + bits)
    keys, values = (mx.array(rng.standard_normal((3, 2, 37, dim)).astype(np.float32)).astype(dtype)
                    for _ in "kv")  # fmt: skip
    quant = KVQuant(4, bits, group, **V2)
    with kernels.use_backend("reference"):
        want = [np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a)
                for a in kernels.store_rows(keys, values, quant)]  # fmt: skip
    got = on(gpu, lambda: gpu_impl(gpu).store_rows(keys, values, bits, group))
    got = [np.array(a.astype(mx.float32) if a.dtype != mx.uint32 else a) for a in got]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-3)
    assert (got[1] == want[1]).mean() > 0.99
    np.testing.assert_allclose(got[2], want[2], rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(got[3], want[3], rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("traditional,normed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dim,q_heads,kv_heads,L", [(64, 3, 1, 1), (128, 4, 2, 7)])
def test_the_prologue_ropes_as_mx_fast_rope_and_stores_as_store_rows(
    gpu, dim, q_heads, kv_heads, L, traditional, normed
):
    """The store kernel's prologue on the GPU (docs/gpu-attention.md, "The prologue"): from a
    joint q/k/v projection (float16), the queries as MLX's RoPE ropes them on the same GPU
    (within float16 steps), and the keys and values as ``store_rows`` stores MLX-roped keys
    (the keys' tails within float16 steps, the values' words the same bits); ``normed``:
    each query and key head RMS-normed first, as ``mx.fast.rms_norm`` norms it (Qwen3's)."""
    from agentkv.format.quant import V2

    rng = np.random.default_rng(dim + L)
    B, base, starts = 2, 10000.0, [5, 2000]
    width = (q_heads + 2 * kv_heads) * dim
    joint = mx.array(rng.standard_normal((B, L, width)).astype(np.float32)).astype(mx.float16)
    inverse = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    table = mx.array(np.append(inverse, 1.0).astype(np.float32))
    mode = 2 if traditional else 1

    def heads(first, count):
        part = joint[..., first * dim : (first + count) * dim]
        return part.reshape(B, L, count, dim).transpose(0, 2, 1, 3)

    weights = mx.array(rng.uniform(0.2, 2.0, (2, dim)).astype(np.float16))
    norms = (weights.reshape(-1), 1e-6) if normed else None

    def roped(x, which):
        if normed:
            x = mx.fast.rms_norm(x, weights[which], 1e-6)
        return mx.concatenate([
            mx.fast.rope(x[b : b + 1], dim, traditional=traditional, base=base, scale=1.0,
                         offset=starts[b])
            for b in range(B)
        ])  # fmt: skip

    def run():
        impl = gpu_impl(gpu)
        keys, values = roped(heads(q_heads, kv_heads), 1), heads(q_heads + kv_heads, kv_heads)
        want = impl.store_rows(keys, values, 4, 64)
        got = impl.store_prologue(joint, (q_heads, kv_heads), mx.array(starts), table, mode, 4, 64,
                                  norms)  # fmt: skip
        return [roped(heads(0, q_heads), 0), *want], got

    (queries, *want), got = on(gpu, run)
    f32 = [np.array(a.astype(mx.float32)) for a in (queries, got[4], want[0], got[0])]
    np.testing.assert_allclose(f32[1], f32[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(f32[3], f32[2], rtol=2e-3, atol=2e-3)
    assert (np.array(got[1]) == np.array(want[1])).mean() > 0.99
    assert KVQuant(4, 4, 64, **V2).rotate


@pytest.mark.parametrize("dim,bits,ct", [(64, 4, 64), (128, 8, 64), (32, 2, 32), (256, 4, 32)])
def test_quantize_groups_stores_what_quantize_channels_stores(gpu, dim, bits, ct):
    """kernels/quantize_groups.metal on the GPU (a step's completed channel groups) against
    MLX's operations on the same GPU: the same biases (a minimum), the scales within float16
    rounding, the codes the same but where one lies on a rounding edge."""
    from agentkv.format.quant import quantize_channels

    rng = np.random.default_rng(dim + bits)
    keys = mx.array((rng.standard_normal((3, ct, dim)) * 2).astype(np.float16))

    def host(parts):
        parts = [a.reshape(-1, a.shape[-1]) for a in parts]
        return [np.array(a if a.dtype == mx.uint32 else a.astype(mx.float32)) for a in parts]

    want = host(quantize_channels(keys, bits, ct))
    got = host(on(gpu, lambda: gpu_impl(gpu).quantize_groups(keys, bits)))
    assert (got[0] == want[0]).mean() > 0.99
    np.testing.assert_allclose(got[1], want[1], rtol=2e-3, atol=1e-6)
    np.testing.assert_array_equal(got[2], want[2])


def test_an_engine_turn_runs_its_attention_through_the_gpu_body(tmp_path):
    """A cold turn, a hot one, a batch of two agents and a sampled turn on the GPU, the engine
    as a user makes it (its warm-up included): attention goes through the shared body (never
    the fused CPU kernel), and the hot turn continues the cold one."""
    model = tiny_llama_dir(tmp_path / "model")
    before = attention.paths_used()
    with Engine(model=str(model), cache_dir=tmp_path / "kv", pool_bytes=16 << 20) as eng:
        prompt = [{"role": "user", "content": "List the steps of a build, one per line."}]
        cold = eng.chat("a", prompt, max_tokens=8)
        follow = prompt + [
            {"role": "assistant", "content": cold.text},
            {"role": "user", "content": "And then?"},
        ]
        hot = eng.chat("a", follow, max_tokens=8)
        both = eng.chat_many([("a", follow), ("b", prompt)], max_tokens=4)
        sampled = eng.chat("c", prompt, max_tokens=4, temperature=0.8, top_p=0.9)
    used = {k: attention.paths_used()[k] - before[k] for k in before}
    assert cold.stats.cache == "cold" and hot.stats.cache == "hot"
    assert len(cold.tokens) == len(hot.tokens) == 8
    assert [len(r.tokens) for r in both] == [4, 4]
    assert len(sampled.tokens) == 4  # sampling (MLX's random state) on the scheduler's thread
    assert used[attention.FUSED] == 0 and used[attention.KERNEL] > 0
    assert gpu_kernels.kernels_on(), gpu_kernels.kernels_state()  # the warm-up's check passed


def test_the_pipelined_decode_loop_gives_the_tokens_of_steps_one_after_another(tmp_path):
    """On a GPU decode steps run pipelined (engine/scheduler.py): three agents batched, then
    each continued, give the tokens of the same turns with the pipeline off, across channel
    groups (70 tokens) and with turns ending at different lengths."""
    model = tiny_llama_dir(tmp_path / "model")
    prompts = ["One two three four", "The build failed because", "def main():\n"]
    results = {}
    for pipeline in (False, True):
        kv = tmp_path / f"kv-{pipeline}"
        with Engine(model=str(model), cache_dir=kv, pool_bytes=32 << 20, draft_tokens=0) as eng:
            assert eng.scheduler.pipeline  # the default on a GPU
            eng.scheduler.pipeline = pipeline
            before = eng.scheduler.ahead_steps
            turns = [(f"a{i}", p) for i, p in enumerate(prompts)]
            first = [eng.generate_many(turns[:1], max_tokens=70)[0]]
            first += eng.generate_many(turns[1:], max_tokens=33)
            again = eng.generate_many(
                [(a, p + r.text) for (a, p), r in zip(turns, first)], max_tokens=9
            )
            ahead = eng.scheduler.ahead_steps - before
        assert (ahead > 20) == pipeline
        results[pipeline] = [r.tokens for r in first + again]
    assert results[True] == results[False]


def test_a_float32_row_in_a_batch_gets_its_products_alone():
    """agentkv keeps MLX's float32 matmuls out of TF32 (``agentkv._numerics``): one row alone
    takes a full-precision GEMV and three rows a GEMM, so with TF32 the row's products moved by
    up to 7e-3 here (an H100, 2026-11-27) and float32 models batched other tokens than alone;
    in float32 they move by rounding alone (2.9e-6 there)."""
    mx.random.seed(0)
    rows, weight = mx.random.normal((3, 1, 64)), mx.random.normal((128, 64))
    alone, batched = (rows[:1] @ weight.T)[0], (rows @ weight.T)[0]
    assert np.abs(np.array(alone) - np.array(batched)).max() < 1e-4


@pytest.mark.parametrize("bits", [4, 5])
def test_k_quant_weights_with_float32_scales_run_on_the_gpu(tmp_path, bits):
    """What a GGUF's Q4_K and Q5_K tensors become in the model directory (4- and 5-bit codes in
    groups of 32, float32 scales and biases: docs/models.md; the CPU holds them in two levels,
    a GPU reads them as stored) runs on the GPU through ``mx.quantized_matmul``: the logits of
    the same model on MLX's CPU stream, and a turn of the engine."""
    import json

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from agentkv import mlx_adapter
    from agentkv.model.load import load_model

    root = tiny_llama_dir(tmp_path / "float")
    model, _ = mlx_adapter.load(str(root))  # mlx-lm's own layers, as a convert writes them
    nn.quantize(model, group_size=32, bits=bits)
    wide = (".scales", ".biases")
    params = {
        name: value.astype(mx.float32) if name.endswith(wide) else value
        for name, value in tree_flatten(model.parameters())
    }
    dest = tmp_path / "k-quant"
    dest.mkdir()
    mx.save_safetensors(str(dest / "model.safetensors"), params)
    config = json.loads((root / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": bits}
    (dest / "config.json").write_text(json.dumps(config))
    copy_tokenizer(dest)

    quantized = load_model(dest).model
    scales = [a for name, a in tree_flatten(quantized.parameters()) if name.endswith(".scales")]
    assert scales and all(a.dtype == mx.float32 for a in scales)  # joint projections' too
    tokens = mx.array([[1, 17, 305, 92, 4000, 12, 77]])
    got = np.array(quantized(tokens))
    with mx.stream(mx.cpu):
        want = np.array(quantized(tokens))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-2 * want.std()
    with Engine(model=str(dest), cache_dir=tmp_path / "kv", pool_bytes=16 << 20) as eng:
        reply = eng.chat("a", [{"role": "user", "content": "Name three colours."}], max_tokens=4)
    assert len(reply.tokens) == 4
