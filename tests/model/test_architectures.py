"""Every supported architecture, on tiny random-weight models built here with mlx-lm's own
model classes and the embedded model's real tokenizer: hot == warm after a restart, a batch
== each agent alone, and the KV read back from disk == the KV that was saved.

The weights of the attention and MLP projections are scaled up (x3) so the continuation
depends on the whole context, not only on the last token: a wrong key or value anywhere
changes the tokens (a model at mlx-lm's initial scale repeats one token whatever it reads).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import copy_tokenizer, held_kv
from mlx.utils import tree_flatten, tree_map_with_path

from agentkv import Engine, mlx_adapter
from agentkv.cli.main import main as agentkv_main
from agentkv.engine.drafts import ContextDrafter
from agentkv.errors import InvalidRequestError, ModelImportError
from agentkv.format.geometry import BLOCK_TOKENS
from agentkv.format.spec import LayerKind
from agentkv.model.load import CPU_QMM_ID, load_model

WINDOW = 128
COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,  # the embedded tokenizer's
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
ARCHITECTURES = {
    "llama": {"head_dim": 64},
    # head dim 64 / 2 = 32: the KV group size must drop to 32
    "qwen2": {"num_key_value_heads": 2},
    "qwen3": {
        "head_dim": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 1_000_000,  # qwen3's config must name it
    },
    # attention scores soft-capped at 50 in its own attention code (agentkv's patch of it:
    # mlx_adapter), final logits at 30; the x3 projections make the caps bite
    # and every even layer a sliding window, which mlx-lm's class leaves out (agentkv runs it)
    "gemma2": {
        "head_dim": 64,
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 64,
        "tie_word_embeddings": True,
    },
    "gemma3_text": {
        "head_dim": 64,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 64,
        "tie_word_embeddings": True,
    },
    "gpt_oss": {
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
    },
}
# What each model's spec must say: (layer kinds, attention sinks, head dim, group size).
SLIDING_FULL = [LayerKind.SLIDING, LayerKind.FULL] * 2
EXPECTED = {
    "llama": ([LayerKind.FULL] * 4, False, 64, 64),
    "qwen2": ([LayerKind.FULL] * 4, False, 32, 32),
    "qwen3": ([LayerKind.FULL] * 4, False, 128, 64),
    "gemma2": (SLIDING_FULL, False, 64, 64),
    "gemma3_text": (SLIDING_FULL, False, 64, 64),
    "gpt_oss": (SLIDING_FULL, True, 64, 64),
}
GAIN = 3.0
POOL_BYTES = 16 << 20


# agentkv's CPU kernels (the packed quantized matmul, the fused blocks, KVSwap): on a GPU the
# model runs on MLX's own kernels, and tests/gpu holds the GPU paths.
cpu_kernels = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="agentkv's CPU kernels")


def build_model_dir(root: Path, config: dict, *, seed: int = 5, gain: float = GAIN) -> Path:
    """An mlx-lm model directory: ``config``'s architecture with random weights (projections
    scaled by ``gain``; attention sinks random, not zero) and the embedded tokenizer; with
    ``config["quantization"]`` (``group_size``, ``bits``) its layers quantized by MLX."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))

    def scale(path, w):
        return w * gain if "proj" in path and path.endswith(".weight") else w

    model.update(tree_map_with_path(scale, model.parameters()))
    for layer in getattr(model, "layers", []):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "sinks", None) is not None:
            attn.sinks = mx.random.normal(attn.sinks.shape)
    if "quantization" in config:  # as mlx-lm's convert writes a quantized model
        nn.quantize(model, **config["quantization"])
    root.mkdir(parents=True)
    mx.save_safetensors(str(root / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (root / "config.json").write_text(json.dumps(config))
    copy_tokenizer(root)
    return root


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request, tmp_path_factory):
    """(architecture name, its model directory)."""
    name = request.param
    config = {"model_type": name, **COMMON, **ARCHITECTURES[name]}
    return name, build_model_dir(tmp_path_factory.mktemp(name) / "model", config)


def engine_on(model: Path, cache_dir: Path, **options) -> Engine:
    return Engine(
        model=str(model), cache_dir=cache_dir, pool_bytes=POOL_BYTES, warmup=False, **options
    )


def log_prompt(topic: str, lines: int = 36) -> list[dict]:
    """A user message of ~16 tokens a line: 36 lines span more than two 256-token blocks and
    more than a sliding window plus a block, so sliding layers drop their first block."""
    text = "".join(f"Line {k} of the {topic} log: step {k * 7 % 13} passed. " for k in range(lines))
    return [{"role": "user", "content": text}]


def follow_up(messages: list[dict], reply: str, question: str) -> list[dict]:
    return messages + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]


