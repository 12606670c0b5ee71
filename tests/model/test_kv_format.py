"""The KV format an engine picks for a model: the group size follows the head dims."""

import dataclasses

import pytest
from helpers import synthetic_spec

from agentkv.errors import InvalidRequestError
from agentkv.format.choice import AUTO_GROUP_SIZES, choose_kv_quant


@pytest.mark.parametrize(
    ("dim", "bits", "group"),
    [(64, 4, 64), (128, 4, 64), (256, 8, 64), (32, 4, 32), (96, 4, 32), (32, 3, 32), (80, 16, 64)],
)
def test_the_first_group_size_that_splits_the_head_dim_is_chosen(dim, bits, group):
    quant = choose_kv_quant(
        synthetic_spec(dim=dim), key_bits=bits, value_bits=bits, group_size=None
    )
    assert (quant.key_bits, quant.value_bits, quant.group_size) == (bits, bits, group)
    quant.check_head_dims(dim, dim)


def test_keys_and_values_must_both_fit():
    spec = dataclasses.replace(synthetic_spec(dim=64), value_head_dim=32)
    quant = choose_kv_quant(spec, key_bits=4, value_bits=4, group_size=None)
    assert quant.group_size == 32
    # Float16 values need no groups: the keys alone decide.
    assert choose_kv_quant(spec, key_bits=4, value_bits=16, group_size=None).group_size == 64


def test_a_named_group_size_is_kept_or_refused_with_the_head_dim():
    assert (
        choose_kv_quant(
            synthetic_spec(dim=128), key_bits=4, value_bits=4, group_size=128
        ).group_size
        == 128
    )
    with pytest.raises(InvalidRequestError, match="head dim 32 does not split into groups of 64"):
        choose_kv_quant(synthetic_spec(dim=32), key_bits=4, value_bits=4, group_size=64)


def test_no_group_size_fits_an_odd_head_dim_and_the_error_says_what_to_do():
    with pytest.raises(InvalidRequestError) as info:
        choose_kv_quant(synthetic_spec(dim=80), key_bits=4, value_bits=8, group_size=None)
    message = str(info.value)
    assert "head dim 80" in message and "64, 32, 128" in message and "4/8 bits" in message
    assert "kv_bits=16" in message
    assert AUTO_GROUP_SIZES[0] == 64  # the default stays first
