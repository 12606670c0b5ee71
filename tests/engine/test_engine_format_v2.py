"""KV format 2 (per-channel rotated keys) through the engine on the embedded model: a restart
resumes exactly where a hot agent stands (the float16 tail of the filling channel group is
saved in the manifest), and agents stored in format 1 convert once."""

import json
import struct

import pytest

from agentkv.errors import CacheFormatError
from agentkv.store.format import MANIFEST_NAME, encode_manifest

# The embedded model's default format: 8-bit keys in its two wide layers (the shipped
# calibration; test_wide_layers.py measures it again).
DEFAULT = "q4.v2+k8@19,20"  # the default (4-bit) weights; float32 weights: @18,19
PROMPT = [
    {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
    {"role": "user", "content": "What is the capital of France, and what river runs through it?"},
]


def follow_up(reply: str) -> list[dict]:
    return PROMPT + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And of Italy?"},
    ]


@pytest.mark.slow
def test_a_restart_resumes_format_2_exactly_as_the_hot_agent(fresh_engine, tmp_path):
    hot = fresh_engine(cache_dir=tmp_path / "hot", kv_format=2)
    assert hot.quant.label == DEFAULT
    first = hot.chat("v2", PROMPT, max_tokens=12)
    assert first.stats.kv_format == DEFAULT
    stored = first.stats.prompt_tokens + first.stats.generated_tokens - 1
    assert stored % 64  # the last channel group is still filling: its keys are the tail
    second_hot = hot.chat("v2", follow_up(first.text), max_tokens=12)
    assert second_hot.stats.cache == "hot"

    before = fresh_engine(cache_dir=tmp_path / "warm", kv_format=2)
    assert before.chat("v2", PROMPT, max_tokens=12).text == first.text
    before.close()
    after = fresh_engine(cache_dir=tmp_path / "warm", kv_format=2)
    manifest, _ = after.store.read_manifest("v2")
    assert manifest.quant.label == DEFAULT and manifest.tail.shape[2] == stored % 64
    second_warm = after.chat("v2", follow_up(first.text), max_tokens=12)
    assert second_warm.stats.cache == "warm"
    assert second_warm.stats.reused_tokens == stored
    assert second_warm.text == second_hot.text


@pytest.mark.slow
def test_format_1_agents_convert_once_and_format_2_ones_are_never_misread(fresh_engine, tmp_path):
    v1 = fresh_engine(cache_dir=tmp_path / "kv", kv_format=1)
    first = v1.chat("conv", PROMPT, max_tokens=8)
    v1.close()
    v2 = fresh_engine(cache_dir=tmp_path / "kv", kv_format=2)
    second = v2.chat("conv", follow_up(first.text), max_tokens=8)
    assert second.stats.cache == "warm"
    assert f"converted from the stored q4 KV format to {DEFAULT}" in second.stats.reuse_note
    v2.flush()
    manifest, _ = v2.store.read_manifest("conv")
    assert manifest.quant.label == DEFAULT
    v2.close()
    history = follow_up(first.text) + [{"role": "assistant", "content": second.text}]
    again = fresh_engine(cache_dir=tmp_path / "kv", kv_format=2).chat(
        "conv", history + [{"role": "user", "content": "And Spain?"}], max_tokens=2
    )
    assert again.stats.cache == "warm" and again.stats.reuse_note is None
    # An engine in format 1 converts format 2 back (dequantized, rotated back) once.
    history += [
        {"role": "user", "content": "And Spain?"},
        {"role": "assistant", "content": again.text},
        {"role": "user", "content": "Thanks."},
    ]
    back = fresh_engine(cache_dir=tmp_path / "kv", kv_format=1).chat("conv", history, max_tokens=2)
    assert back.stats.cache == "warm"
    assert f"converted from the stored {DEFAULT} KV format to q4" in back.stats.reuse_note


