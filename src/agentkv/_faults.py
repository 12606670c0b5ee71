"""Deterministic crash points, for the crash-safety tests.

``AGENTKV_CRASH_AT=name:n`` makes the process kill itself (SIGKILL: no cleanup,
no flush, as a power cut or the OOM killer would) the ``n``-th time it passes
``crash_point(name)``. Unset, a crash point costs one comparison. The tests
kill a save at every point of the write protocol and check what a restart
finds, instead of killing at random times.
"""

from __future__ import annotations

import os
import signal

ENV = "AGENTKV_CRASH_AT"


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(ENV)
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    return (name, int(count)) if name and count.isdigit() else None


_TARGET = _target()
_passed: dict[str, int] = {}


def crash_point(name: str) -> None:
    if _TARGET is None or name != _TARGET[0]:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == _TARGET[1]:
        os.kill(os.getpid(), signal.SIGKILL)
