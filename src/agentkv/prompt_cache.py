"""mlx-lm's prompt caches: made in the engine's KV format, their files read faster and
written safely.

``make_prompt_cache(loaded)`` is mlx-lm's ``make_prompt_cache`` for agentkv: one
``AgentKVCache`` per layer, in the KV format ``Engine()`` stores (4-bit KV format 2 with 8-bit
keys in the model's wide layers, ``model/wide_layers.py``).

``save_prompt_cache`` / ``load_prompt_cache`` have mlx-lm's signatures and
read and write mlx-lm's own format, so files users already have load as they
are and files written here load in mlx-lm. Loading goes through agentkv's mmap
loader (one copy per tensor, in parallel) instead of ``mx.load``, and gives a
full ``KVCache``/``QuantizedKVCache`` one spare 256-row step so its first
update after the load does not copy the whole cache. Saving writes a
temporary file, fsyncs it and renames it into place. agentkv caches are
written as the mlx-lm class holding the same data.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from . import _ext, mlx_adapter
from .errors import CacheFormatError, InvalidRequestError
from .format.geometry import BLOCK_TOKENS
from .kv.batch import BatchQuantizedKVCache
from .kv.cache import AgentKVCache
from .paths import atomic_target
from .store.format import read_header

LOAD_THREADS = max(1, min(4, os.cpu_count() or 1))
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
}
_NUMPY = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "int8": np.int8,
    "uint16": np.uint16,
    "int16": np.int16,
    "uint32": np.uint32,
    "int32": np.int32,
    "uint64": np.uint64,
    "int64": np.int64,
    "float16": np.float16,
    "float32": np.float32,
}


def _target(file_name) -> Path:
    name = str(file_name)
    return Path(name if name.endswith(".safetensors") else name + ".safetensors")


def make_prompt_cache(loaded, quant=None) -> list:
    """One ``AgentKVCache`` per layer of ``loaded`` (``agentkv.model.load.load_model``'s
    result), each with its layer's sliding window. ``quant`` None: the KV format ``Engine()``
    stores for this model (4-bit KV format 2, the group fitted to its head dims, 8-bit keys in
    its wide layers: measured once per model, about 30 s for the embedded one unless its
    result ships with agentkv); a ``KVQuant`` is used as given (``quant.layer(i)`` in layer
    i)."""
    from .format.choice import choose_kv_quant
    from .kv.cache import AgentKVCache
    from .model.wide_layers import with_wide_layers

    spec = loaded.spec
    if quant is None:
        quant = choose_kv_quant(spec, key_bits=4, value_bits=4, group_size=None, kv_format=2)
        quant = with_wide_layers(quant, loaded.model, loaded.tokenizer, spec)
    spec.components(quant)  # every wide layer is one of the model's; the head dims fit
    layers = enumerate(spec.layers)
    return [AgentKVCache(quant.layer(i), window=layer.window) for i, layer in layers]


def save_prompt_cache(file_name, cache: list, metadata: dict[str, str] | None = None) -> None:
    """Save a prompt cache in mlx-lm's format (crash-safe: temp file, fsync, rename)."""
    caches = [to_mlx_lm_cache(c) for c in cache]
    with atomic_target(_target(file_name), suffix=".tmp.safetensors") as tmp:
        mlx_adapter.save_prompt_cache(str(tmp), caches, metadata)


