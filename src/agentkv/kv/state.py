"""CacheState: the one record both agentkv cache classes save and rebuild from.

mlx-lm saves a cache as ``tree_flatten(cache.state)`` and rebuilds it with
``cls.from_state(state)`` from the lists it reads back, so the record is a ``NamedTuple``
(a tuple to mlx-lm, fields by name to us). One field order serves ``AgentKVCache`` and
``BatchQuantizedKVCache``; each fills the fields that are its own and leaves the rest at
their defaults::

    keys values offset start window | key_bits value_bits group_size | key_scheme rotate
    channel_tokens tail | left_padding idx
    `------ the cache ------------'   `-------- its KVQuant (format) ------------------'
    `-- the batch's own --'

Files written before this record held a prefix of it (``AgentKVCache``: the first 8 or 12
fields), which ``from_sequence`` reads with the defaults after it; a ``BatchQuantizedKVCache``
file of that time (9 or 12 fields in another order) is read by ``from_batch_sequence``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..format.quant import KVQuant


class CacheState(NamedTuple):
    keys: tuple | None
    values: tuple | None
    offset: Any  # int; a batch's int32 [B] array
    start: int = 0  # AgentKVCache: first token held (sliding windows after a reload)
    window: int = 0  # 0: full attention
    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 64
    key_scheme: str = "token"
    rotate: int = 0
    channel_tokens: int = 64
    tail: Any = None  # format 2: float16 keys of the filling channel group (a batch: tails)
    left_padding: Any = None  # BatchQuantizedKVCache: int32 [B]
    idx: int = 0  # BatchQuantizedKVCache: rows in use

    @classmethod
    def of(cls, keys, values, offset, quant: KVQuant, *, window: int | None, **own) -> CacheState:
        """A cache's state: its arrays, its format's fields and ``own`` (start, tail...)."""
        return cls(
            keys,
            values,
            offset,
            window=window or 0,
            key_bits=quant.key_bits,
            value_bits=quant.value_bits,
            group_size=quant.group_size,
            key_scheme=quant.key_scheme,
            rotate=int(quant.rotate),
            channel_tokens=quant.channel_tokens,
            **own,
        )

    @classmethod
    def from_sequence(cls, values) -> CacheState:
        """The record from what mlx-lm read back (a list), or an older file's prefix of it."""
        if not 8 <= len(values) <= len(cls._fields):
            raise ValueError(f"an agentkv cache state has 8 to 14 fields, not {len(values)}")
        return cls(*values)

    @classmethod
    def from_batch_sequence(cls, values) -> CacheState:
        """A ``BatchQuantizedKVCache`` state: this record, or the 9/12-field layout of files
        written before it (keys, values, offset, left_padding, idx, window, bits, bits,
        group[, channel_tokens, rotate, tails])."""
        if len(values) == len(cls._fields):
            return cls(*values)
        if len(values) not in (9, 12):
            raise ValueError(f"a batch cache state has 14 fields, not {len(values)}")
        keys, vals, offset, left_padding, idx, window, kb, vb, group, *channel = values
        ct, rotate, tails = channel or (64, 0, None)
        scheme = "channel" if channel else "token"
        return cls(
            keys, vals, offset, 0, window, kb, vb, group, scheme, rotate, ct, tails,
            left_padding, idx,
        )  # fmt: skip

    def quant(self) -> KVQuant:
        """The cache's format (per-token keys take their channel tokens from the group size, as
        ``KVQuant`` does: they never read them)."""
        channel = str(self.key_scheme) == "channel"
        return KVQuant(
            int(self.key_bits),
            int(self.value_bits),
            int(self.group_size),
            key_scheme=str(self.key_scheme),
            rotate=bool(int(self.rotate)),
            channel_tokens=int(self.channel_tokens) if channel else None,
        )