def kept_rows(eng: Engine, arrays: list[np.ndarray], first: int) -> list[np.ndarray]:
    """``arrays`` with the sliding layers' rows before ``first`` cut (format 2's tails, after
    every layer's components, are the tokens after the last whole group: kept as they are)."""
    per_layer = len(eng.pool.arena.components[0])
    sliding = [layer.kind is LayerKind.SLIDING for layer in eng.spec.layers]
    layers = eng.spec.num_layers
    return [
        a[:, first:] if i < layers * per_layer and sliding[i // per_layer] else a
        for i, a in enumerate(arrays)
    ]


def test_the_spec_reads_each_architecture_and_a_turn_runs(arch, tmp_path):
    name, model = arch
    kinds, sinks, head_dim, group = EXPECTED[name]
    with engine_on(model, tmp_path / "kv") as eng:
        spec = eng.spec
        assert spec.model_type == name
        assert [layer.kind for layer in spec.layers] == kinds
        sliding = [layer.window for layer in spec.layers if layer.kind is LayerKind.SLIDING]
        assert sliding == [WINDOW] * kinds.count(LayerKind.SLIDING)
        assert spec.attention_sinks is sinks
        assert (spec.key_head_dim, spec.value_head_dim) == (head_dim, head_dim)
        assert eng.quant.group_size == group and eng.quant.version == 2
        # the layer whose 4-bit keys cost most, measured on this model at load
        assert len(eng.quant.wide_layers) == 1 and eng.quant.label.startswith("q4.v2+k8@")
        config = {**COMMON, **ARCHITECTURES[name]}
        assert eng.loaded.query_heads == config["num_attention_heads"]  # sizes prefill chunks
        assert eng.context_limit == config["max_position_embeddings"]
        r = eng.chat("smoke", [{"role": "user", "content": "Count the steps."}], max_tokens=4)
        assert r.stats.cache == "cold" and len(r.tokens) == 4


@pytest.mark.slow
def test_hot_equals_warm_after_a_restart(arch, tmp_path):
    """Agent "x" is resumed from disk by a new Engine on the same store; "twin" (the same
    conversation under its own salt: nothing shared) ran the same turn hot before it."""
    _, model = arch
    first = log_prompt("build")
    with engine_on(model, tmp_path / "kv") as eng:
        r1 = eng.chat("x", first, max_tokens=12)
        t1 = eng.chat("twin", first, max_tokens=12, cache_salt="twin")
        assert r1.tokens == t1.tokens and r1.stats.cache == t1.stats.cache == "cold"
        second = follow_up(first, r1.text, "Which step failed?")
        hot = eng.chat("twin", second, max_tokens=16, cache_salt="twin")
        assert hot.stats.cache == "hot" and hot.stats.reused_tokens > 2 * BLOCK_TOKENS
    with engine_on(model, tmp_path / "kv") as eng:
        warm = eng.chat("x", second, max_tokens=16)
    assert warm.stats.cache == "warm"
    assert warm.stats.reused_tokens == hot.stats.reused_tokens
    assert warm.stats.prefill_tokens == hot.stats.prefill_tokens
    assert len(set(warm.tokens)) > 3  # the model does not just repeat itself
    assert warm.tokens == hot.tokens


@pytest.mark.slow
def test_a_batch_equals_each_agent_alone(arch, tmp_path):
    _, model = arch
    turns = [
        ("a", log_prompt("build", 36)),
        ("b", log_prompt("deploy", 9)),
        ("c", [{"role": "user", "content": "Count the steps."}]),
    ]
    with engine_on(model, tmp_path / "kv") as eng:
        batched = eng.chat_many(turns, max_tokens=12)
        alone = [
            eng.chat(f"{agent}-alone", messages, max_tokens=12, cache_salt="alone")
            for agent, messages in turns
        ]
    assert [r.stats.cache for r in alone] == ["cold"] * 3
    assert len({tuple(r.tokens) for r in alone}) == 3  # the contexts matter
    assert [r.tokens for r in batched] == [r.tokens for r in alone]


def test_drafted_steps_give_the_tokens_and_kv_of_one_token_a_step(arch, tmp_path, monkeypatch):
    """Random weights copy nothing from their context, so an oracle drafts here: the reply
    one token a step gives, with every third draft wrong halfway (engine/drafts.py). The
    drafted turn keeps and cuts drafts on every layer kind (sliding windows, sinks, experts)
    and ends with the same tokens and the same KV."""
    if mx.default_device() != mx.cpu:
        pytest.skip(
            "drafts run on the CPU only (engine/runner.py: MLX's GPU matmuls pick "
            "kernels by row count, so a drafted step is not one token's bits there)"
        )
    _, model = arch
    messages = log_prompt("draft", 20)

    def turn(name: str, **options):
        with engine_on(model, tmp_path / name, **options) as eng:
            result = eng.chat("d", messages, max_tokens=24)
            return result, held_kv(eng, "d", eng.residency.get("d").size)

    step, (before, first_before) = turn("step", draft_tokens=0)
    calls = []

    def oracle(self, generated, limit):
        draft = step.tokens[len(generated) : len(generated) + min(limit, self.size)]
        calls.append(draft)
        if len(calls) % 3 == 0 and draft:
            draft[len(draft) // 2] ^= 1  # a token greedy decoding does not pick
        return draft

    monkeypatch.setattr(ContextDrafter, "propose", oracle)
    drafted, (after, first_after) = turn("drafted")
    assert drafted.tokens == step.tokens and len(step.tokens) == 24
    assert 0 < drafted.stats.accepted_draft_tokens < drafted.stats.draft_tokens
    assert first_before == first_after
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_saved_kv_reloads_identically(arch, tmp_path):
    """The KV a new Engine reads back from disk (a warm turn on the same store) equals,
    array for array, what the first Engine held when it saved. Raw text turns, the second
    extending exactly the text the agent stored (its prompt and the reply tokens fed back)."""
    _, model = arch
    prompt = log_prompt("test", 40)[0]["content"]
    with engine_on(model, tmp_path / "kv") as eng:
        eng.generate("r", prompt, max_tokens=4)
        state = eng.residency.get("r")
        size, stored = state.size, state.text.decode()
        assert size > 2 * BLOCK_TOKENS
        before, first_before = held_kv(eng, "r", size)
        eng.flush()
    with engine_on(model, tmp_path / "kv") as eng:
        warm = eng.generate("r", stored + " And then?", max_tokens=1)
        assert warm.stats.cache == "warm" and warm.stats.reused_tokens == size
        after, first_after = held_kv(eng, "r", size)
        first = max(first_before, first_after)
        assert first < size
        before, after = kept_rows(eng, before, first), kept_rows(eng, after, first)
    tails = eng.spec.num_layers if eng.pool.arena.ct else 0
    arrays = eng.spec.num_layers * len(eng.pool.arena.components[0]) + tails
    assert len(before) == len(after) == arrays
    for i, (want, got) in enumerate(zip(before, after)):
        assert mx.array_equal(mx.array(got), mx.array(want)), f"array {i}"


# -- quantized weights ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def quantized_arch(request, tmp_path_factory):
    """(architecture name, its model directory with 4-bit weights in groups of 32)."""
    name = request.param
    config = {
        "model_type": name,
        **COMMON,
        **ARCHITECTURES[name],
        "quantization": {"group_size": 32, "bits": 4},
    }
    return name, build_model_dir(tmp_path_factory.mktemp(f"{name}-q4") / "model", config)


@cpu_kernels
def test_each_architecture_runs_quantized_on_agentkv_s_kernel(quantized_arch, caplog):
    """Every 4-bit linear layer (and embedding) runs on agentkv's kernel; gpt-oss's experts
    stay on MLX's gather kernel, with the reason logged. The logits match the same weights
    dequantized to float32 (the kernel quantizes activations to int16 per group)."""
    name, model = quantized_arch
    with caplog.at_level("INFO", logger="agentkv.model"):
        quantized = load_model(model, weights="quantized")
    kinds = [type(m) for _, m in quantized.model.named_modules()]
    assert mlx_adapter.CPUQuantizedLinear in kinds and mlx_adapter.CPUQuantizedEmbedding in kinds
    assert nn.QuantizedLinear not in kinds and nn.QuantizedEmbedding not in kinds
    assert nn.Linear not in kinds  # nothing was dequantized on the way
    assert quantized.spec.weights_id.endswith(CPU_QMM_ID)
    experts = "expert layers stay on MLX's gather_qmm" in caplog.text
    assert experts is (name == "gpt_oss")

    dequantized = load_model(model, weights="float32")
    assert not any("Quantized" in type(m).__name__ for _, m in dequantized.model.named_modules())
    prompt = log_prompt("build", 4)[0]["content"]
    ids = mx.array([quantized.tokenizer.encode(prompt)])
    ours, theirs = quantized.model(ids)[0], dequantized.model(ids)[0]
    scale = float(mx.abs(theirs).max())
    assert float(mx.abs(ours - theirs).max()) < 5e-3 * scale  # measured <= 5e-4
    agree = mx.mean(mx.argmax(ours, axis=-1) == mx.argmax(theirs, axis=-1))
    assert float(agree) >= 0.95


@cpu_kernels
def test_llama_and_qwen_blocks_fuse_with_the_bits_of_their_separate_operations(
    quantized_arch, tmp_path
):
    """Quantized Llama, Qwen2 and Qwen3 blocks (Qwen2: q, k and v with biases; Qwen3: an
    RMSNorm of each q and k head) run a decode step as one agentkv operation, with the logits
    of the block's separate operations; the other architectures keep mlx-lm's blocks."""
    from agentkv.pool.step import PagedStep

    name, model = quantized_arch
    with engine_on(model, tmp_path / "kv") as eng:
        runner, pool = eng.runner, eng.pool
        kinds = {type(b).__name__ for b in runner.model.model.layers}
        if name not in ("llama", "qwen2", "qwen3"):
            assert "CPUFusedBlock" not in kinds
            return
        assert kinds == {"CPUFusedBlock"}
        ids = eng.loaded.tokenizer.encode(log_prompt("fuse", 5)[0]["content"])
        logits = {}
        for fused in (True, False):
            table = pool.new_table(pool.seed(f"fuse-{name}-{fused}"))
            reservation = pool.reserve(4)
            runner.forward([table], [ids], reservations=[reservation], logits=False)
            token, steps = 11, []
            for _ in range(4):
                table.grow(1, pool.arena.copy_rows, reservation)
                step = PagedStep(pool.arena, runner.loaded.spec, [table], 1, fused=fused)
                out = runner.model(mx.array([[token]]), cache=step.caches)[:, -1, :]
                mx.eval(out)
                pool.arena.settle()
                table.written([token])
                assert step.fused is (fused and table.length % pool.arena.ct != 0)
                steps.append(np.array(out))
                token = int(out.argmax())
            logits[fused] = steps
            table.release()
            reservation.close()
        for a, b in zip(logits[True], logits[False]):
            np.testing.assert_array_equal(a, b)


def test_joint_projections_give_the_logits_of_the_separate_ones(quantized_arch, monkeypatch):
    """On a GPU each block's query, key and value projections run as one matmul, and its
    gate and up projections as another (``use_joint_projections``). Over MLX's own 4-bit
    layers the model gives the same logits, bit for bit, for a batch of two rows (over float
    ones, whose matmul may sum in another order for a wider output, within 1e-4); it holds
    the same weight bytes and keeps no step's arrays after the call. ``AGENTKV_GPU_JOINT=0``
    leaves a model alone."""
    from agentkv.mlx_adapter import JointLinear

    name, path = quantized_arch
    for quantized in (True, False):
        separate, _ = mlx_adapter.load(str(path))
        joint, tokenizer = mlx_adapter.load(str(path))
        if not quantized:
            mlx_adapter.dequantize_model(separate)
            mlx_adapter.dequantize_model(joint)
        monkeypatch.setenv(mlx_adapter.JOINT_ENV, "0")
        assert mlx_adapter.use_joint_projections(joint) == 0
        monkeypatch.delenv(mlx_adapter.JOINT_ENV)
        joined = mlx_adapter.use_joint_projections(joint)
        # q/k/v in every block; gate/up where the MLP has them (gpt-oss's experts do not)
        assert joined == COMMON["num_hidden_layers"] * (1 if name == "gpt_oss" else 2)
        # Llama's, Qwen2's, Qwen3's and Gemma 3's attention hand the store kernel their RoPE
        # (the last two their heads' norm too; with no agentkv cache, as here, they run as
        # mlx-lm's)
        switched = mlx_adapter.use_gpu_prologue(joint)
        prologue = ("llama", "qwen2", "qwen3", "gemma3_text")
        assert switched == COMMON["num_hidden_layers"] * (name in prologue)
        ids = mx.array([tokenizer.encode(log_prompt("lint", 2)[0]["content"])[:24]] * 2)
        ids[1] = ids[1][::-1]
        a, b = separate(ids), joint(ids)
        if quantized:
            assert mx.array_equal(a, b)
        else:
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)

        def nbytes(model):
            return sum(a.nbytes for _, a in tree_flatten(model.parameters()))

        assert nbytes(joint) == nbytes(separate)
        joints = [m for _, m in joint.named_modules() if isinstance(m, JointLinear)]
        assert len(joints) == joined and all(j._held == [None, None, 0] for j in joints)


@pytest.mark.parametrize("bits,group,mode", [(2, 64, "affine"), (3, 32, "affine"),
                                             (5, 32, "affine"), (6, 64, "affine"),
                                             (8, 32, "affine"), (4, 32, "mxfp4")])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_a_joint_projection_is_its_layers_side_by_side(bits, group, mode, bias):
    """``_joint_of`` over quantized layers of every bit width a model may ship (3, 5 and 6
    bits pack rows into words that 32 // bits does not count; a GGUF's Q5 imports are 5-bit),
    an input width no power of two (Qwen2.5's 896): each part gives its own layer's bits."""
    mx.random.seed(bits)
    layers = []
    for out in (128, 64, 64):
        layer = nn.Linear(896, out, bias=bias)
        layers.append(nn.QuantizedLinear.from_linear(layer, group, bits, mode=mode))
    joint = mlx_adapter._joint_of(layers)
    assert joint is not None
    x = mx.random.normal((2, 3, 896))
    for i, layer in enumerate(layers):
        assert mx.array_equal(mlx_adapter.JointPart(joint, i)(x), layer(x))
    assert mlx_adapter._joint_of([layers[0], nn.Linear(896, 64)]) is None  # another kind


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}],
)
@pytest.mark.parametrize("traditional", [False, True])
def test_the_prologue_s_rope_table_gives_mlx_lm_s_rope(scaling, traditional):
    """``rope_table``: a plain RoPE's and mlx-lm's Llama 3 RoPE's inverse frequencies as the
    store kernel's prologue reads them; run by its CPU build, the queries come back as the
    module ropes them (float32, within 1e-3: the angles differ by float32 rounding at position
    3000).
    A RoPE over part of the head, or of another kind, is left to mlx-lm."""
    from mlx_lm.models.rope_utils import initialize_rope

    from agentkv import _ext
    from agentkv.kernels.types import store_dims

    dim, L = 64, 3
    rope = initialize_rope(dim, 500000.0, traditional, scaling, 4096)
    table, mode = mlx_adapter.rope_table(rope, dim)
    assert mode == (2 if traditional else 1)
    assert mlx_adapter.rope_table(rope, 2 * dim) is None  # over half the head
    assert mlx_adapter.rope_table(nn.Linear(2, 2), dim) is None
    joint = mx.random.normal((1, L, 3 * dim), key=mx.random.key(1))
    dims = store_dims(L, dim, 4, 32, prologue=(L, 1, 1), rope_mode=mode)
    got = _ext.kernel_store_rows(joint, joint, joint, list(dims), mx.array([3000]), table, table)[4]
    want = rope(joint[..., :dim].reshape(1, L, 1, dim).transpose(0, 2, 1, 3), offset=3000)
    assert np.abs(np.array(got) - np.array(want).reshape(L, dim)).max() < 1e-3