def load_prompt_cache(file_name, return_metadata: bool = False):
    """Load a prompt cache written by mlx-lm (or by ``save_prompt_cache``)."""
    path = Path(file_name)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CacheFormatError(path, "file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        header, data_start = read_header(head + f.read(min(length, 64 << 20)), path)
    try:
        user, classes, kinds = mlx_adapter.split_prompt_cache_metadata(
            header.pop("__metadata__", {})
        )
        tensors = {name: _spec(name, info) for name, info in header.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(path, f"not an mlx-lm prompt cache ({exc})") from None

    # Small tensors (scalars: offsets, bits...) first, straight from the file.
    scalars = {n: t for n, t in tensors.items() if not t[2]}
    with open(path, "rb") as f:
        small = {}
        for name, (offset, nbytes, shape, dtype) in scalars.items():
            f.seek(data_start + offset)
            small[name] = np.frombuffer(f.read(nbytes), dtype=_NUMPY[dtype]).reshape(shape)
    big = {n: t for n, t in tensors.items() if t[2]}
    names = list(big)
    specs = [(*big[n], _capacity(n, big[n][2], classes, small)) for n in names]
    try:
        loaded = _ext.load_tensors(str(path), data_start, specs, LOAD_THREADS)
    except ValueError as exc:
        raise CacheFormatError(path, str(exc)) from None
    import mlx.core as mx

    arrays = {n: mx.array(a) for n, a in small.items()} | dict(zip(names, loaded))
    try:
        caches = build_prompt_cache(arrays, classes, kinds)
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheFormatError(path, f"cannot rebuild the caches ({exc})") from None
    return (caches, user) if return_metadata else caches


def _spec(name: str, info: dict) -> tuple[int, int, list[int], str]:
    start, end = (int(v) for v in info["data_offsets"])
    dtype = _DTYPES[info["dtype"]]
    shape = [int(d) for d in info["shape"]]
    if end < start:
        raise ValueError(f"tensor {name} has negative size")
    return start, end - start, shape, dtype


def _capacity(name: str, shape: list[int], classes: list[str], small: dict) -> int:
    """Rows to allocate on axis -2: one spare step for a full KVCache/QuantizedKVCache buffer."""
    parts = name.split(".")
    if len(shape) != 4 or len(parts) < 2 or parts[1] not in ("0", "1"):
        return -1
    index = int(parts[0])
    if index >= len(classes) or classes[index] not in mlx_adapter.GROWABLE_CACHES:
        return -1
    offset = small.get(f"{index}.2")
    rows = shape[2]
    if offset is None or int(offset) < rows:
        return -1
    return rows + BLOCK_TOKENS


def to_mlx_lm_cache(cache):
    """An mlx-lm cache object holding what ``cache`` holds (agentkv caches converted)."""
    KVCache, QuantizedKVCache = (mlx_adapter.cache_class(n) for n in mlx_adapter.GROWABLE_CACHES)
    if not isinstance(cache, AgentKVCache):
        if type(cache).__module__.startswith("agentkv"):
            raise InvalidRequestError(f"{type(cache).__name__} has no mlx-lm equivalent")
        return cache
    if cache.start:
        raise InvalidRequestError(
            "this cache dropped the blocks its sliding window no longer sees; "
            "mlx-lm's prompt-cache files cannot describe that"
        )
    q = cache.quant
    keys, values = cache.keys_and_values() if cache.keys is not None else (None, None)
    if q.version > 1:
        return _format_2_to_mlx_lm(cache)
    if q.key_bits == q.value_bits == 16:
        out = KVCache()
        out.keys, out.values = (keys[0], values[0]) if keys else (None, None)
    elif q.key_bits == q.value_bits:
        out = QuantizedKVCache(group_size=q.group_size, bits=q.key_bits)
        out.keys, out.values = keys, values
    else:
        raise InvalidRequestError(
            f"mlx-lm's QuantizedKVCache has one bit width; this cache stores keys at "
            f"{q.key_bits} and values at {q.value_bits} bits"
        )
    out.offset = cache.offset
    return out


def _format_2_to_mlx_lm(cache):
    """mlx-lm's QuantizedKVCache for a cache in KV format 2: keys and values dequantized, rotated
    back and quantized again per token, at the wider of the cache's key and value bits
    (mlx-lm's cache has one width: a wide layer's 8-bit keys give an 8-bit cache). Lossy:
    the per-token 4-bit keys mlx-lm reads cost the model what KV format 1 costs (see
    docs/kv-format-v2.md)."""
    QuantizedKVCache = mlx_adapter.cache_class("QuantizedKVCache")
    q = cache.quant
    bits = max(q.key_bits, q.value_bits)
    out = QuantizedKVCache(group_size=q.group_size, bits=bits)
    if cache.keys is not None:
        k, v = (x.astype(mx.float16) for x in cache.dequantized())
        out.keys = tuple(mx.quantize(k, group_size=q.group_size, bits=bits))
        out.values = tuple(mx.quantize(v, group_size=q.group_size, bits=bits))
    out.offset = cache.offset
    return out


def prompt_cache_class(name: str):
    """The class a prompt-cache file names: mlx-lm's, or agentkv's own."""
    ours = {"AgentKVCache": AgentKVCache, "BatchQuantizedKVCache": BatchQuantizedKVCache}
    return ours.get(name) or mlx_adapter.cache_class(name)


def build_prompt_cache(arrays: dict, classes: list[str], kinds: dict[str, str]) -> list:
    """Cache objects from a prompt-cache file's arrays, as mlx-lm's loader builds them."""
    values = dict(arrays)
    for pos, kind in kinds.items():
        array = values[pos]
        if kind == "scalar":
            values[pos] = array.item()
        elif kind == "string":
            values[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            values[pos] = None
        else:
            raise ValueError(f"unknown scalar kind {kind!r}")
    states = tree_unflatten(list(values.items()))
    return [prompt_cache_class(c).from_state(state) for c, state in zip(classes, states)]
