"""kernels/store_rows.metal: KV format 2's store of a step's new keys and values in one pass
(the keys' and values' Walsh-Hadamard transforms and the values' quantization, three MLX
operations a layer on a GPU). The body compiled for the CPU (csrc/simt.h runs its lanes as a
loop) gives the bits of MLX's transform and ``mx.quantize`` (its GPU kernels' rule, which
MLX's CPU shares but at exact ties and groups wholly below zero);
kernels/quantize_groups.metal,
the completed channel groups' quantization, the bits of ``quantize_channels``; the arena's
GPU branch, run here with those builds, stores the bytes the operations store."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from helpers import fill_table, pool_for, synthetic_spec

from agentkv import _ext, kernels
from agentkv.errors import InvalidRequestError
from agentkv.format.quant import V1, V2, KVQuant, hadamard, quantize_channels
from agentkv.kernels import cpu
from agentkv.kernels import gpu as gpu_kernels
from agentkv.kernels.types import store_dims
from agentkv.pool import arena as arena_module
from agentkv.pool.step import PagedStep


def by_operations(keys, values, bits, group):
    dim = keys.shape[-1]
    w, s, b = mx.quantize(hadamard(values), group_size=group, bits=bits)
    flat = [a.reshape(-1, a.shape[-1]) for a in (w, s.astype(mx.float16), b.astype(mx.float16))]
    return [hadamard(keys).astype(mx.float16).reshape(-1, dim), *flat]


@pytest.mark.parametrize(
    "dim,bits,group,rows",
    [(64, 4, 64, 37), (64, 4, 32, 5), (128, 8, 64, 9), (32, 2, 32, 13), (256, 4, 64, 3),
     (64, 2, 64, 130), (128, 4, 128, 1)],
)  # fmt: skip
def test_the_body_gives_the_bits_of_the_transform_and_mx_quantize(dim, bits, group, rows):
    """Every head dim the lanes cover (8 channels a lane, 4 to 32 lanes), 2/4/8-bit values,
    groups spanning 4 to 16 lanes, row counts that leave a threadgroup's last teams idle; the
    values scaled so that groups straddle zero, sit above it and below it."""
    rng = np.random.default_rng(dim + bits + rows)
    keys = mx.array(rng.standard_normal((1, 2, rows, dim)).astype(np.float32))
    values = rng.standard_normal((1, 2, rows, dim)).astype(np.float32) * 3
    values[0, 0] += 4.0  # a head's values mostly positive, the other's around zero
    values[0, 1, :1] -= 9.0
    values = mx.array(values)
    got = cpu.store_rows(keys, values, bits, group)
    want = by_operations(keys, values, bits, group)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(g, w)
    quant = KVQuant(4, bits, group, **V2)
    with kernels.use_backend("reference"):
        for g, w in zip(kernels.store_rows(keys, values, quant), want):
            assert mx.array_equal(g, w)
    with kernels.use_backend("cpu"):
        for g, w in zip(kernels.store_rows(keys, values, quant), want):
            assert mx.array_equal(g, w)


def test_the_body_quantizes_by_mlx_gpu_rule_at_a_tie_and_below_zero():
    """A value exactly halfway between two codes: the body rounds half away from zero, as
    MLX's GPU quantization does (``round``: mlx/backend/cuda/quantized/affine_quantize.cu,
    Metal's ``affine_quantize``), so on a GPU the kernel and ``mx.quantize`` agree; MLX's CPU
    ``mx.quantize`` rounds half to even (``rint``) and takes the other code; and a group
    wholly below zero gets its range from 0 on a GPU, from its own maximum on the CPU. The
    values are
    halves: their transform and its inverse are exact in float32 (D = 64, 1 / sqrt(D) = 1/8),
    so the body quantizes exactly these rotated values."""
    rotated = np.zeros((1, 1, 1, 64), dtype=np.float32)
    rotated[..., 1], rotated[..., 2], rotated[..., 3] = 15.0, 8.5, 7.5
    values = hadamard(mx.array(rotated))  # H is its own inverse
    _, words, scales, biases = cpu.store_rows(values, values, 4, 64)
    assert scales.item() == -1.0 and biases.item() == 15.0  # code = round(15 - value)
    codes = [(int(np.array(words)[0, 0]) >> (4 * i)) & 15 for i in range(4)]
    assert codes == [15, 0, 7, 8]  # 6.5 -> 7 and 7.5 -> 8: half away from zero
    cpu_codes = np.array(mx.quantize(mx.array(rotated), group_size=64, bits=4)[0])[0, 0, 0, 0]
    assert [(int(cpu_codes) >> (4 * i)) & 15 for i in range(4)] == [15, 0, 6, 8]  # rint
    # a group below zero: the GPU's rule takes its range from 0 (scale 10 / 15), the CPU's
    # from its own largest value (-2.125: scale 7.875 / 15)
    below = -np.arange(1, 65, dtype=np.float32).reshape(1, 1, 1, 64) / 8 - 2
    values = hadamard(mx.array(below))
    _, _, scales, biases = cpu.store_rows(values, values, 4, 64)
    assert scales.item() == np.float16(10 / 15) and biases.item() == -10.0
    _, cpu_scales, _ = mx.quantize(mx.array(below), group_size=64, bits=4)
    assert abs(cpu_scales.item() - 10 / 19) < 1e-6  # q0 = rint(-10 / 0.525) = -19


@pytest.mark.parametrize(
    "dim,bits,ct,groups", [(64, 4, 64, 3), (64, 4, 32, 2), (128, 8, 64, 1), (32, 2, 32, 5),
                           (256, 4, 64, 2), (128, 2, 64, 1), (256, 8, 32, 1)]
)  # fmt: skip
def test_the_groups_body_gives_the_bits_of_quantize_channels(dim, bits, ct, groups):
    """kernels/quantize_groups.metal (a step's completed channel groups quantized per
    channel, about 14 MLX operations a layer) gives the words, scales and biases of
    ``quantize_channels``: every head dim, 2/4/8 bits, groups of 32 and 64 tokens; a channel
    that never changes (scale 0), channels all above or below zero, codes on ties."""
    rng = np.random.default_rng(dim + bits + ct)
    x = (rng.standard_normal((groups, ct, dim)) * 2).astype(np.float16)
    x[0, :, 0] = 1.5  # a constant channel: scale 0, every code 0
    x[:, :, 1] += 6  # above zero
    x[:, :, 2] -= 6  # below
    levels = (1 << bits) - 1
    x[0, :, 3] = (np.arange(ct) % (levels + 1)) * 0.5  # codes on exact (and tied) steps
    keys = mx.array(x)
    got = cpu.quantize_groups(keys, bits)
    want = [a.reshape(-1, a.shape[-1]) for a in quantize_channels(keys, bits, ct)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(g, w)
    assert gpu_kernels.quantizes_groups(KVQuant(bits, 4, 32, **V2, channel_tokens=ct), dim)


def _stored_as(got, want, queries) -> np.ndarray:
    """The prologue's outputs ``got`` against the plain store's ``want`` of the reference's
    keys and values and the reference's ``queries`` [B, Hq, L, D]: the values' words,
    scales and biases the same bits, the keys' tails and the queries within float16 steps
    (the reference rounds between its operations). Returns the queries, as NumPy."""
    for g, w in zip(got[1:4], want[1:4]):
        assert mx.array_equal(g, w)
    tails = np.array(got[0], np.float32) - np.array(want[0], np.float32)
    assert np.abs(tails).max() <= 4e-3 * np.abs(np.array(want[0], np.float32)).max()
    q = np.array(got[4]).reshape(queries.shape)
    assert np.abs(q - np.array(queries, np.float32)).max() <= 4e-3 * np.abs(q).max()
    return q


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dim,q_heads,kv_heads,L", [(64, 3, 1, 1), (128, 4, 2, 5), (32, 2, 2, 3)])
def test_the_prologue_ropes_and_stores_from_the_joint_projection(dim, q_heads, kv_heads, L,
                                                                 traditional):  # fmt: skip
    """The prologue mode reads a joint q/k/v projection's rows [B, L, (Hq + 2 Hkv) D] where
    the matmul left them: the queries come back roped as ``mx.fast.rope`` ropes them (each row
    at its own start, a scale on the positions), and the keys and values are stored as the
    plain mode stores mx.fast.rope's keys (the values' words, scales and biases the same
    bits; the keys' tail rows within float16 rounding: the reference rounds the roped keys
    to float16 before the transform)."""
    rng = np.random.default_rng(dim + L)
    B, base, scale, starts = 2, 10000.0, 0.5, [7, 3000]
    joint = mx.array(rng.standard_normal((B, L, (q_heads + 2 * kv_heads) * dim)) * 2, mx.float16)
    inverse = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    rope = mx.array(np.append(inverse, scale).astype(np.float32))
    dims = store_dims(B * kv_heads * L, dim, 4, 32, prologue=(L, kv_heads, q_heads),
                      rope_mode=2 if traditional else 1)  # fmt: skip
    got = _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), rope, rope)

    def heads(first, count):
        part = joint[..., first * dim : (first + count) * dim]
        return part.reshape(B, L, count, dim).transpose(0, 2, 1, 3)

    def roped(x):
        return mx.concatenate([
            mx.fast.rope(x[b : b + 1], dim, traditional=traditional, base=base, scale=scale,
                         offset=starts[b])
            for b in range(B)
        ])  # fmt: skip

    queries, keys = roped(heads(0, q_heads)), roped(heads(q_heads, kv_heads))
    values = heads(q_heads + kv_heads, kv_heads)
    want = cpu.store_rows(keys, values, 4, 32)
    q = _stored_as(got, want, queries)
    # a mutation the check sees: the positions' scale left out
    wrong = mx.array(np.append(inverse, 1.0).astype(np.float32))
    bad = _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), wrong, wrong)
    assert np.abs(np.array(bad[4]).reshape(q.shape) - q).max() > 0.1


@pytest.mark.parametrize("dim,q_heads,kv_heads,L", [(128, 4, 2, 1), (64, 3, 1, 4)])
def test_the_prologue_norms_each_head_before_rope(dim, q_heads, kv_heads, L):
    """Qwen3's prologue (dims[18]): each query and key head RMS-normed by its own weights
    before RoPE, as ``mx.fast.rms_norm`` then ``mx.fast.rope`` give them (within float16
    steps: the reference rounds to float16 between them); the values untouched by the norm
    (the same bits as the plain store's)."""
    rng = np.random.default_rng(dim + q_heads)
    B, base, eps, starts = 2, 1_000_000.0, 1e-6, [5, 2000]
    joint = mx.array(rng.standard_normal((B, L, (q_heads + 2 * kv_heads) * dim)) * 3, mx.float16)
    inverse = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    rope = mx.array(np.append(inverse, 1.0).astype(np.float32))
    weights = rng.uniform(0.2, 2.0, (2, dim)).astype(np.float16)
    norm = mx.array(weights.reshape(-1))
    dims = store_dims(B * kv_heads * L, dim, 4, 32, prologue=(L, kv_heads, q_heads),
                      rope_mode=1, norm=True)  # fmt: skip
    got = _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), rope, norm, eps)

    def heads(first, count):
        part = joint[..., first * dim : (first + count) * dim]
        return part.reshape(B, L, count, dim).transpose(0, 2, 1, 3)

    def normed_roped(x, weight):
        x = mx.fast.rms_norm(x, mx.array(weight), eps)
        return mx.concatenate([
            mx.fast.rope(x[b : b + 1], dim, traditional=False, base=base, scale=1.0,
                         offset=starts[b])
            for b in range(B)
        ])  # fmt: skip

    queries = normed_roped(heads(0, q_heads), weights[0])
    keys = normed_roped(heads(q_heads, kv_heads), weights[1])
    want = cpu.store_rows(keys, heads(q_heads + kv_heads, kv_heads), 4, 32)
    q = _stored_as(got, want, queries)
    # mutations the check sees: the two weights swapped, the norm left out
    swapped = mx.array(weights[::-1].reshape(-1))
    bad = _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), rope, swapped,
                                 eps)  # fmt: skip
    assert np.abs(np.array(bad[4]).reshape(q.shape) - q).max() > 0.1
    plain = store_dims(B * kv_heads * L, dim, 4, 32, prologue=(L, kv_heads, q_heads), rope_mode=1)
    bad = _ext.kernel_store_rows(joint, joint, joint, list(plain), mx.array(starts), rope, norm)
    assert np.abs(np.array(bad[4]).reshape(q.shape) - q).max() > 0.1
    # refused: a norm without its weights or its epsilon, a norm without RoPE
    with pytest.raises(ValueError, match="norm"):
        _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), rope, norm[:dim],
                               eps)  # fmt: skip
    with pytest.raises(ValueError, match="norm"):
        _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array(starts), rope, norm)
    with pytest.raises(ValueError, match="bad dims"):
        _ext.kernel_store_rows(joint, joint, joint, list(dims[:17]) + [0, 1], mx.array(starts),
                               rope, norm, eps)  # fmt: skip


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_the_gpu_store_hands_mlx_a_call_for_every_activation_dtype(dtype, monkeypatch):
    """``gpu.store_rows`` and ``gpu.store_prologue`` build their kernel call for a model's
    every activation dtype (bfloat16 has no NumPy dtype to make a placeholder from); the call
    itself recorded here, as no GPU runs it."""
    calls = []

    def kernel(backend, name, sources=0):
        def run(*, inputs, output_shapes, output_dtypes, **_):
            calls.append([a.dtype for a in inputs])
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return run

    monkeypatch.setattr(gpu_kernels, "_kernel", kernel)
    keys = mx.zeros((1, 2, 3, 64), dtype)
    stored = gpu_kernels.store_rows("cuda", keys, keys, 4, 64)
    assert [a.shape for a in stored] == [(6, 64), (6, 8), (6, 1), (6, 1)]
    joint = mx.zeros((2, 3, (3 + 2) * 64), dtype)
    *_, queries = gpu_kernels.store_prologue("cuda", joint, (3, 1), mx.zeros(2, mx.int32),
                                             mx.zeros(33), 1, 4, 64)  # fmt: skip
    assert queries.shape == (2, 3, 3, 64) and queries.dtype == dtype
    assert [c[:3] for c in calls] == [[dtype] * 3] * 2
    with pytest.raises(ValueError, match="mode 1 or 2"):
        gpu_kernels.store_prologue("cuda", joint, (3, 1), mx.zeros(2, mx.int32), mx.zeros(33), 0,
                                   4, 64)  # fmt: skip


