"""``index_array``: a step's host indices as an MLX array, copied into device memory on a GPU
where ``AGENTKV_GPU_DEVICE_INDEX=1`` (an experiment; docs/gpu-attention.md, "Profile"). The
copy is forced here on the CPU: the same values and dtype, and an empty array left alone."""

import mlx.core as mx
import numpy as np

from agentkv.pool import arena


def test_the_device_copy_keeps_every_index(monkeypatch):
    values = np.asarray([[3, -1, 7], [0, 2**30, -5]], np.int32)
    assert not arena._device_index()  # the CPU: off whatever the setting
    monkeypatch.setattr(arena, "_device_index", lambda: True)
    copied = arena.index_array(values)
    assert copied.dtype == mx.int32 and copied.shape == (2, 3)
    assert np.array_equal(np.asarray(copied), values)
    assert arena.index_array(np.zeros(0, np.int32)).size == 0