@pytest.mark.slow
def test_a_restart_cut_back_into_the_last_complete_group_matches_hot(fresh_engine, tmp_path):
    """An edited last message cuts the stored state back into its last complete channel
    group: in memory its keys come back exactly (the slot's float16 copy of that group), and
    after a restart too (the manifest keeps that copy, ``prev``), so warm == hot."""
    system = {"role": "system", "content": " ".join(["Answer briefly and plainly."] * 54)}
    rivers = " ".join(f"River {i} flows north." for i in range(6))
    asked = [system, {"role": "user", "content": f"Of these, which is longest? {rivers}"}]
    edited = [system, {"role": "user", "content": f"Of these, which is shortest? {rivers}"}]
    hot = fresh_engine(cache_dir=tmp_path / "hot", kv_format=2)
    first = hot.chat("v2", asked, max_tokens=12)
    stored = first.stats.prompt_tokens + first.stats.generated_tokens - 1
    second_hot = hot.chat("v2", edited, max_tokens=12)
    cut = second_hot.stats.reused_tokens
    assert stored // 64 * 64 - 64 < cut < stored // 64 * 64  # inside the last complete group

    before = fresh_engine(cache_dir=tmp_path / "warm", kv_format=2)
    assert before.chat("v2", asked, max_tokens=12).text == first.text
    before.close()
    after = fresh_engine(cache_dir=tmp_path / "warm", kv_format=2)
    manifest, _ = after.store.read_manifest("v2")
    assert manifest.prev is not None and manifest.prev.shape[2] == 64
    second_warm = after.chat("v2", edited, max_tokens=12)
    assert second_warm.stats.cache == "warm" and second_warm.stats.reused_tokens == cut
    assert second_warm.tokens == second_hot.tokens
    # A damaged copy is refused by its checksum (the state goes to quarantine: cold, not wrong)
    after.close()  # its last save written
    manifest, _ = after.store.read_manifest("v2")
    path = after.store.agent_dir("v2") / MANIFEST_NAME
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8 : 8 + length])["prev"]["data_offsets"]
    data[8 + length + begin + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="prev checksum"):
        after.store.read_manifest("v2")
    manifest.prev = manifest.prev[:, :, :10]
    with pytest.raises(ValueError, match="last channel group's keys"):
        encode_manifest(manifest)


@pytest.mark.slow
def test_a_cut_past_the_last_complete_group_feeds_that_group_again(fresh_engine, tmp_path):
    """An edited message cuts the stored state back into a complete channel group whose
    float16 keys are gone (only the last complete group's are kept): the turn cuts at that
    group's start and feeds the rest again, never dequantized keys; so hot, warm after a
    restart and a fresh agent of the edited conversation give the same tokens."""
    system = {"role": "system", "content": " ".join(["Answer briefly and plainly."] * 54)}
    rivers = " ".join(f"River {i} flows north, then east." for i in range(12))
    asked = [system, {"role": "user", "content": f"Of these, which is longest? {rivers}"}]
    edited = [system, {"role": "user", "content": f"Which is the shortest? {rivers}"}]
    hot = fresh_engine(cache_dir=tmp_path / "hot")
    first = hot.chat("cut", asked, max_tokens=12)
    stored = first.stats.prompt_tokens + first.stats.generated_tokens - 1
    second_hot = hot.chat("cut", edited, max_tokens=12)
    kept = second_hot.stats.reused_tokens
    assert second_hot.stats.cache == "hot" and kept % 64 == 0  # cut at a group's start
    assert kept < stored // 64 * 64 - 64  # before the last complete group
    alone = fresh_engine(cache_dir=tmp_path / "alone").chat("fresh", edited, max_tokens=12)
    assert second_hot.tokens == alone.tokens

    before = fresh_engine(cache_dir=tmp_path / "warm")
    assert before.chat("cut", asked, max_tokens=12).tokens == first.tokens
    before.close()
    second_warm = fresh_engine(cache_dir=tmp_path / "warm").chat("cut", edited, max_tokens=12)
    assert second_warm.stats.cache == "warm" and second_warm.stats.reused_tokens == kept
    assert second_warm.tokens == second_hot.tokens