@cpu_kernels
def test_the_last_position_alone_gives_the_logits_of_the_whole_call(quantized_arch):
    """Llama, Qwen2 and Qwen3 (tied and untied heads) project only the last position onto the
    vocabulary when the engine asks for logits; the other architectures make their own call.
    Either way the logits are the bits of the full call's last row."""
    name, model = quantized_arch
    loaded = load_model(model, weights="quantized")
    ids = mx.array([loaded.tokenizer.encode(log_prompt("lint", 3)[0]["content"])] * 2)
    whole = loaded.model(ids)[:, -1, :]
    last = mlx_adapter.last_logits(loaded.model, ids, None)
    assert last.shape == whole.shape
    assert mx.array_equal(last, whole)
    fast = type(loaded.model).__module__ in mlx_adapter._HEAD_AFTER_INNER
    assert fast is (name in ("llama", "qwen2", "qwen3"))


@pytest.mark.slow
def test_each_quantized_architecture_batches_and_resumes_like_alone(quantized_arch, tmp_path):
    """On agentkv's kernel a batch still equals each agent alone, token for token (a row's
    result does not depend on the other rows), and a warm turn after a restart equals hot."""
    _, model = quantized_arch
    turns = [
        ("a", log_prompt("build", 36)),
        ("b", log_prompt("deploy", 9)),
        ("c", [{"role": "user", "content": "Count the steps."}]),
    ]
    with engine_on(model, tmp_path / "kv") as eng:
        on_cpu = mx.default_device() == mx.cpu
        assert eng.loaded.spec.weights_id.endswith(CPU_QMM_ID) == on_cpu
        batched = eng.chat_many(turns, max_tokens=12)
        alone = [
            eng.chat(f"{agent}-alone", messages, max_tokens=12, cache_salt="alone")
            for agent, messages in turns
        ]
        second = follow_up(turns[0][1], alone[0].text, "Which step failed?")
        hot = eng.chat("a-alone", second, max_tokens=12, cache_salt="alone")
        assert hot.stats.cache == "hot"
    assert len({tuple(r.tokens) for r in alone}) == 3  # the contexts matter
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    with engine_on(model, tmp_path / "kv") as eng:
        warm = eng.chat(
            "a", follow_up(turns[0][1], batched[0].text, "Which step failed?"), max_tokens=12
        )
    assert warm.stats.cache == "warm" and warm.tokens == hot.tokens


