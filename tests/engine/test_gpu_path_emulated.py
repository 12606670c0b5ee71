"""The engine's whole GPU path, run on the CPU (tests/gpu_emulation.py): every GPU-only branch
(the paged kernel and its merge pass, the dense prefill path and its gathering kernel, the
store and group kernels, arenas read through staging copies, the pipelined decode loop, the
joint projections), with the kernels' real bodies run by their CPU builds, on the real
model, turn after turn, in a batch and after a restart: with float16 KV against the CPU
engine (the same tokens but at near ties, log-probabilities within 0.05 nats); with 4-bit KV
against itself (each agent batched gets the tokens it gets alone and restarted).

A GPU's own compiler, speed and memory are not here (tests/gpu, ``bench gpu``); what is, is
every input and launch ``kernels/gpu.py`` hands MLX and every branch around them, which
otherwise only a lent GPU would run."""

import gc
import weakref

import mlx.core as mx
import pytest
from gpu_emulation import CALLS, PROLOGUES, RUNS, emulated_gpu

from agentkv import Engine
from agentkv.mlx_adapter import JointLinear

PROMPTS = ["def fibonacci(n):\n    ", "A recipe for bread: first, mix"]
MORE = " Now write three more sentences about the same subject, in plain words, for a child."
POOL = 48 << 20  # arenas the emulation copies whole at a scatter: kept small


@pytest.fixture
def engines():
    """``make(**options)``: an Engine with a small pool, closed at the end if still open.
    Unlike ``fresh_engine`` it keeps no closed engine alive: with the emulation's float32
    weights (~0.6 GiB a model) the suite's resident peak would grow by each."""
    opened = []

    def make(**options):
        engine = Engine(pool_bytes=POOL, **options)
        opened.append(weakref.ref(engine))
        return engine

    yield make
    for ref in opened:
        if (engine := ref()) is not None:
            engine.close()


def let_go(engine) -> None:
    """Close ``engine``; the caller holds the last reference, and drops it."""
    engine.close()
    gc.collect()
    mx.clear_cache()


def conversation(engine, tag, first_tokens, restart=None, alone=False, replies=None, **options):
    """Two agents' first turns (``first_tokens`` each), a hot second turn each of a few
    tokens (the paged kernel over several queries), then one of more (a prefill chunk over
    stored blocks); as a batch, or each agent ``alone``, one turn after another;
    ``restart()`` -> a new engine after the first turns (the old one closed first), reading
    the agents back from disk; ``replies``: another run's, to build the next turns' prompts
    from (so that both runs see the same prompts). Every turn's ChatResult, and the engine at
    the end."""
    turns = [(f"{tag}-{i}", p) for i, p in enumerate(PROMPTS)]
    results = []

    def run(turns, max_tokens):
        if alone:
            out = [engine.generate(a, p, max_tokens=max_tokens, **options) for a, p in turns]
        else:
            out = engine.generate_many(turns, max_tokens=max_tokens, **options)
        results.extend(out)
        texts = [r.text for r in out] if replies is None else replies[len(results) - len(PROMPTS) :]
        return [(a, p + text) for (a, p), text in zip(turns, texts)]

    said = run(turns, first_tokens)
    if restart is not None:
        let_go(engine)
        engine = restart()
    said = run([(a, p + " And") for a, p in said], 12)
    run([(a, p + MORE) for a, p in said], 16)
    return results, engine


def emulated_engine(engines, monkeypatch, **options):
    emulated_gpu(monkeypatch)
    engine = engines(**options)
    assert engine.runner.draft_tokens == 0 and engine.scheduler.pipeline
    # a GPU's model: each block's q/k/v and gate/up projections one matmul each
    joints = [m for _, m in engine.loaded.model.named_modules() if isinstance(m, JointLinear)]
    assert len(joints) == 2 * engine.spec.num_layers
    return engine


def agree(want, got, tolerance: float) -> int:
    """How many tokens two runs of one turn agree on, after checking that each of them has
    log-probabilities within ``tolerance`` in both, and that where they part the two tokens
    were within ``tolerance`` of each other (a near tie that rounding may turn either way)."""
    for j, (a, b) in enumerate(zip(want.tokens, got.tokens)):
        mine = {t.token: t.logprob for t in want.logprobs[j].top}
        theirs = {t.token: t.logprob for t in got.logprobs[j].top}
        if a != b:
            assert mine[a] - mine.get(b, -99.0) < tolerance, (j, mine, theirs)
            return j
        assert abs(mine[a] - theirs[a]) < tolerance, (j, mine, theirs)
    return len(want.tokens)


