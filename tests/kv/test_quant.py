import pytest

from agentkv.errors import InvalidRequestError
from agentkv.format.quant import V1, V2, KVQuant

# The embedded model: 30 layers, 3 KV heads, head dim 64.
GEOMETRY = dict(layers=30, heads=3, key_dim=64, value_dim=64)


def test_bytes_per_token_of_the_embedded_geometry():
    assert KVQuant(16, 16).bytes_per_token(**GEOMETRY) == 23_040
    assert KVQuant(4, 4, 64).bytes_per_token(**GEOMETRY) == 6_480
    assert KVQuant(8, 8, 64).bytes_per_token(**GEOMETRY) == 30 * 3 * 2 * (64 + 4)
    # keys 8-bit, values 4-bit: half of each
    assert KVQuant(8, 4, 64).bytes_per_token(**GEOMETRY) == 30 * 3 * (64 + 4 + 32 + 4)


def test_components_follow_bits_and_group_size():
    comps = KVQuant(4, 16, 32).components(heads=3, key_dim=64, value_dim=64)
    assert [(c.name, c.width, c.dtype) for c in comps] == [
        ("k.w", 8, "uint32"),
        ("k.s", 2, "float16"),
        ("k.b", 2, "float16"),
        ("v", 64, "float16"),
    ]


@pytest.mark.parametrize("bits", [1, 7, 12, 32])
def test_rejects_unsupported_bits(bits):
    with pytest.raises(InvalidRequestError, match="bits must be one of"):
        KVQuant(bits, 4)


def test_rejects_group_size_that_does_not_divide_head_dim():
    with pytest.raises(InvalidRequestError, match="group"):
        KVQuant(4, 4, 128).check_head_dims(64, 64)
    with pytest.raises(InvalidRequestError, match="group size"):
        KVQuant(4, 4, 48)


def test_labels():
    assert [KVQuant(4, 4, **V1).label, KVQuant(8, 4, **V1).label, KVQuant(16, 16).label] == [
        "q4",
        "k8v4",
        "fp16",
    ]
    assert [KVQuant(4, 4).label, KVQuant(8, 4).label] == ["q4.v2", "k8v4.v2"]


def test_the_default_is_format_2_where_the_key_bits_allow_it():
    """``KVQuant()`` / ``KVQuant(4, 4)`` (mlx-lm's drop-in) store format 2: rotated per-channel
    keys; keys of other bits stay per token; stored records without the fields are format 1."""
    assert KVQuant() == KVQuant(4, 4) == KVQuant(4, 4, 64, **V2) and KVQuant().version == 2
    assert KVQuant(2, 4).version == KVQuant(8, 8).version == 2
    for bits in (3, 5, 6, 16):
        assert KVQuant(bits, 4).version == 1 and KVQuant(bits, 4).key_scheme == "token"
    assert KVQuant(4, 4, 32).channel_tokens == 32 and KVQuant(4, 4, 128).channel_tokens == 64
    assert KVQuant(4, 4, 32).bytes_per_token(**GEOMETRY) == KVQuant(4, 4, 32, **V1).bytes_per_token(
        **GEOMETRY
    )
    record = {"key_bits": 4, "value_bits": 4, "group_size": 64}
    assert KVQuant.from_dict(record) == KVQuant(**V1)
    assert KVQuant.from_dict(KVQuant().to_dict()) == KVQuant()
    assert KVQuant.from_bits(4) == KVQuant(**V1)