# -- the KV group size follows the head dim ------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2"], indirect=True)
def test_the_group_size_fits_the_head_dim(arch, tmp_path):
    """Head dim 32 takes group 32 on its own (any bits); a group size named that does not
    fit is refused with the head dim named."""
    _, model = arch
    with pytest.raises(InvalidRequestError, match="head dim 32 does not split into groups of 64"):
        Engine(model=str(model), cache_dir=tmp_path / "kv", group_size=64, warmup=False)
    with Engine(model=str(model), cache_dir=tmp_path / "kv", kv_bits=8, warmup=False) as eng:
        assert (eng.quant.group_size, eng.quant.label) == (32, "q8.v2")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_engines_with_other_group_sizes_leave_each_other_s_blocks_alone(arch, tmp_path):
    _, model = arch
    prompt = log_prompt("build")

    def engine(group_size):
        return Engine(
            model=str(model),
            cache_dir=tmp_path / "kv",
            group_size=group_size,
            pool_bytes=POOL_BYTES,
            warmup=False,
        )

    with engine(32) as eng:
        first = eng.chat("a", prompt, max_tokens=4)
    with engine(64) as eng:
        eng.chat("b", prompt, max_tokens=4)  # the same prompt: the same token blocks
    with engine(32) as eng:
        again = eng.chat("a", follow_up(prompt, first.text, "And then?"), max_tokens=1)
    assert list((tmp_path / "kv").glob("*/quarantine/blocks/*")) == []
    assert again.stats.cache == "warm" and again.stats.reused_tokens > 2 * BLOCK_TOKENS


