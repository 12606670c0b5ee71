"""Weights as shipped: the embedded GGUF's Q4_1/Q8_0 tensors imported as MLX affine weights
bit for bit (against the GGUF's own dequantization, ``gguf.quants``), and a quantized model on
CPU runs its 4/8-bit layers through agentkv's kernel with float32 activations."""

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import quants

from agentkv import mlx_adapter
from agentkv.model.gguf_arch import ARCHITECTURES
from agentkv.model.load import CPU_QMM_ID, embedded_gguf_path, ensure_embedded_model, load_model


def test_the_quantized_import_is_the_gguf_bit_for_bit():
    weights = mx.load(str(ensure_embedded_model("quantized") / "model.safetensors"))
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    checked = set()
    for t in reader.tensors:
        first_or_last = t.name.startswith(("blk.0.", "blk.29.", "token_embd"))
        if t.tensor_type.name not in ("Q4_1", "Q8_0") or not first_or_last:
            continue
        theirs = quants.dequantize(t.data, t.tensor_type)
        stem = ARCHITECTURES["llama"].mlx_name(t.name).removesuffix(".weight")
        q, s, b = (weights[f"{stem}.{part}"] for part in ("weight", "scales", "biases"))
        bits = q.shape[-1] // s.shape[-1]  # codes per group of 32 -> bits
        ours = mx.dequantize(
            q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits
        )
        np.testing.assert_array_equal(np.array(ours), theirs)
        checked.add(t.tensor_type.name)
    assert checked == {"Q4_1", "Q8_0"}  # the tied embedding / output head is the Q8_0 one


@pytest.fixture(scope="module")
def quantized():
    return load_model(weights="quantized")


def test_a_quantized_model_runs_its_layers_on_agentkv_s_kernel(quantized):
    kinds = {type(m) for _, m in quantized.model.named_modules()}
    assert mlx_adapter.CPUQuantizedLinear in kinds and mlx_adapter.CPUQuantizedEmbedding in kinds
    assert nn.QuantizedLinear not in kinds and nn.Linear not in kinds
    assert quantized.spec.weights_id.endswith(CPU_QMM_ID)
    norm = quantized.model.model.norm.weight
    assert norm.dtype == mx.float32
    head = quantized.model.model.embed_tokens
    assert head.bits == 8 and head.scales.dtype == mx.float16  # read as stored
    assert head.weight.dtype == mx.uint8  # packed for the kernel (mlx_adapter.pack_quantized)


def test_its_logits_match_float_activations_on_the_same_weights(quantized):
    tok = quantized.tokenizer
    ids = mx.array([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    ours = quantized.model(ids)[0, -1]
    raw, _ = mlx_adapter.load(str(quantized.path))  # the same weights through MLX's own kernel
    mlx_adapter.float32_activations(raw)
    assert {type(m) for _, m in raw.named_modules()} >= {nn.QuantizedLinear, nn.QuantizedEmbedding}
    theirs = raw(ids)[0, -1]
    assert int(mx.argmax(ours)) == int(mx.argmax(theirs))
    np.testing.assert_allclose(
        np.array(ours), np.array(theirs), atol=5e-3 * float(mx.abs(theirs).max())
    )
    assert tok.decode([int(mx.argmax(ours))]).strip() == "Rome"


def test_float32_weights_are_still_there_for_comparison():
    loaded = load_model(weights="float32")
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert mlx_adapter.CPUQuantizedLinear not in kinds
    assert not loaded.spec.weights_id.endswith(CPU_QMM_ID)
    assert loaded.model.model.embed_tokens.weight.dtype == mx.float32


def test_an_unknown_weights_mode_is_refused():
    from agentkv.errors import ModelImportError

    with pytest.raises(ModelImportError, match="weights must be one of quantized, float32"):
        load_model(weights="int3")


def test_the_quantized_model_s_wide_layers_ship_with_the_package(quantized):
    """No 20 s calibration pass on first use with 4-bit weights either."""
    from dataclasses import replace

    from agentkv.format.choice import choose_kv_quant
    from agentkv.model import wide_layers

    spec = quantized.spec
    base = replace(choose_kv_quant(spec, key_bits=4, value_bits=4, group_size=None), wide_layers=())
    assert wide_layers._remembered(spec, base) == (19, 20)
