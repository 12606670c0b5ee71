"""Silence third-party messages that say nothing to an agentkv user.

transformers announces at import time that PyTorch is missing; agentkv uses it
only for tokenizers, which need no PyTorch. The filter sits on transformers'
own logger (created here if transformers is not imported yet), so it drops
exactly that record and nothing else, and changes no environment variable.
Importing this module installs the filters.
"""

from __future__ import annotations

import logging

_NOISE = {"transformers": ("PyTorch was not found",)}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    for name, prefixes in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(prefixes))


install()
