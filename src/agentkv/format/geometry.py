"""The block geometry every part of agentkv shares: one constant each, here.

KV lives in blocks of ``BLOCK_TOKENS`` tokens: in memory (the pool's arenas), on disk
(block files and segments) and in attention (tiles read through block tables).
``GROUP_TOKENS`` is the resolution of prefix sharing: a partially matching block
shares whole groups of this many tokens.
"""

BLOCK_TOKENS = 256
GROUP_TOKENS = 64


def blocks_for(tokens: int) -> int:
    """Blocks needed to hold ``tokens`` tokens."""
    return (tokens + BLOCK_TOKENS - 1) // BLOCK_TOKENS