def test_what_the_kernel_cannot_store_is_refused(monkeypatch):
    keys = mx.zeros((1, 2, 3, 64))
    assert gpu_kernels.stores_rows(KVQuant(**V2), keys, keys)
    monkeypatch.setenv(gpu_kernels.STORE_ENV, "0")  # MLX's operations instead
    assert not gpu_kernels.stores_rows(KVQuant(**V2), keys, keys)
    monkeypatch.delenv(gpu_kernels.STORE_ENV)
    with pytest.raises(InvalidRequestError, match="not a format"):
        kernels.store_rows(keys, keys, KVQuant(**V1))  # format 1: keys quantized per token
    with pytest.raises(InvalidRequestError, match="not a format"):
        kernels.store_rows(keys[..., :48], keys[..., :48], KVQuant(**V2))  # 6 channels a lane
    assert not gpu_kernels.stores_rows(KVQuant(4, 16, 64, **V2), keys, keys)  # float values
    none = mx.zeros((1,))
    with pytest.raises(ValueError, match="bad dims"):  # 3-bit values
        _ext.kernel_store_rows(keys, keys, none, list(store_dims(6, 64, 3, 64)), none, none, none)
    with pytest.raises(ValueError, match="outside its array"):  # 7 rows of 6
        _ext.kernel_store_rows(keys, keys, none, list(store_dims(7, 64, 4, 64)), none, none, none)
    joint = mx.zeros((2, 3, (4 + 2 * 2) * 64))
    dims = store_dims(2 * 2 * 3, 64, 4, 64, prologue=(3, 2, 4), rope_mode=1)
    with pytest.raises(ValueError, match="outside its array"):  # one row too few
        _ext.kernel_store_rows(joint[:, :2], joint, joint, list(dims), none, mx.zeros(33), none)
    with pytest.raises(ValueError, match="RoPE needs"):  # one start for two rows
        _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.zeros(1), mx.zeros(33), none)
    with pytest.raises(ValueError, match="bad dims"):  # 70 rows: not whole groups of 64
        _ext.kernel_quantize_groups(mx.zeros((70, 64), dtype=mx.float16), 4, 64)
    monkeypatch.setenv(gpu_kernels.STORE_ENV, "0")
    assert not gpu_kernels.quantizes_groups(KVQuant(**V2), 64)
    monkeypatch.delenv(gpu_kernels.STORE_ENV)
    assert not gpu_kernels.quantizes_groups(KVQuant(**V1), 64)  # per-token keys


