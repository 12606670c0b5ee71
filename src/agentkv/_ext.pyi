"""
agentkv native core: checksums, the mmap KV block loader, the block pool's I/O and fused attention.
"""

from collections.abc import Sequence
from typing import Annotated

import mlx.core
import numpy
from numpy.typing import NDArray


class KVSwapSet:
    """One agent's evicted KV blocks for KVSwap (csrc/core/kvswap.h)."""

    def __init__(self, layers: int, kv_heads: int, q_heads: int, head_dim: int, block_tokens: int, group: int, rank: int, slots: int, demand: int, attention_scale: float, paths: Sequence[str], offsets: Sequence[int], row_bytes: Sequence[int], comps: int, crcs: Sequence[int]) -> None: ...

    def set_layer(self, layer: int, query_projection: mlx.core.array, keys: mlx.core.array, scales: mlx.core.array) -> None: ...

    def add_block(self, path: str, offsets: Sequence[int], crcs: Sequence[int], keys: Sequence[mlx.core.array], scales: Sequence[mlx.core.array]) -> None: ...

    def set_bounds(self, layer: int, lo: mlx.core.array, hi: mlx.core.array) -> None: ...

    def slot_groups(self, layer: int) -> list[int]: ...

    def ranked(self, layer: int, q: mlx.core.array) -> list[int]: ...

    def predict(self, layer: int, q: mlx.core.array) -> bool:
        """
        Read ahead for the layer: choose its groups from a predicted query q [Hq, D] and start reading the missing ones (the I/O thread reads those not in the page cache); the next stage of that layer, still choosing from its own query, takes those it chose. False where nothing started (below predict_from, or failed).
        """

    @property
    def predict_from(self) -> int:
        """
        The first layer read ahead from a query predicted in the layer before (the number of layers: none); steps read ahead only while reads go to disk.
        """

    @predict_from.setter
    def predict_from(self, arg: int, /) -> None: ...

    @property
    def read_ahead_always(self) -> bool:
        """
        Read ahead from predict_from on whether or not reads go to disk (off: only while they do; RWF_NOWAIT decides, and storage that serves a dropped page within the call counts as cached).
        """

    @read_ahead_always.setter
    def read_ahead_always(self, arg: bool, /) -> None: ...

    @property
    def reading_ahead(self) -> bool:
        """
        Whether the next steps should read ahead (predict_from is set and a read went to disk lately).
        """

    def keys_to_file(self, dir: str, capacity: int) -> None:
        """
        Keep the low-rank keys in an unlinked temporary file in dir (the page cache's memory, not the process's), room for capacity evicted blocks; before set_layer.
        """

    @property
    def keys_in_file(self) -> bool: ...

    @property
    def staging(self) -> list[int]:
        """The staging blocks' ids (a decoding row's table starts with them)."""

    @staging.setter
    def staging(self, arg: Sequence[int], /) -> None: ...

    @property
    def stats(self) -> dict: ...

    @property
    def error(self) -> str: ...

    @property
    def failed_block(self) -> int: ...

    @property
    def blocks(self) -> int: ...

    @property
    def slots(self) -> int: ...

    @property
    def demand(self) -> int: ...

    @demand.setter
    def demand(self, arg: int, /) -> None: ...

    @property
    def resident_bytes(self) -> int: ...

def kvswap_group_crcs(arenas: Sequence[mlx.core.array], layers: int, kv_heads: int, block_tokens: int, group: int, blocks: Sequence[int]) -> list[int]:
    """
    CRC-32C of each (block, layer, group) of the pool, as KVSwapSet checks its reads.
    """

def kvswap_stage(queries: mlx.core.array, keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], tables: mlx.core.array, swaps: Sequence[KVSwapSet], rows: Sequence[int], layer: int) -> mlx.core.array:
    """
    Stage each swapped row's groups for this layer; returns the queries (NaN for a row whose reads failed), to feed the paged attention after it.
    """

def forget_mappings(paths: Sequence[str]) -> None:
    """Drop cached mappings of segment files about to be deleted."""