def test_with_float16_kv_the_gpu_path_gives_the_cpu_engines_tokens(engines, monkeypatch, tmp_path):
    """``kv_bits=16``: both read the same keys, so the GPU path gives the CPU engine's
    tokens, every log-probability within 0.05 nats (they differ by float rounding, ~0.01),
    parting only at a near tie; turn after turn, in a batch, and after a restart that reads
    the agents back (on a GPU: staging copies into the arenas, not the CPU's lazy reads)."""
    runs = {}
    for where in ("cpu", "gpu"):
        options = {"cache_dir": tmp_path / where, "kv_bits": 16}
        if where == "gpu":
            engine = emulated_engine(engines, monkeypatch, **options)
        else:  # the weights in float32, as the emulation's (tests/gpu_emulation.py)
            options["weights"] = "float32"
            engine = engines(**options)

        CALLS.clear()
        replies = [r.text for r in runs["cpu"]] if runs else None
        restart = lambda options=options: engines(**options)  # noqa: E731
        runs[where], engine = conversation(engine, "a", 40, restart, replies=replies, logprobs=3)
        let_go(engine)
        del engine
    agreed = [agree(w, g, 0.05) for w, g in zip(runs["cpu"], runs["gpu"])]
    assert sum(agreed) > 0.8 * sum(len(r.tokens) for r in runs["cpu"]), agreed
    caches = [r.stats.cache for r in runs["gpu"]]
    assert caches == ["cold", "cold", "warm", "warm", "hot", "hot"]  # read back once, then held
    assert CALLS["paged_attention"] and CALLS["paged_attention_merge"] and CALLS["dense_rows"]


def test_with_4_bit_kv_the_gpu_path_gives_each_agent_its_bits_batched_or_alone(
    engines, monkeypatch, tmp_path, caplog
):
    """The default format (4-bit, per-channel keys, rotated; a wide layer's 8-bit keys). A
    quantized key's codes depend on the model's last float before it, and the CPU engine's
    matmuls give other floats (logits 0.04-0.7 nats apart at 4 bits), so the GPU path is
    held to itself: two agents batched turn after turn give each the tokens it gets alone
    and restarted after its first turn (its blocks read back from disk), past a channel
    group's end (the group kernel), through the store, gathering, paged and merge kernels.
    The first engine's warm-up checks the kernels against MLX's operations
    (``engine/warmup.py``): they pass, well within the tolerance, and keep running."""
    from agentkv.engine import warmup
    from agentkv.kernels import gpu

    monkeypatch.setattr(gpu, "_refused", None)  # put back as it was at the end
    monkeypatch.setattr(warmup, "_agreed", set())
    options = {"kv_wide_layers": (0,)}
    with caplog.at_level("INFO", logger="agentkv.engine"):
        engine = emulated_engine(engines, monkeypatch, cache_dir=tmp_path / "b", **options)
    said = [r.getMessage() for r in caplog.records if "kernels within" in r.getMessage()]
    assert len(said) == 1 and gpu.kernels_on(), said
    apart = float(said[0].split("within ")[1].split()[0])
    assert apart < 0.1 * warmup.tolerance(engine.quant), said
    CALLS.clear()
    PROLOGUES.clear()
    batched, engine = conversation(engine, "k", 70)
    let_go(engine)
    ran = sorted(CALLS)
    # every layer's store took its queries and keys from the joint projection and roped them
    assert PROLOGUES["store_rows"] == CALLS["store_rows"] > 0

    def restart():
        return engines(cache_dir=tmp_path / "a", **options)

    alone, engine = conversation(restart(), "k", 70, restart, alone=True)
    assert [r.tokens for r in alone] == [r.tokens for r in batched]
    assert [r.stats.cache for r in alone] == ["cold", "cold", "warm", "warm", "hot", "hot"]
    assert ran == sorted(RUNS)  # every kernel the GPU path has


