"""Progress of long first-run steps (model fetch, import, warm-up) on stderr.

A bar when stderr is a terminal. Otherwise nothing, so logs and CI stay clean, except
for steps long enough that a silent log looks hung (the first model fetch): those print a
plain line at each tenth of the way. The steps also log through ``logging`` for
``--verbose``.
"""

from __future__ import annotations

import sys


class ProgressBar:
    """A byte or step counter that never goes backwards or past its total.

    ``lines``: when stderr is not a terminal, print ``agentkv: <description>: 30% (...)``
    each time another tenth of a known total is done."""

    def __init__(self, total: int, description: str, *, unit: str = "B", lines: bool = False):
        from tqdm import tqdm

        self.total = max(0, int(total))
        self.description = description
        self.unit = unit
        self._done = 0
        terminal = _is_terminal(sys.stderr)
        self._lines = lines and not terminal and self.total > 0
        self._tenths = 0
        self._bar = tqdm(
            total=self.total or None,
            desc=f"agentkv: {description}",
            unit=unit,
            unit_scale=unit == "B",
            unit_divisor=1024 if unit == "B" else 1000,
            file=sys.stderr,
            disable=not terminal,
            leave=True,
            dynamic_ncols=True,
        )

    def update_to(self, done: int) -> None:
        done = min(max(done, self._done), self.total) if self.total else max(done, self._done)
        if done > self._done:
            self._bar.update(done - self._done)
            self._done = done
            if self._lines:
                self._print_tenth()

    def _print_tenth(self) -> None:
        tenths = self._done * 10 // self.total
        if tenths > self._tenths:
            self._tenths = tenths
            print(
                f"agentkv: {self.description}: {tenths * 10}% "
                f"({_amount(self._done, self.unit)} of {_amount(self.total, self.unit)})",
                file=sys.stderr,
                flush=True,
            )

    def advance(self, n: int = 1) -> None:
        self.update_to(self._done + n)

    def finish(self) -> None:
        self.update_to(self.total)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def _amount(n: int, unit: str) -> str:
    return f"{n / (1 << 20):.1f} MiB" if unit == "B" else f"{n} {unit}s"


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