# -- layers agentkv cannot cache -----------------------------------------------------------

HYBRIDS = {
    # A conv + attention hybrid (LFM2): attention at layers 0 and 2, a short convolution
    # with recurrent state (mlx-lm's ArraysCache) at layer 1.
    "lfm2": {
        "model_type": "lfm2",
        "vocab_size": 49152,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 128,
        "full_attn_idxs": [0, 2],
    },
    # A state-space model (Mamba): every layer keeps a recurrent state.
    "mamba": {
        "model_type": "mamba",
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "state_size": 8,
        "num_hidden_layers": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_rank": 4,
    },
}


@pytest.mark.parametrize(("name", "layer"), [("lfm2", 1), ("mamba", 0)])
def test_a_layer_with_recurrent_state_is_refused_by_name(name, layer, tmp_path, capsys):
    model = build_model_dir(tmp_path / name, HYBRIDS[name], gain=1.0)
    with pytest.raises(ModelImportError) as info:
        Engine(model=str(model), cache_dir=tmp_path / "kv", warmup=False)
    message = str(info.value)
    assert f"model {name!r}: layer {layer} uses ArraysCache" in message
    assert agentkv_main(["chat", "--agent", "a", "--model", str(model)]) == 2
    assert f"layer {layer} uses ArraysCache" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama"], indirect=True)
