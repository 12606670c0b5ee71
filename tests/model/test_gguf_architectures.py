"""GGUF architectures (``model.gguf_arch``): for each, a tiny random-weight model built with
mlx-lm's own model class is written as a GGUF file the way llama.cpp's converter writes it
(the ``gguf`` package's writer and its own tensor-name map; llama's Q and K rows permuted
for interleaved rotary embeddings, Gemma's norms stored as ``1 + w``), imported, loaded by
agentkv, and must give the float model's logits (float32 weights: within 1e-4 of the
logits' spread). The imported directory is an mlx-lm directory of the same model class,
so everything tests/model/test_architectures.py runs on those classes holds for it."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from agentkv import Engine
from agentkv.engine.engine import adds_bos
from agentkv.errors import ModelImportError
from agentkv.model.gguf import import_gguf, read_tensor_report
from agentkv.model.gguf_tensors import read_gguf
from agentkv.model.load import embedded_gguf_path, load_model

COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,  # the embedded tokenizer's
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# mlx-lm model_type -> (GGUF architecture, the config beyond COMMON)
CASES = {
    "llama": (
        "llama",
        {
            "head_dim": 16,
            "rope_traditional": False,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "gemma2": (
        "gemma2",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 5.0,  # low enough to bite on random weights
            "final_logit_softcapping": 3.0,
            "sliding_window": 8,  # every even layer's (mlx-lm's class has none)
            "tie_word_embeddings": True,
        },
    ),
    "gemma3_text": (
        "gemma3",
        {
            "num_hidden_layers": 6,  # llama.cpp's Gemma 3: every sixth layer global
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "tie_word_embeddings": True,
        },
    ),
    "phi3": ("phi3", {}),
}
TOKENS = [1, 17, 305, 92, 4000, 12, 77, 8, 19, 2024, 5, 300, 41]


@pytest.fixture(scope="module")
def tokenizer_metadata() -> dict:
    """The embedded GGUF's tokenizer fields (byte-level BPE of 49,152 tokens)."""
    meta = read_gguf(embedded_gguf_path()).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


def reference_model(model_type: str, config: dict, seed: int):
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": model_type, **config}))
    mx.random.seed(seed)
    # every parameter random (norms around 1, biases too), so a misplaced tensor shows
    model.update(
        tree_map(lambda w: mx.random.normal(w.shape) * 0.2 + (w == 1) * 1.0, model.parameters())
    )
    mx.eval(model.parameters())
    return model