def clear_mappings() -> None:
    """
    Drop every cached segment mapping (the next loads map their files again).
    """

def kernel_paged_attention(q: mlx.core.array, keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], tables: mlx.core.array, lengths: mlx.core.array, dims: Sequence[int], sinks: mlx.core.array | None = None, scale: float = 1.0, threads: int = 2, tail: mlx.core.array | None = None, tail_slots: mlx.core.array | None = None, vectors: int = 4, lanes_per_key: int = 8, done: mlx.core.array | None = None, done_first: mlx.core.array | None = None, softcap: float = 0.0, keys_in_flight: int = 1) -> mlx.core.array:
    """
    kernels/paged_attention.metal (then paged_attention_merge.metal) on CPU, each threadgroup's lanes as a loop (for tests against the others).
    """

def kernel_store_rows(keys: mlx.core.array, values: mlx.core.array, queries: mlx.core.array, dims: Sequence[int], starts: mlx.core.array, rope: mlx.core.array, norm: mlx.core.array, eps: float = 0.0, threads: int = 2) -> list[mlx.core.array]:
    """
    kernels/store_rows.metal on CPU with the kernel's inputs, each threadgroup's lanes as a loop: (H k float16, H v's words, scales, biases, the roped queries float32), as KV format 2 stores a step on a GPU (for tests).
    """

def kernel_dense_rows(keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], tail: mlx.core.array, done: mlx.core.array, src: mlx.core.array, dims: Sequence[int], scale: float = 1.0, threads: int = 2) -> list[mlx.core.array]:
    """
    kernels/dense_rows.metal on CPU: the keys and values (float32) a prefill chunk's row sees, gathered from the arenas and dequantized as a GPU does it (for tests).
    """

def kernel_quantize_groups(x: mlx.core.array, bits: int, channel_tokens: int) -> list[mlx.core.array]:
    """
    kernels/quantize_groups.metal on CPU: whole channel groups of keys [..., G * ct, D] -> (words, scales, biases) as KV format 2 stores them (for tests).
    """

def kernel_merge(sources: Sequence[Sequence[mlx.core.array]], rows: mlx.core.array, dims: Sequence[Sequence[int]], threads: int = 2) -> list[mlx.core.array]:
    """kernels/merge.metal on CPU, for many outputs at once."""

def kernel_extract(batches: Sequence[mlx.core.array], metas: Sequence[Sequence[int]], threads: int = 2) -> list[mlx.core.array]:
    """kernels/extract.metal on CPU, for many outputs at once."""

def pack_quantized(w: mlx.core.array, scales: mlx.core.array, biases: mlx.core.array, group_size: int, bits: int) -> tuple[mlx.core.array, mlx.core.array, mlx.core.array]:
    """
    MLX's affine weights (uint32 [N, K * bits / 32], scales and biases [N, K / group]) packed for quantized_matmul, losslessly: (codes uint8 [ceil(N / 16), K * 2 * bits], scales, biases [ceil(N / 16), K / group, 16]); padded columns are zeros.
    """

def pack_super_scales(packed: mlx.core.array, super: mlx.core.array) -> mlx.core.array:
    """
    Packed float32 scales or biases (pack_quantized, groups of 32: [ceil(N / 16), K / 32, 16]) and one float16 factor d a row and 256 K (super [N, K / 256]) -> two-level ones for quantized_matmul (uint8 [ceil(N / 16), K / 256, 160]: each value d * m, m an integer in 0 .. 255, bit for bit the same floats; llama.cpp's K-quant super-blocks). Raises ValueError where some value is not.
    """

def quantized_matmul(x: mlx.core.array, w: mlx.core.array, scales: mlx.core.array, biases: mlx.core.array, group_size: int, bits: int) -> mlx.core.array:
    """
    x @ dequantize(w).T for MLX's affine 4/5/8-bit weights packed by agentkv.mlx_adapter (pack_quantized: 16 columns side by side; scales and biases as packed, or two-level from pack_super_scales) on CPU: int16 activations per 32, exact integer dot products (AVX-512 VNNI, AVX2, NEON or portable), every output reduced in one fixed order whatever the batch. Returns [..., N] with N = 16 * w.shape[0] (padded columns come out zero).
    """

