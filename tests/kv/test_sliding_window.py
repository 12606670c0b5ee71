"""Sliding-window layers on a real mlx-lm architecture (a tiny random Gemma 3).

Its sliding layers keep, and reload, only the blocks their window reaches;
a turn resumed from disk must still equal the same turn continued in memory.
"""

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from agentkv.format.spec import LayerKind
from agentkv.model.load import ensure_embedded_model

WINDOW = 128


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from mlx_lm.models import gemma3_text

    config = {
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "head_dim": 64,
        "num_key_value_heads": 1,
        "vocab_size": 49152,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 64,
        "rms_norm_eps": 1e-6,
    }
    mx.random.seed(7)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    path = tmp_path_factory.mktemp("tiny-gemma")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    embedded = ensure_embedded_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(embedded / name, path / name)
    return path


def long_prompt(i: int) -> str:
    return "".join(f"Line {k} of the log says the job {i} finished step {k}. " for k in range(40))


def test_sliding_layers_reload_only_their_window_and_resume_exactly(tiny_gemma, tmp_path):
    from agentkv import Engine

    first = [{"role": "user", "content": long_prompt(1)}]
    with Engine(model=str(tiny_gemma), cache_dir=tmp_path / "a", warmup=False) as eng:
        kinds = [layer.kind for layer in eng.spec.layers]
        assert kinds == [LayerKind.SLIDING, LayerKind.FULL] * 2
        r1 = eng.chat("slider", first, max_tokens=8)
        assert r1.stats.prompt_tokens > 2 * 256
        eng.flush()
        shutil.copytree(tmp_path / "a", tmp_path / "b")
        second = first + [
            {"role": "assistant", "content": r1.text},
            {"role": "user", "content": "What happened to job 1?"},
        ]
        hot = eng.chat("slider", second, max_tokens=16)
        assert hot.stats.cache == "hot"
        hot_table = eng.residency.get("slider").table
        hot_window = (hot_table.window_from, hot_table.length)
        hot_rows = [eng.pool.blocks.records[b].window_rows for b in hot_table.blocks]
        full_bytes = len(hot_table.blocks) * eng.pool.block_bytes
        assert 0 < eng.resident_bytes() < full_bytes  # the sliding rows past the window went
    with Engine(model=str(tiny_gemma), cache_dir=tmp_path / "b", warmup=False) as eng:
        warm = eng.chat("slider", second, max_tokens=16)
        table = eng.residency.get("slider").table
        assert warm.stats.cache == "warm" and warm.stats.reused_tokens == hot.stats.reused_tokens
        assert (table.window_from, table.length) == hot_window
        assert [eng.pool.blocks.records[b].window_rows for b in table.blocks] == hot_rows
    assert warm.tokens == hot.tokens
    # The sliding layers hold only the blocks their window reaches; the full layers all.
    assert hot_window[0] > 0 and hot_rows[: hot_window[0]] == [False] * hot_window[0]
    assert all(hot_rows[hot_window[0] :])
