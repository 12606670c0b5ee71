"""What the test run itself keeps to: it writes only under its own home, and leaves nothing
behind (conftest.py runs these at the start and the end of every run)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Snapshot:
    """Every file and directory under ``root`` (but ``skip``), with its size and mtime."""

    root: Path
    skip: Path
    entries: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, root: Path, *, skip: Path) -> Snapshot:
        return cls(root, skip, _listing(root, skip))

    def changes(self) -> list[str]:
        """One line per entry the run added, removed or rewrote since the snapshot."""
        now = _listing(self.root, self.skip)
        lines = []
        for name in sorted(now.keys() | self.entries.keys()):
            before, after = self.entries.get(name), now.get(name)
            if before == after:
                continue
            what = "added" if before is None else "removed" if after is None else "changed"
            lines.append(f"{self.root / name}: {what} during the run")
        return lines


def _listing(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    found = {}
    if not root.is_dir():
        return found
    skip = skip.resolve()
    for path, dirs, files in os.walk(root):
        here = Path(path)
        dirs[:] = [d for d in dirs if (here / d).resolve() != skip]
        for name in dirs + files:
            try:
                st = os.lstat(here / name)
            except FileNotFoundError:  # removed while we looked
                continue
            size = 0 if name in dirs else st.st_size
            found[str((here / name).relative_to(root))] = (size, st.st_mtime_ns)
    return found


# MLX keeps the CPU kernels it compiles in ``$TMPDIR/mlx`` for every later process (its own
# cache, by design): the run's goes with the run's home.
MLX_KERNEL_CACHE = "mlx"


def leftovers(scratch: Path) -> list[str]:
    """One line per entry left in the run's temporary directory."""
    if not scratch.is_dir():
        return []
    left = [p for p in sorted(scratch.iterdir()) if p.name != MLX_KERNEL_CACHE]
    return [f"{p}: left in the temporary directory" for p in left]


def link_embedded_source(user_models: Path, models: Path) -> None:
    """Link the embedded model's source (the GGUF file, a complete hub copy) from the user's
    model cache into the run's, where the user has it and the run does not: the run reads
    it and imports it into its own directory, so the user's cache is never written."""
    from agentkv.model import embedded

    if not user_models.is_dir() or user_models.resolve() == models.resolve():
        return
    hub = user_models / embedded.HUB_DIR
    sources = {
        embedded.HUB_DIR: (hub / embedded.COMPLETE_MARKER).is_file(),
        embedded.GGUF_NAME: (user_models / embedded.GGUF_NAME).is_file(),
    }
    for name, present in sources.items():
        target = models / name
        if present and not target.exists():
            target.symlink_to((user_models / name).resolve())