def random_k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K/Q5_K blocks [rows, bytes a row]: any codes and 6-bit sub-scales, float16
    d and dmin of either sign, small enough that the weights stay near +-0.1."""
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for at in (0, 2):
        d = rng.uniform(1e-5, 1.5e-4, len(blocks)) * rng.choice([-1, 1], len(blocks))
        blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(
    path: Path,
    arch: str,
    config: dict,
    model,
    tok: dict,
    rope_freqs: np.ndarray | None = None,
    k_quants: tuple[str, ...] = (),
) -> None:
    """``model`` as llama.cpp's converter writes it (float32 tensors; ``rope_freqs``: its
    Llama 3 rope factors tensor); with ``k_quants``, every matrix whose rows are a multiple
    of 256 as random blocks of those types in turn instead."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if "sliding_window" in config:
        w.add_sliding_window(config["sliding_window"])
    if "attn_logit_softcapping" in config:
        w.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("rope_scaling", {}).get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(config["rope_scaling"]["factor"])
    w.add_tokenizer_model(tok.get("tokenizer.ggml.model", "gpt2"))
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tok["tokenizer.ggml.tokens"])
    w.add_token_types(tok["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in tok:
        w.add_token_merges(tok["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in tok:  # a SentencePiece vocabulary
        w.add_token_scores(tok["tokenizer.ggml.scores"])
        w.add_unk_token_id(tok["tokenizer.ggml.unknown_token_id"])
        w.add_add_space_prefix(True)
    w.add_bos_token_id(tok["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tok["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(tok["tokenizer.chat_template"])
    for name, value in tree_flatten(model.parameters()):
        data = np.array(value, dtype=np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads  # llama.cpp's LlamaModel.permute
            data = data.reshape(n, 2, data.shape[0] // n // 2, -1).swapaxes(1, 2)
            data = data.reshape(-1, config["hidden_size"])
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma models: its RMSNorm multiplies by the weight
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if k_quants and data.ndim == 2 and data.shape[1] % 256 == 0:
            kind = k_quants[len(w.tensors[0]) % len(k_quants)] if w.tensors else k_quants[0]
            rng = np.random.default_rng(len(gguf_name))
            blocks = random_k_blocks(kind, *data.shape, rng)
            w.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        w.add_tensor(gguf_name, data)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ~8 s each here: llama and qwen3 in the quick suite, the others with the slow tests
QUICK = ("llama", "qwen3")


@pytest.mark.parametrize(
    "model_type",
    [t if t in QUICK else pytest.param(t, marks=pytest.mark.slow) for t in sorted(CASES)],
)
def test_a_gguf_of_each_architecture_imports_as_its_mlx_lm_model(
    model_type, tmp_path, tokenizer_metadata
):
    arch, extra = CASES[model_type]
    config = {**COMMON, **extra}
    model = reference_model(model_type, config, seed=len(model_type))
    tokens = mx.array([TOKENS])
    want = np.array(model(tokens))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, config, model, tokenizer_metadata)

    dest = import_gguf(path, tmp_path / "model", weight_dtype="float32").path
    assert {r["type"] for r in read_tensor_report(dest)} == {"F32"}
    loaded = load_model(dest, weights="float32")
    assert type(loaded.model).__module__ == f"mlx_lm.models.{model_type}"
    windows = {layer.window for layer in loaded.spec.layers} - {None}
    assert windows == ({config["sliding_window"]} if "sliding_window" in config else set())
    got = np.array(loaded.model(tokens))
    spread = want.std()
    assert np.abs(got - want).max() <= 1e-4 * spread, np.abs(got - want).max() / spread


def converter_rope_factors(scaling: dict, base: float, dims: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel) for a "llama3" rope scaling."""
    old = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    factors = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dims))
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, np.float32)


def test_llama_3_rope_factors_become_the_llama3_rope_scaling(tmp_path, tokenizer_metadata):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,  # Llama 3.2's
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = {**COMMON, "head_dim": 16, "rope_theta": 500000.0, "rope_scaling": scaling}
    model = reference_model("llama", config, seed=4)
    factors = converter_rope_factors(scaling, 500000.0, 16)
    assert len(set(factors.tolist())) >= 3  # every band: kept, smoothed, scaled
    write_gguf(tmp_path / "l3.gguf", "llama", config, model, tokenizer_metadata, factors)
    dest = import_gguf(tmp_path / "l3.gguf", tmp_path / "l3", weight_dtype="float32").path
    assert json.loads((dest / "config.json").read_text())["rope_scaling"] == scaling
    loaded = load_model(dest, weights="float32")
    periods = 500000.0 ** (np.arange(0, 16, 2) / 16)
    rope = loaded.model.layers[0].self_attn.rope
    np.testing.assert_allclose(np.array(rope._freqs), periods * factors, rtol=1e-5)
    tokens = mx.array([TOKENS])
    want = np.array(model(tokens))
    assert np.abs(np.array(loaded.model(tokens)) - want).max() <= 1e-4 * want.std()

    write_gguf(tmp_path / "odd.gguf", "llama", config, model, tokenizer_metadata, factors * 1.5)
    with pytest.raises(ModelImportError, match="rope frequency factors that no Llama 3"):
        import_gguf(tmp_path / "odd.gguf", tmp_path / "odd", weight_dtype="float32")


def test_gemma_norms_lose_their_offset_before_float16(tmp_path, tokenizer_metadata):
    """llama.cpp stores a Gemma norm as 1 + w; a quantized import keeps norms in float16,
    and w must be rounded to float16 itself, not 1 + w (whose float16 step is 4-8x w's)."""
    config = {**COMMON, **CASES["gemma3_text"][1]}
    model = reference_model("gemma3_text", config, seed=2)
    write_gguf(tmp_path / "g.gguf", "gemma3", config, model, tokenizer_metadata)
    dest = import_gguf(tmp_path / "g.gguf", tmp_path / "g", weight_dtype="quantized").path
    stored = mx.load(str(dest / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    norms = [n for n in params if n.endswith("norm.weight")]
    assert len(norms) == 6 * 6 + 1  # four a block, q and k norms, the final norm
    for name in norms:
        assert stored[name].dtype == mx.float16
        want = np.array(params[name]).astype(np.float16)
        assert (np.array(stored[name]) == want).mean() >= 0.99, name


def test_k_quant_scales_run_in_two_levels_with_the_bits_of_float32_ones(
    tmp_path, tokenizer_metadata, caplog
):
    """A model whose every matrix is Q4_K or Q5_K (rows of 256): the import keeps each
    super-block's factors, and agentkv's CPU kernel holds those tensors' scales and biases in
    two levels (1.03x the file's bytes, not 1.33x); the logits are bit for bit those of the
    same import with float32 scales (its factors file removed, as in an import made before
    it was written: the load says how to import again), through the linears, the embedding's
    rows and its output projection."""
    from agentkv.model.gguf import SUPER_SCALES_FILE

    config = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    model = reference_model("llama", config, seed=8)
    path = tmp_path / "k.gguf"
    write_gguf(path, "llama", config, model, tokenizer_metadata, k_quants=("Q4_K", "Q5_K"))
    dest = import_gguf(path, tmp_path / "k", weight_dtype="quantized").path
    report = {r["type"]: r for r in read_tensor_report(dest)}
    assert set(report) >= {"Q4_K", "Q5_K"}
    for kind in ("Q4_K", "Q5_K"):
        assert report[kind]["resident_bytes"] <= 1.03 * report[kind]["file_bytes"], report

    tokens = mx.array([TOKENS])
    two_level = load_model(dest, weights="quantized")
    inner = two_level.model.model
    held = [inner.embed_tokens, inner.layers[0].self_attn.q_proj, inner.layers[1].mlp.down_proj]
    assert all(m["scales"].dtype == m["biases"].dtype == mx.uint8 for m in held)
    got = np.array(two_level.model(tokens))
    assert np.isfinite(got).all() and got.std() > 0
    del two_level
    (dest / SUPER_SCALES_FILE).unlink()  # as an import made before the file was written
    with caplog.at_level("WARNING", logger="agentkv.model"):
        float32 = load_model(dest, weights="quantized")
    assert "models import --force" in caplog.text
    assert float32.model.model.embed_tokens["scales"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(float32.model(tokens)), got)


def test_an_imported_qwen3_gguf_serves_turns_through_agentkv_caches(tmp_path, tokenizer_metadata):
    config = {**COMMON, **CASES["qwen3"][1]}
    model = reference_model("qwen3", config, seed=11)
    write_gguf(tmp_path / "q.gguf", "qwen3", config, model, tokenizer_metadata)
    with Engine(model=str(tmp_path / "q.gguf"), cache_dir=tmp_path / "kv", warmup=False) as eng:
        assert eng.spec.model_type == "qwen3" and eng.spec.num_layers == 2
        messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
        first = eng.chat("a", messages, max_tokens=6)
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And three more."},
        ]
        again = eng.chat("a", messages, max_tokens=4)
        assert again.stats.cache == "hot" and again.stats.generated_tokens >= 1


def test_unknown_architectures_and_yarn_are_refused_in_one_line(tmp_path, tokenizer_metadata):
    for arch in ("mamba",):
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        w.add_block_count(1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelImportError, match=f"architecture '{arch}' is not supported") as e:
            import_gguf(tmp_path / f"{arch}.gguf", tmp_path / arch)
        assert "\n" not in str(e.value) and "qwen3" in str(e.value)
    w = gguf.GGUFWriter(str(tmp_path / "q8_1.gguf"), "llama")  # llama.cpp's activation type
    w.add_tensor(
        "blk.0.attn_q.weight",
        np.zeros((4, 8 * 40), np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.Q8_1,
    )
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(ModelImportError, match=r"blk\.0\.attn_q\.weight is of GGML type Q8_1"):
        import_gguf(tmp_path / "q8_1.gguf", tmp_path / "q8_1")
    assert not (tmp_path / "q8_1").exists()  # refused before anything is written
    w = gguf.GGUFWriter(str(tmp_path / "yarn.gguf"), "qwen2")
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(ModelImportError, match="rope.scaling.type 'yarn' is not supported"):
        import_gguf(tmp_path / "yarn.gguf", tmp_path / "yarn")


def sentencepiece_vocabulary(tmp_path: Path):
    """A SentencePiece BPE model trained here the way Llama 2's was set up (byte fallback,
    digits split, spaces kept as they are), and its vocabulary as llama.cpp's converter
    writes it into a GGUF (pieces, scores, token types; model "llama")."""
    import io
    from pydoc_data.topics import topics

    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(topics[k] for k in sorted(topics))[:300_000])
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_writer=model, vocab_size=800, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.vocab_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
             for i in range(n)]  # fmt: skip
    return sp, {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }


def test_a_sentencepiece_gguf_imports_and_tokenizes_as_sentencepiece(tmp_path):
    """A llama GGUF with a SentencePiece vocabulary (tokenizer model "llama": Llama 2,
    Mistral, Gemma ship so) imports; its tokenizer, rebuilt by transformers' GGUF converter,
    gives SentencePiece's own tokens on prose, code, numbers, newlines, tabs and text it
    must spell in bytes, BOS first as llama.cpp adds it; the engine runs a turn on it.
    (Where they part: a run of spaces at the very start of a text, documented.)"""
    from transformers import AutoTokenizer

    sp, tok = sentencepiece_vocabulary(tmp_path)
    config = {**COMMON, "vocab_size": sp.vocab_size()}
    model = reference_model("llama", config, seed=3)
    write_gguf(tmp_path / "spm.gguf", "llama", config, model, tok)
    dest = import_gguf(tmp_path / "spm.gguf", tmp_path / "model", weight_dtype="float32").path
    hf = AutoTokenizer.from_pretrained(str(dest))
    assert adds_bos(hf) and hf.bos_token == "<s>"
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "def f(x):\n\treturn x ** 2  # squares, 12345 and 3.14159",
        "Ünïcödé text, 日本語 and an emoji 🙂 spelled in bytes.",
        "line one\n\n\nline four   with  spaces",
    ]
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert hf.encode(text) == [1, *sp.encode(text)], text
        assert hf.decode(sp.encode(text)) == text
    # (head dim 16: no KV group fits it, so float16 KV)
    with Engine(model=str(dest), cache_dir=tmp_path / "kv", warmup=False, kv_bits=16) as eng:
        r = eng.generate("spm", texts[1], max_tokens=4)
    assert r.stats.prompt_tokens == 1 + len(sp.encode(texts[1])) and len(r.tokens) == 4
