"""``index_arrays``: a step's host indices as MLX arrays, views of one array made from host
data (on MLX's CUDA backend each such array is a managed-memory buffer: one a step), copied
into device memory on a GPU where ``AGENTKV_GPU_DEVICE_INDEX=1`` (an experiment;
docs/gpu-attention.md, "Profile"). The copy is forced here on the CPU too."""

import mlx.core as mx
import numpy as np
import pytest

from agentkv.pool import arena

VALUES = [
    np.asarray([[3, -1, 7], [0, 2**30, -5]], np.int32),
    np.zeros(0, np.int32),
    [4],
    np.arange(10, dtype=np.int64).reshape(5, 2) - 3,
]


@pytest.mark.parametrize("on_device", [False, True])
def test_every_index_keeps_its_values_shape_and_dtype(monkeypatch, on_device):
    assert not arena._device_index()  # the CPU: off whatever the setting
    monkeypatch.setattr(arena, "_device_index", lambda: on_device)
    made = []
    real = mx.array
    monkeypatch.setattr(mx, "array", lambda *a, **k: made.append(1) or real(*a, **k))
    out = arena.index_arrays(*VALUES)
    assert len(made) == 1  # one array from host data, whatever the count
    assert [a.shape for a in out] == [(2, 3), (0,), (1,), (5, 2)]
    for got, want in zip(out, VALUES):
        assert got.dtype == mx.int32
        assert np.array_equal(np.asarray(got), np.asarray(want, np.int32))