def test_the_server_names_the_layer_and_keeps_serving(arch, tmp_path):
    """``agentkv serve --model A --model B``: a request for a model that cannot load gets
    the error in the API's shape; the other model keeps answering."""
    from starlette.testclient import TestClient

    from agentkv.server import create_app
    from agentkv.server.models import ModelRouter, describe

    _, llama = arch
    hybrid = build_model_dir(tmp_path / "lfm2", HYBRIDS["lfm2"], gain=1.0)
    router = ModelRouter(
        describe([str(llama), str(hybrid)]), lambda source: engine_on(source, tmp_path / "kv")
    )
    app = create_app(router=router, close_engine=True, responses_dir=tmp_path / "responses")
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Count the steps."}]}
    with TestClient(app) as client:
        refused = client.post("/v1/chat/completions", json={**body, "model": "lfm2"})
        assert refused.status_code >= 400
        message = refused.json()["error"]["message"]
        assert "model 'lfm2': layer 1 uses ArraysCache" in message
        served = client.post("/v1/chat/completions", json={**body, "model": llama.name})
        assert served.status_code == 200 and served.json()["model"] == llama.name


def test_a_model_that_computes_attention_itself_is_refused_at_load(tmp_path, monkeypatch):
    """A model whose attention code computes the scores itself, never calling mlx-lm's
    scaled_dot_product_attention, cannot read agentkv's quantized cache: here mlx-lm's own
    gemma2 attention, without the patch that gives it agentkv's (mlx_adapter)."""
    from mlx_lm.models import gemma2

    config = {"model_type": "gemma2", **COMMON, **ARCHITECTURES["gemma2"], "num_hidden_layers": 2}
    model = build_model_dir(tmp_path / "gemma2", config, gain=1.0)
    mlx_adapter.install_attention_dispatch()
    patched = gemma2.Attention.__call__
    monkeypatch.setattr(gemma2.Attention, "__call__", patched.__agentkv_original__)
    monkeypatch.setattr(mlx_adapter, "_softcapped_attention", lambda original: original)
    with pytest.raises(ModelImportError, match="model 'gemma2' does not run on agentkv's KV"):
        Engine(model=str(model), cache_dir=tmp_path / "kv", warmup=False)