@pytest.mark.parametrize("count", [1, 70])
def test_the_arena_stores_the_same_bytes_through_the_kernel(monkeypatch, count):
    """``KVArena.append`` on a GPU stores through the kernel (here its CPU build standing in
    for Metal's or CUDA's): a decode step and a step completing a channel group store the
    same arena rows, tails and completed groups as the operations do."""

    def stored(fused: bool):
        spec = synthetic_spec(layers=1, heads=2)
        pool = pool_for(spec, KVQuant(**V2))
        tables = [fill_table(pool, n, seed=i) for i, n in enumerate([100, 5])]
        for t in tables:
            t.grow(count, pool.arena.copy_rows)
        rng = np.random.default_rng(5)
        k, v = (mx.array(rng.standard_normal((2, 2, count, 64)).astype(np.float32)) for _ in "kv")
        if fused:  # the step looks its backend up once, as it is made
            monkeypatch.setattr(arena_module.dispatch, "backend", lambda: "cuda")
            monkeypatch.setattr(arena_module.gpu_kernels, "for_backend",
                                lambda name: through)  # fmt: skip
        try:
            step = PagedStep(pool.arena, spec, tables, count, fused=False)
            step.caches[0].update_and_fetch(k, v)
        finally:
            monkeypatch.undo()
        pool.arena.settle()
        arena, out = pool.arena, []
        for t in tables:  # what each table holds: its complete groups' keys, every value
            n = t.length + count
            full = n // arena.ct * arena.ct
            keys = mx.array(arena.write_rows([t.blocks], [0], full))
            values = mx.array(arena.write_rows([t.blocks], [0], n))
            out += [a[keys] for a in arena.keys(0)] + [a[values] for a in arena.values(0)]
            out.append(mx.array(arena.read_tail(t.tail, n - full)))
        done = step.plan.done.get(0)
        return out + ([] if done is None else [done])

    calls = []
    through = SimpleNamespace(  # the kernels' CPU builds, counted
        store_rows=lambda *a: calls.append("store") or cpu.store_rows(*a),
        quantize_groups=lambda *a: calls.append("groups") or cpu.quantize_groups(*a),
    )
    ops, fused = stored(False), stored(True)
    assert calls == (["store", "groups"] if count == 70 else ["store"])
    assert len(ops) == len(fused) == (15 if count == 70 else 14)
    assert all(a.shape == b.shape for a, b in zip(ops, fused))
    assert sum(a.size for a in ops[-1 if count == 70 else 0 :]) > 0  # the step's groups
    for a, b in zip(ops, fused):
        assert mx.array_equal(a, b)


def test_a_gpu_compilers_refusal_is_told_with_the_way_around():
    """``gpu.compile_failure``: MLX's reports of a kernel a GPU's compiler refused or could not
    launch (Metal's and CUDA's wording) become a message naming ``AGENTKV_GPU_KERNELS=0``;
    any other error is left alone."""
    for said in (
        "[metal::Device] Unable to build metal library from source\nerror: no member 'x'",
        "Failed to compile kernel: agentkv_paged_attention(12): error: expected a ';'.",
        "Thread group size (128) is greater than  the maximum allowed threads (96).",
    ):
        told = gpu_kernels.compile_failure(RuntimeError(said))
        assert "AGENTKV_GPU_KERNELS=0" in told and said.strip()[:40] in told
    assert gpu_kernels.compile_failure(RuntimeError("[malloc] out of memory")) is None
    assert gpu_kernels.compile_failure(ValueError("Unable to build metal library")) is None