def test_the_prologue_kernel_gives_the_tokens_of_mlx_lm_s_rope_and_store(
    engines, monkeypatch, tmp_path
):
    """Format 2 (here with 8-bit keys and values) ropes each layer's queries and keys inside
    the store kernel, read from the joint q/k/v projection
    (``PagedLayerCache.agentkv_prologue``). Against the same engine with
    ``AGENTKV_GPU_PROLOGUE=0`` (mlx-lm's RoPE, then the store kernel): the same greedy tokens,
    the log-probabilities within 0.02 nats. The two RoPEs' angles differ by float32 rounding
    (queries ~2e-5 apart relative), which moves a few quantized codes: 4-bit codes move
    enough to part the runs by up to 0.06 nats, so 8-bit holds the check tight. A turn of 48
    tokens and a hot one after it."""
    runs = {}
    for prologue in ("0", "1"):
        monkeypatch.setenv("AGENTKV_GPU_PROLOGUE", prologue)
        engine = emulated_engine(engines, monkeypatch, cache_dir=tmp_path / prologue, kv_bits=8)
        PROLOGUES.clear()
        first = engine.generate("p", PROMPTS[0], max_tokens=48, logprobs=3)
        again = engine.generate("p", PROMPTS[0] + first.text + MORE, max_tokens=8, logprobs=3)
        runs[prologue] = [first, again]
        assert (PROLOGUES["store_rows"] > 0) is (prologue == "1")
        let_go(engine)
        del engine
    for want, got in zip(runs["0"], runs["1"]):
        assert agree(want, got, 0.02) == len(want.tokens)
    assert runs["1"][1].stats.cache == "hot"


@pytest.mark.parametrize("shape", ["tiny-qwen3", "tiny-gemma3"])
def test_qwen3_and_gemma3_norm_each_head_inside_the_prologue(engines, monkeypatch, tmp_path, shape):
    """Qwen3's and Gemma 3's attention norm each query and key head (``q_norm``, ``k_norm``)
    before RoPE; on a GPU the store kernel's prologue does both (``mlx_adapter.head_norms``).
    A random-weight model (``bench gpu``'s ``tiny-qwen3``, ``tiny-gemma3``: Gemma's norm by
    1 + weight, a sliding layer, its own attention scale) with 8-bit KV, against the same
    engine with ``AGENTKV_GPU_PROLOGUE=0`` (mlx-lm's norms and RoPE, then the store kernel):
    the same greedy tokens but at a near tie, log-probabilities within 0.02 nats, a turn and
    a hot one after it."""
    from agentkv.benchmarks import gpu as bench_gpu

    path = bench_gpu.build_model(shape, tmp_path, bench_gpu.tokenizer_dir(None))
    runs = {}
    for prologue in ("0", "1"):
        monkeypatch.setenv("AGENTKV_GPU_PROLOGUE", prologue)
        engine = emulated_engine(engines, monkeypatch, model=str(path),
                                 cache_dir=tmp_path / prologue, kv_bits=8)  # fmt: skip
        PROLOGUES.clear()
        first = engine.generate("q", PROMPTS[1], max_tokens=24, logprobs=3)
        again = engine.generate("q", PROMPTS[1] + first.text + MORE, max_tokens=8, logprobs=3)
        runs[prologue] = [first, again]
        layers = engine.spec.num_layers
        # every layer's store normed its heads: each turn's one chunk, then each decode step
        steps = len(first.tokens) + len(again.tokens)
        assert PROLOGUES["normed"] == (PROLOGUES["store_rows"] if prologue == "1" else 0)
        assert PROLOGUES["normed"] >= steps * layers * (prologue == "1")
        let_go(engine)
        del engine
    agreed = [agree(want, got, 0.02) for want, got in zip(runs["0"], runs["1"])]
    assert agreed[0] >= 8, agreed
    assert runs["1"][1].stats.cache == "hot"


def test_a_gpu_that_refuses_agentkv_s_kernels_runs_on_mlx_s_operations(
    engines, monkeypatch, tmp_path, caplog
):
    """Where a GPU's compiler refuses one of agentkv's kernels (nothing has run on a Mac),
    the engine's warm-up says so, builds its pool again and runs without them
    (``gpu.refuse``): stores, groups and gathers by MLX's operations, attention through the
    dense path at every step. Two turns then give the tokens of the engine with its kernels
    (8-bit KV: log-probabilities within 0.05 nats), with none of them called. With
    ``AGENTKV_GPU_KERNELS=1`` the refusal is an error that names the way around."""
    from gpu_emulation import _emulated_kernel, refusing_gpu

    from agentkv.errors import AgentKVError
    from agentkv.kernels import gpu

    refused = refusing_gpu(monkeypatch)
    runs = {}
    for kernels in ("on", "refused"):
        emulated_gpu(monkeypatch)
        monkeypatch.setattr(gpu, "_kernel", refused if kernels == "refused" else _emulated_kernel)
        if kernels == "refused":
            monkeypatch.setenv(gpu.KERNELS_ENV, "1")
            with pytest.raises(AgentKVError, match="AGENTKV_GPU_KERNELS=0") as refusal:
                engines(cache_dir=tmp_path / "required", kv_bits=8)
            assert "LU factorization failed" in str(refusal.value)
            assert gpu.kernels_on()
            monkeypatch.delenv(gpu.KERNELS_ENV)
        with caplog.at_level("WARNING", logger="agentkv.engine"):
            engine = engines(cache_dir=tmp_path / kernels, kv_bits=8)
        warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert bool(warned) == (kernels == "refused"), warned
        assert gpu.kernels_on() == (kernels == "on")
        assert "LU factorization" in gpu.kernels_state() or kernels == "on"
        first = engine.generate("p", PROMPTS[0], max_tokens=24, logprobs=3)
        again = engine.generate("p", PROMPTS[0] + first.text + MORE, max_tokens=8, logprobs=3)
        runs[kernels] = [first, again]
        let_go(engine)
        del engine
    for want, got in zip(runs["on"], runs["refused"]):
        assert agree(want, got, 0.05) >= 8
    assert runs["refused"][1].stats.cache == "hot"


