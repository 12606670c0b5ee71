"""GGUF import: the embedded model's files, its tokenizer against llama.cpp's, a synthetic model."""

import json
import os
import struct

import mlx.core as mx
import pytest
from helpers import DATA

from agentkv.errors import ModelImportError
from agentkv.model import gguf
from agentkv.model.generation_config import (
    GENERATION_CONFIG,
    GenerationDefaults,
    read_generation_defaults,
)
from agentkv.model.gguf import import_gguf
from agentkv.model.load import ensure_embedded_model, weights_identity


def test_embedded_import_writes_an_mlx_lm_llama_directory():
    path = ensure_embedded_model()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (
        30,
        3,
        64,
    )
    weights = mx.load(str(path / "model.safetensors"))  # the default: 4-bit as shipped
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert weights["model.layers.0.self_attn.q_proj.scales"].shape == (576, 576 // 32)
    assert "lm_head.weight" not in weights
    assert ensure_embedded_model() == path  # the second call reuses the import
    dense = mx.load(str(ensure_embedded_model("float32") / "model.safetensors"))
    assert dense["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32


def test_rebuilt_tokenizer_matches_llama_cpp():
    """Our tokenizer, rebuilt from the GGUF's vocabulary, against llama.cpp's reading of the
    same file (recorded by tests/scripts/record_llama_cpp_tokens.py)."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    recorded = json.loads((DATA / "llama_cpp_tokens.json").read_text())["samples"]
    assert len(recorded) >= 12
    for sample in recorded:
        text, expected = sample["text"], sample["ids"]
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text


def _tiny_llama_gguf(path, architecture="llama", **metadata):
    """A 2-layer llama with random float32 weights and a byte-level BPE vocabulary (and
    ``metadata`` besides)."""
    from agentkv.text.tokens import _unicode_to_byte

    byte_chars = sorted(_unicode_to_byte(), key=_unicode_to_byte().get)
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars + ["Ġt", "he", "Ġthe"]
    vocab, hidden, heads, kv_heads, ffn = len(tokens), 128, 2, 1, 128
    mx.random.seed(0)

    def rnd(*shape):
        return mx.random.normal(shape) * 0.05

    weights = {"token_embd.weight": rnd(vocab, hidden), "output_norm.weight": mx.ones((hidden,))}
    for i in range(2):
        weights |= {
            f"blk.{i}.attn_q.weight": rnd(hidden, hidden),
            f"blk.{i}.attn_k.weight": rnd(kv_heads * 64, hidden),
            f"blk.{i}.attn_v.weight": rnd(kv_heads * 64, hidden),
            f"blk.{i}.attn_output.weight": rnd(hidden, hidden),
            f"blk.{i}.ffn_gate.weight": rnd(ffn, hidden),
            f"blk.{i}.ffn_up.weight": rnd(ffn, hidden),
            f"blk.{i}.ffn_down.weight": rnd(hidden, ffn),
            f"blk.{i}.attn_norm.weight": mx.ones((hidden,)),
            f"blk.{i}.ffn_norm.weight": mx.ones((hidden,)),
        }
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        **metadata,
        "general.architecture": architecture,
        "llama.embedding_length": u32(hidden),
        "llama.block_count": u32(2),
        "llama.feed_forward_length": u32(ffn),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.context_length": u32(512),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (vocab - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    }
    mx.save_gguf(str(path), weights, metadata)
    return path


def test_a_synthetic_llama_gguf_imports_and_serves(tmp_path):
    from agentkv import Engine

    gguf = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    result = import_gguf(gguf, tmp_path / "tiny-model", weight_dtype="float32")
    assert not result.reused
    assert import_gguf(gguf, tmp_path / "tiny-model", weight_dtype="float32").reused
    with Engine(model=str(result.path), cache_dir=tmp_path / "kv", warmup=False) as eng:
        assert (eng.spec.num_layers, eng.spec.kv_heads, eng.spec.key_head_dim) == (2, 1, 64)
        assert eng.token_text.encode(" the").ids == [
            eng.loaded.tokenizer.convert_tokens_to_ids("Ġthe")
        ]
        r = eng.chat("tiny", [{"role": "user", "content": "the the"}], max_tokens=5)
        assert r.stats.generated_tokens >= 1
        again = eng.chat(
            "tiny",
            [
                {"role": "user", "content": "the the"},
                {"role": "assistant", "content": r.text},
                {"role": "user", "content": "more"},
            ],
            max_tokens=3,
        )
        assert again.stats.cache == "hot"


def test_the_gguf_s_sampling_metadata_becomes_the_model_s_generation_config(tmp_path):
    f32 = lambda v: mx.array(v, dtype=mx.float32)  # noqa: E731
    sampling = {"general.sampling.temp": f32(0.6), "general.sampling.top_p": f32(0.95)}
    gguf = _tiny_llama_gguf(tmp_path / "sampled.gguf", **sampling)
    dest = import_gguf(gguf, tmp_path / "sampled", weight_dtype="float32").path
    defaults = read_generation_defaults(dest)
    assert (defaults.temperature, defaults.top_p, defaults.source) == pytest.approx(
        (0.6, 0.95, GENERATION_CONFIG)
    )
    plain = import_gguf(_tiny_llama_gguf(tmp_path / "plain.gguf"), tmp_path / "plain").path
    assert not (plain / GENERATION_CONFIG).exists()  # the GGUF names no sampling
    assert read_generation_defaults(plain) == GenerationDefaults()


def test_a_start_reuses_an_import_without_reading_its_unchanged_file(tmp_path, monkeypatch):
    """The import records the file's size, mtime and inode: while they hold, a start reuses
    it without hashing the file; a touched file is hashed once more (the same bytes: reused,
    its new stat recorded); new bytes import again. The weights' identity (what stored
    caches are kept under) never includes the stat, so a record from before it had one
    names the same weights."""
    src = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    dest = tmp_path / "tiny-model"
    first = import_gguf(src, dest, weight_dtype="float32")
    identity = weights_identity(dest)
    record = json.loads((dest / gguf.IMPORT_INFO_FILE).read_text())
    assert record[gguf.SOURCE_STAT]["size"] == src.stat().st_size
    hashed = []
    real = gguf.file_sha256
    monkeypatch.setattr(gguf, "file_sha256", lambda path: hashed.append(path) or real(path))

    again = import_gguf(src, dest, weight_dtype="float32")
    assert again.reused and again.source_sha256 == first.source_sha256 and hashed == []
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, the same bytes
    assert import_gguf(src, dest, weight_dtype="float32").reused and len(hashed) == 1
    assert import_gguf(src, dest, weight_dtype="float32").reused and len(hashed) == 1
    assert weights_identity(dest) == identity
    del record[gguf.SOURCE_STAT]  # a record written before the stat was kept
    (dest / gguf.IMPORT_INFO_FILE).write_text(json.dumps(record))
    assert weights_identity(dest) == identity
    assert import_gguf(src, dest, weight_dtype="float32").reused and len(hashed) == 2

    with open(src, "r+b") as f:  # other bytes of the same size: a new import
        f.seek(-4, os.SEEK_END)
        tail = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    changed = import_gguf(src, dest, weight_dtype="float32")
    assert not changed.reused and changed.source_sha256 != first.source_sha256
    assert weights_identity(dest) != identity


def test_import_errors_are_clear(tmp_path):
    with pytest.raises(ModelImportError, match="not found"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    gpt2 = _tiny_llama_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ModelImportError, match="architecture 'gpt2'"):
        import_gguf(gpt2, tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="not an agentkv import"):
        import_gguf(_tiny_llama_gguf(tmp_path / "ok.gguf"), tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    (tmp_path / "garbage.gguf").write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ModelImportError, match="cannot read"):
        import_gguf(tmp_path / "garbage.gguf", tmp_path / "out2")
    # a valid GGUF (version 3) with no metadata and no tensors
    (tmp_path / "empty.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ModelImportError, match="architecture None"):
        import_gguf(tmp_path / "empty.gguf", tmp_path / "out3")
