"""Tokens with their spans in the agent's text.

agentkv matches prompts by text, not token ids, so every cached token carries
its span ``[start, end)`` in the agent's text. Spans are offsets into the
UTF-8 bytes of the text: a byte-level BPE token can end in the middle of a
character, and bytes are the only unit in which such a token has an exact span.

Two strategies, chosen once per tokenizer:

* ``ByteLevelText`` (byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM...): every
  token id maps to fixed bytes, so spans are exact and the text is exactly the
  concatenation of the tokens' bytes.
* ``OffsetsText`` (anything else, e.g. SentencePiece): spans come from the fast
  tokenizer's offset mapping; generated tokens get the bytes their streaming
  detokenization adds.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np


class Encoded(NamedTuple):
    ids: list[int]
    spans: np.ndarray  # int64 [n, 2], byte offsets relative to the encoded text


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _spans_from_lengths(lengths: list[int], base: int = 0) -> np.ndarray:
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64)) + base
    starts = ends - np.asarray(lengths, dtype=np.int64)
    return np.stack([starts, ends], axis=1) if lengths else np.zeros((0, 2), dtype=np.int64)


class TokenText:
    """Encodes text to (ids, spans) and tells the bytes generated tokens add."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a Hugging Face fast tokenizer

    def encode(self, text: str) -> Encoded:
        raise NotImplementedError

    def generated_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes each of ``ids`` (generated in this order) adds to the text."""
        raise NotImplementedError

    @staticmethod
    def for_tokenizer(tokenizer) -> TokenText:
        byte_level = ByteLevelText.try_create(tokenizer)
        return byte_level if byte_level is not None else OffsetsText(tokenizer)


class ByteLevelText(TokenText):
    def __init__(self, tokenizer, table: list[bytes]):
        super().__init__(tokenizer)
        self.table = table

    @classmethod
    def try_create(cls, tokenizer) -> ByteLevelText | None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        if type(backend.decoder).__name__ != "ByteLevel" or backend.normalizer is not None:
            return None
        # Each byte-level character to the character of its byte (then Latin-1 gives the
        # bytes); a character outside the table (a special token's own text) to one above
        # 0xFF, so such tokens are kept as their UTF-8 text.
        to_byte = _unicode_to_byte()
        to_char = {c: "\uffff" for c in range(256) if chr(c) not in to_byte}
        to_char.update({ord(ch): chr(b) for ch, b in to_byte.items()})
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        vocab = tokenizer.get_vocab()
        table = [b""] * (max(vocab.values()) + 1)
        for token, index in vocab.items():
            mapped = token.translate(to_char)
            if token in special or (mapped and max(mapped) > "\xff"):
                table[index] = token.encode("utf-8")
            else:
                table[index] = mapped.encode("latin-1")
        text_probe = "Hé said: 12 naïve 🙂 words\n\t<|probe|>"
        probe = cls(tokenizer, table)
        if b"".join(probe.table[i] for i in probe._ids(text_probe)) != text_probe.encode():
            return None
        return probe

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> Encoded:
        ids = self._ids(text)
        lengths = [len(self.table[i]) for i in ids]
        if sum(lengths) != len(text.encode("utf-8")):
            raise ValueError("byte-level tokens do not tile the text")
        return Encoded(ids, _spans_from_lengths(lengths))

    def generated_bytes(self, ids: list[int]) -> list[bytes]:
        return [self.table[i] for i in ids]


class OffsetsText(TokenText):
    def encode(self, text: str) -> Encoded:
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(out["input_ids"])
        char_to_byte = np.zeros(len(text) + 1, dtype=np.int64)
        char_to_byte[1:] = np.cumsum([len(ch.encode("utf-8")) for ch in text])
        offsets = np.asarray(out["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        spans = char_to_byte[offsets] if len(ids) else np.zeros((0, 2), dtype=np.int64)
        # Make spans tile the text: each token ends where the next one starts.
        if len(ids):
            spans[:, 1] = np.maximum.accumulate(spans[:, 1])
            spans[1:, 0] = spans[:-1, 1]
            spans[0, 0] = 0
            spans[-1, 1] = len(text.encode("utf-8"))
        return Encoded(ids, spans)

    # Tokens of context decoded before each token, so a token's text does not
    # depend on where the decode starts (SentencePiece strips a leading space).
    _CONTEXT = 8

    def generated_bytes(self, ids: list[int]) -> list[bytes]:
        out = []
        for i in range(len(ids)):
            window = ids[max(0, i - self._CONTEXT) : i]
            before = self.tokenizer.decode(window).encode("utf-8")
            after = self.tokenizer.decode([*window, ids[i]]).encode("utf-8")
            out.append(after[len(before) :] if after.startswith(before) else b"")
        return out