@cpu_kernels
def test_llama_and_qwen3_blocks_decode_a_swapped_row_with_the_bits_of_a_resident_one(
    quantized_arch, tmp_path
):
    """KVSwap in the fused block (RoPE at the row's true positions; Qwen3's q and k norms
    beside them): a row whose leading blocks are evicted to their block files, with a reuse
    buffer that holds all of them, decodes the logits of the same row all in memory; so
    does one reading ahead (its block files' pages dropped before each step, so its reads
    go to disk and the steps after the first read ahead)."""
    import dataclasses

    from helpers import disk_reads

    from agentkv.format.geometry import BLOCK_TOKENS
    from agentkv.pool.step import PagedStep
    from agentkv.pool.swap import Projections, SwapState
    from agentkv.store.block_files import SharedBlocks

    name, model = quantized_arch
    if name not in ("llama", "qwen3"):  # qwen2's head dim (32) has no 64-token channel groups
        return
    with engine_on(model, tmp_path / "kv") as eng:
        runner, pool = eng.runner, eng.pool
        spec = runner.loaded.spec
        blocks = runner.model.model.layers
        for block, after in zip(blocks, blocks[1:]):  # each predicts the next one's query
            given, theirs = block.agentkv_fused.predict["predict"], after.agentkv_fused.arguments
            assert given[0] is theirs["norms"][0]
            assert all(a is b for a, b in zip(given[1:4], theirs["linears"][:3]))
            assert given[4] is theirs["linear_biases"][0]
            assert given[5] is (theirs["qk_norms"][0] if theirs["qk_norms"] else None)
        assert blocks[-1].agentkv_fused.predict is None
        ids = eng.loaded.tokenizer.encode(log_prompt("swap", 48)[0]["content"])
        assert len(ids) > 2 * BLOCK_TOKENS
        eye = mx.broadcast_to(mx.eye(spec.key_head_dim), (spec.kv_heads, *[spec.key_head_dim] * 2))
        zero = mx.zeros((spec.kv_heads, spec.key_head_dim))
        layers = spec.num_layers
        exact = Projections((eye,) * layers, (zero,) * layers, (eye,) * layers)
        logits = {}
        for arm in ("resident", "swapped", "read ahead"):
            table = pool.new_table(pool.seed(f"swap-{name}-{arm}"))
            reservation = pool.reserve(4)
            runner.forward([table], [ids], reservations=[reservation], logits=False)
            swap = None
            if arm != "resident":
                shared = SharedBlocks(tmp_path / arm, spec, pool.quant)
                with shared.writing():
                    files = shared.ensure_pool_blocks(pool, table.blocks[:2])
                projections = dataclasses.replace(
                    exact, predict_from=1 if arm == "read ahead" else None
                )
                swap = SwapState.evict(
                    pool,
                    table,
                    files,
                    projections,
                    query_heads=runner.loaded.query_heads,
                    staging=2,
                )
                swap.swapset.read_ahead_always = arm == "read ahead"
            token, steps = 11, []
            for _ in range(3):
                if arm == "read ahead":
                    disk_reads(files)
                table.grow(1, pool.arena.copy_rows, reservation)
                step = PagedStep(pool.arena, spec, [table], 1, swaps=[swap])
                out = runner.model(mx.array([[token]]), cache=step.caches)[:, -1, :]
                mx.eval(out)
                pool.arena.settle()
                table.written([token])
                steps.append(np.array(out))
                token = int(out.argmax())
            logits[arm] = steps
            if swap is not None:
                assert swap.error == ""
                assert (swap.stats()["predicted"] > 0) == (arm == "read ahead")
                swap.release()
            else:
                table.release()
            reservation.close()
        for arm in ("swapped", "read ahead"):
            for a, b in zip(logits["resident"], logits[arm]):
                np.testing.assert_array_equal(a, b)


def test_gemma2_s_windows_come_from_its_config_and_a_bad_one_is_refused():
    windows = mlx_adapter.sliding_windows_left_out
    assert windows("gemma2", {"sliding_window": 64}, 5) == {0: 64, 2: 64, 4: 64}
    assert windows("gemma2", {}, 2) == {0: 4096}  # every released Gemma 2's
    assert windows("llama", {"sliding_window": 64}, 4) == {}
    for bad in ("4096", -1, 2.5, True):
        with pytest.raises(ModelImportError, match="sliding_window .* not a positive token"):
            windows("gemma2", {"sliding_window": bad}, 4)


@pytest.mark.parametrize("path", ["fused", "reference"])
def test_gemma2_s_even_layers_attend_through_their_sliding_window(path, tmp_path, monkeypatch):
    """Gemma 2 gives every even layer a sliding window (transformers, llama.cpp); mlx-lm's
    class leaves it out, agentkv runs it: over agentkv caches, prefilled at once and then a
    token a step, the logits of mlx-lm's own gemma2 layers given each layer's window mask by
    hand, to float16 KV's rounding (the same error as with every layer global and no cache),
    and far from the same layers all global."""
    from agentkv.format.quant import KVQuant
    from agentkv.kv.cache import AgentKVCache

    if path == "reference":  # reads the masks, which each layer makes from its own cache
        monkeypatch.setenv("AGENTKV_ATTENTION", "reference")
    window = 16
    config = {"model_type": "gemma2", **COMMON, **ARCHITECTURES["gemma2"]}
    config["sliding_window"] = window
    loaded = load_model(build_model_dir(tmp_path / "g", config), weights="float32")
    assert [layer.window for layer in loaded.spec.layers] == [window, None] * 2
    model, inner = loaded.model, loaded.model.model
    ids = loaded.tokenizer.encode(log_prompt("windows", 3)[0]["content"])[:72]
    tokens = mx.array([ids])

    def by_hand(windows):
        h = inner.embed_tokens(tokens) * config["hidden_size"] ** 0.5
        for layer, w in zip(inner.layers, windows):
            h = layer(h, mlx_adapter.create_causal_mask(len(ids), 0, window_size=w), None)
        out = inner.embed_tokens.as_linear(inner.norm(h)) / model.final_logit_softcapping
        return np.array(mx.tanh(out) * model.final_logit_softcapping)[0]

    want, all_global = by_hand([window, None] * 2), by_hand([None] * 4)
    spread = want.std()

    def fresh():
        return [AgentKVCache(KVQuant(16, 16), window=layer.window) for layer in loaded.spec.layers]

    at_once = np.array(model(tokens, cache=fresh()))[0]
    caches, prefix = fresh(), 40
    stepped = [np.array(model(tokens[:, :prefix], cache=caches))[0]]
    for i in range(prefix, len(ids)):
        stepped.append(np.array(model(tokens[:, i : i + 1], cache=caches))[0])
    stepped = np.concatenate(stepped)
    errors = [np.abs(got - want).max() / spread for got in (at_once, stepped)]
    # measured: 0.06 either way, as large as float16 KV against float32 with no windows at
    # all (mlx-lm's own path); all layers global lie ~5 spreads away
    assert max(errors) < 0.1, errors
    assert np.abs(all_global - want).max() / spread > 20 * max(errors)