def decoder_layer(x: mlx.core.array, norms: Sequence[mlx.core.array], eps: float, linears: Sequence[mlx.core.array], bits: Sequence[int], groups: Sequence[int], *, heads: int, kv_heads: int, attention_scale: float, rope_dims: int, rope_traditional: bool, rope_base: float | None, rope_scale: float, rope_freqs: mlx.core.array | None, keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], tail: mlx.core.array, tables: mlx.core.array, lengths: mlx.core.array, tail_slots: mlx.core.array, rows: mlx.core.array, tail_rows: mlx.core.array | None, key_bits: int, value_bits: int, group: int, channel_tokens: int, block_tokens: int, window: int, rotate: bool, linear_biases: Sequence[mlx.core.array | None], qk_norms: Sequence[mlx.core.array] | None, qk_eps: float, positions: mlx.core.array | None = None, swaps: Sequence[KVSwapSet] = [], swap_rows: Sequence[int] = [], layer: int = -1, predict: Sequence[mlx.core.array | None] = [], predict_bits: int = 0, predict_group: int = 0, key_plan: mlx.core.array | None = None, key_counts: Sequence[int] = [], prevs: mlx.core.array | None = None, swap_stream: bool = False) -> mlx.core.array:
    """
    One Llama-family decoder layer over the block pool as one CPU operation (the same bits as its separate operations); writes the step's keys and values in place. See csrc/ops.h. swap_stream: the one swapped row's prefill chunk, its attention exact over its evicted blocks read back chunk by chunk (docs/kvswap.md).
    """

def hadamard_rows(x: mlx.core.array, scale: float) -> mlx.core.array:
    """
    mx.hadamard_transform(x, scale)'s bits as one CPU operation, its rows over agentkv's thread pool: x float32 [..., n], n a power of two.
    """

def quantize_channels(x: mlx.core.array, bits: int) -> tuple[mlx.core.array, mlx.core.array, mlx.core.array]:
    """
    Format 2's per-channel key quantization of one channel group from agentkv's CPU code (for tests): x float16 [tokens, dim] -> (words, scales, biases).
    """

def quantize_rows(x: mlx.core.array, bits: int, group: int) -> tuple[mlx.core.array, mlx.core.array, mlx.core.array]:
    """
    mx.quantize's codes with float16 scales and biases from agentkv's CPU code (for tests): x float32 [..., dim] -> (words, scales, biases).
    """

def rms_norm(x: mlx.core.array, weight: mlx.core.array, eps: float) -> mlx.core.array:
    """
    mx.fast.rms_norm's result as one CPU operation (float32), each row alone.
    """

def silu_mul(gate: mlx.core.array, up: mlx.core.array) -> mlx.core.array:
    """silu(gate) * up (mlx-lm's swiglu) as one CPU operation (float32)."""

def rope(x: mlx.core.array, dims: int, *, traditional: bool, base: float | None, scale: float, offset: int | mlx.core.array, freqs: mlx.core.array | None = None) -> mlx.core.array:
    """
    mx.fast.rope's rotary embedding as one CPU operation (float32); offset an int or an array of one start per batch row.
    """

def invariant_linear(x: mlx.core.array, w: mlx.core.array, bias: mlx.core.array | None = None) -> mlx.core.array:
    """
    x @ w.T (+ bias), float32 on CPU, with results independent of the batch.
    """

def load_tensors(path: str, data_start: int, tensors: Sequence[tuple[int, int, Sequence[int], str, int]], threads: int = 2) -> list[mlx.core.array]:
    """
    Tensors (offset, nbytes, shape, dtype, capacity rows) of a safetensors file as MLX arrays.
    """

