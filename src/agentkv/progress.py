"""Progress of long first-run steps (model fetch, import, warm-up) on stderr.

A bar when stderr is a terminal, nothing otherwise (logs and CI stay clean);
the steps also log through ``logging`` for ``--verbose``.
"""

from __future__ import annotations

import sys


class ProgressBar:
    """A byte or step counter that never goes backwards or past its total."""

    def __init__(self, total: int, description: str, *, unit: str = "B"):
        from tqdm import tqdm

        self.total = max(0, int(total))
        self._done = 0
        self._bar = tqdm(
            total=self.total or None,
            desc=f"agentkv: {description}",
            unit=unit,
            unit_scale=unit == "B",
            unit_divisor=1024 if unit == "B" else 1000,
            file=sys.stderr,
            disable=not _is_terminal(sys.stderr),
            leave=True,
            dynamic_ncols=True,
        )

    def update_to(self, done: int) -> None:
        done = min(max(done, self._done), self.total) if self.total else max(done, self._done)
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done

    def advance(self, n: int = 1) -> None:
        self.update_to(self._done + n)

    def finish(self) -> None:
        self.update_to(self.total)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