@pytest.mark.parametrize("path", ["fused", "reference"])
def test_gemma2_over_agentkv_caches_gives_mlx_lm_s_own_soft_capped_attention(
    path, tmp_path, monkeypatch
):
    """mlx-lm's gemma2 computes its soft-capped scores in its own attention code; over an
    agentkv cache, agentkv's patch of it (mlx_adapter) runs the same projections and the same
    cap on agentkv's attention (the fused CPU kernels, or the reference path): with float16
    KV, mlx-lm's logits without a cache, to float16's rounding. The cap matters here: mlx-lm's
    logits without it lie far further away."""
    from agentkv.format.quant import KVQuant
    from agentkv.kernels.attention import paths_used
    from agentkv.kv.cache import AgentKVCache

    if path == "reference":
        monkeypatch.setenv("AGENTKV_ATTENTION", "reference")
    config = {"model_type": "gemma2", **COMMON, **ARCHITECTURES["gemma2"]}
    config["attn_logit_softcapping"] = 5.0  # the x3 projections' scores reach ~15
    loaded = load_model(build_model_dir(tmp_path / "g", config), weights="float32")
    model = loaded.model
    tokens = mx.array([loaded.tokenizer.encode(log_prompt("cap", 3)[0]["content"])[:64]])
    want = np.array(model(tokens))
    caches = [AgentKVCache(KVQuant(16, 16)) for _ in model.layers]
    before = paths_used()
    got = np.array(model(tokens, cache=caches))
    taken = {k: v - before[k] for k, v in paths_used().items() if v > before[k]}
    assert taken == {"fused_cpu" if path == "fused" else "quantized_matmul": len(model.layers)}
    spread = want.std()
    error = np.abs(got - want).max() / spread
    assert error < 2e-2, error
    for layer in model.layers:
        monkeypatch.setattr(layer.self_attn, "attn_logit_softcapping", 1e9)
    uncapped = np.abs(np.array(model(tokens)) - want).max() / spread
    assert uncapped > 20 * error, (uncapped, error)  # measured: ~6e-3 against ~6


def test_the_prologue_takes_qwen3_s_head_norms_and_no_other_norm():
    """``head_norms``: Qwen3's two RMS norms as one array of weights (the queries' first) and
    their epsilon, Gemma 3's as the 1 + weight it norms by; None for an attention without
    them; False (the layer keeps mlx-lm's operations) for norms the kernel cannot apply:
    another kind, epsilon or width."""
    from types import SimpleNamespace

    from mlx_lm.models import gemma3_text

    q_norm, k_norm = nn.RMSNorm(64, eps=1e-6), nn.RMSNorm(64, eps=1e-6)
    q_norm.weight, k_norm.weight = mx.arange(64) / 64, mx.arange(64) / 32
    norms = mlx_adapter.head_norms(SimpleNamespace(q_norm=q_norm, k_norm=k_norm), 64)
    assert norms.eps == 1e-6
    assert mx.array_equal(norms.weights, mx.concatenate([q_norm.weight, k_norm.weight]))
    assert mlx_adapter.head_norms(SimpleNamespace(), 64) is None
    gemma = gemma3_text.RMSNorm(64, eps=1e-6)
    gemma.weight = mx.arange(64) / 16
    norms = mlx_adapter.head_norms(SimpleNamespace(q_norm=gemma, k_norm=q_norm), 64)
    assert mx.array_equal(norms.weights, mx.concatenate([1.0 + gemma.weight, q_norm.weight]))
    other = nn.RMSNorm(64, eps=1e-5)
    for q, k, dim in ((q_norm, other, 64), (q_norm, nn.LayerNorm(64), 64), (q_norm, k_norm, 128)):
        assert mlx_adapter.head_norms(SimpleNamespace(q_norm=q, k_norm=k), dim) is False