def quantized_attention(queries: mlx.core.array, keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], scale: float, key_bits: int, value_bits: int, group: int, window: int = 0, left_padding: mlx.core.array | None = None, sinks: mlx.core.array | None = None, channel_tokens: int = 0, tail: mlx.core.array | None = None, softcap: float = 0.0) -> mlx.core.array:
    """
    Fused attention over a quantized KV cache (CPU); see csrc/core/attention.h. channel_tokens > 0: per-channel keys (format 2), each row's group still filling in tail [B, Hkv, channel_tokens, D].
    """

def paged_attention(queries: mlx.core.array, keys: Sequence[mlx.core.array], values: Sequence[mlx.core.array], tables: mlx.core.array, lengths: mlx.core.array, kv_heads: int, block_tokens: int, scale: float, key_bits: int, value_bits: int, group: int, window: int = 0, sinks: mlx.core.array | None = None, channel_tokens: int = 0, tail: mlx.core.array | None = None, tail_slots: mlx.core.array | None = None, done: mlx.core.array | None = None, done_first: mlx.core.array | None = None, softcap: float = 0.0) -> mlx.core.array:
    """
    Fused attention over paged block arenas for a jagged batch (CPU); see csrc/core/attention.h. channel_tokens > 0: per-channel keys (format 2), the groups still filling in the float16 tail, slot tail_slots[b] per row; done: the groups the step completed, in float16, row b's from entry done_first[b] (-1: none).
    """

def uninitialized(rows: int, width: int, dtype: str) -> mlx.core.array:
    """
    An arena [rows, width] whose pages are committed only as they are written.
    """

def read_regions(arenas: Sequence[mlx.core.array], layers: int, block_tokens: int, components: Sequence[Sequence[tuple[int, int, str]]], blocks: int, files: Sequence[tuple[str, int, int, int]], regions: Sequence[tuple[int, int, int, int, int, int]], threads: int = 2) -> None:
    """
    Verify stored block regions (file, offset, length, checksum, tokens, slot) of files (path, size, header checksum, layout) and copy each into its pool slot.
    """

def pack_regions(arenas: Sequence[mlx.core.array], layers: int, block_tokens: int, components: Sequence[Sequence[tuple[int, int, str]]], blocks: int, slots: Sequence[int], tokens: Sequence[int], layouts: Sequence[int], threads: int = 2) -> tuple[Annotated[NDArray[numpy.uint8], dict(shape=(None,))], list[tuple[int, int, int, int, int]]]:
    """
    Lay pool slots out as checksummed block regions for a block or segment file, each in its layout (0: planes, 1: groups of 64 tokens).
    """

def copy_slot_rows(arenas: Sequence[mlx.core.array], layers: int, block_tokens: int, components: Sequence[Sequence[tuple[int, int, str]]], blocks: int, src: int, dst: int, tokens: int) -> None:
    """
    Copy the first tokens rows of one pool slot into another (every layer and head).
    """

def release_slot(arenas: Sequence[mlx.core.array], layers: int, block_tokens: int, components: Sequence[Sequence[tuple[int, int, str]]], blocks: int, slot: int, layer_mask: Sequence[int]) -> int:
    """
    Hand a pool slot's pages back to the OS for the flagged layers; returns the bytes.
    """

def data_address(array: mlx.core.array) -> int:
    """Where an evaluated array's data lives (to notice buffers that moved)."""

def build_info() -> dict:
    """Compiler, MLX and nanobind versions this extension was built with."""

def crc32c(data: object, value: int = 0) -> int:
    """CRC-32C of a bytes-like object (continue from value)."""

def block_checksum(data: object) -> int:
    """The striped CRC-32C agentkv stores per KV block."""

def gather_blocks(layers: int, block_tokens: int, components: Sequence[Sequence[tuple[int, int, str]]], segments: Sequence[tuple[str, int, int, int]], blocks: Sequence[tuple[int, int, int, int, int]], tokens: int, spans: Sequence[tuple[int, int]], threads: int = 2) -> list[mlx.core.array]:
    """
    Load tokens [0, tokens) of stored KV blocks into new MLX arrays, verifying every read.
    """