def test_doctor_on_a_gpu_that_refuses_agentkv_s_kernel_warns_and_measures_without_it(
    monkeypatch,
):
    """``agentkv doctor`` on a GPU measures decode attention through agentkv's kernel and says
    so; where the GPU refuses it, a warning with MLX's words, and the measure by MLX's
    operations, as an engine would then run."""
    from gpu_emulation import refusing_gpu

    from agentkv import doctor
    from agentkv.kernels import gpu

    emulated_gpu(monkeypatch)
    info = doctor.report()
    attention = info["kernels"]["attention"]
    assert (attention["path"], attention["gpu_kernels"]) == ("gpu_kernel", "agentkv's kernels")
    assert not any("refused" in w for w in info["warnings"]), info["warnings"]
    monkeypatch.setattr(gpu, "_kernel", refusing_gpu(monkeypatch))
    info = doctor.report()
    attention = info["kernels"]["attention"]
    assert attention["path"] == "quantized_matmul" and attention["kv_gbps"] > 0, attention
    assert "refused" in attention["gpu_kernels"] and not gpu.kernels_on()
    assert [w for w in info["warnings"] if "LU factorization failed" in w], info["warnings"]


def test_doctor_on_a_gpu_whose_kernel_reads_the_wrong_head_says_so(monkeypatch):
    """``agentkv doctor`` compares decode attention with the reference's MLX operations: a
    paged kernel that reads its neighbour KV head lies ~0.2 of the outputs' spread away
    (the right one ~1e-5; the warning from 0.01)."""
    import gpu_emulation

    from agentkv import doctor

    emulated_gpu(monkeypatch)
    gpu_emulation.neighbour_head(monkeypatch)
    info = doctor.report()
    attention = info["kernels"]["attention"]
    assert attention["path"] == "gpu_kernel" and attention["error"] > 0.05, attention
    assert [w for w in info["warnings"] if "from the reference" in w], info["warnings"]


def test_the_warm_up_tells_a_kernel_that_computes_something_else_apart(
    engines, monkeypatch, tmp_path, caplog
):
    """On a GPU the warm-up runs again without agentkv's kernels and compares (nothing has
    run them on Metal; right kernels pass: the 4-bit test above): a paged kernel that reads
    its neighbour KV head's keys and values is told apart, with a warning, and the engine
    then runs on MLX's operations, never calling the wrong kernel again (that their tokens
    are the kernels': the refusal's test above)."""
    import gpu_emulation

    from agentkv.engine import warmup
    from agentkv.kernels import gpu

    monkeypatch.setattr(gpu, "_refused", None)  # put back as it was at the end
    monkeypatch.setattr(warmup, "_agreed", set())
    emulated_gpu(monkeypatch)
    wrong_calls = gpu_emulation.neighbour_head(monkeypatch)
    with caplog.at_level("WARNING", logger="agentkv.engine"):
        engine = engines(cache_dir=tmp_path / "wrong")
    warned = [r.getMessage() for r in caplog.records if "nats away" in r.getMessage()]
    assert len(warned) == 1 and not gpu.kernels_on(), warned
    assert float(warned[0].split("distributions ")[1].split()[0]) > 10, warned
    assert "nats away" in gpu.kernels_state()
    calls = len(wrong_calls)
    assert calls > 0  # the check ran it
    got = engine.generate("p", PROMPTS[1], max_tokens=16, logprobs=3)
    assert len(wrong_calls) == calls and len(got.tokens) == 16
    assert got.stats.cache == "cold" and got.logprobs[0].top[0].logprob > -5
    let_go(engine)
