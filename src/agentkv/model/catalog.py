"""What is in the models directory: imported GGUFs, hub copies, GGUF files."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..paths import models_dir
from . import embedded
from .gguf import read_import_info


@dataclass(frozen=True)
class CachedModel:
    name: str
    kind: str  # "gguf-import" | "hub" | "mlx-lm" | "gguf-file"
    path: Path
    bytes: int
    model_type: str | None
    default: bool  # what the embedded default resolves to on this device

    def to_dict(self) -> dict:
        return {**asdict(self), "path": str(self.path)}


def cached_models() -> list[CachedModel]:
    root = models_dir()
    if not root.is_dir():
        return []
    default = _default_path()
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir() and (entry / "config.json").is_file():
            kind = (
                "gguf-import"
                if read_import_info(entry) is not None
                else "hub"
                if (entry / embedded.COMPLETE_MARKER).is_file()
                else "mlx-lm"
            )
            found.append(
                CachedModel(
                    entry.name, kind, entry, _bytes(entry), _model_type(entry), entry == default
                )
            )
        elif entry.is_file() and entry.suffix == ".gguf":
            found.append(CachedModel(entry.name, "gguf-file", entry, _bytes(entry), None, False))
    return found


def _default_path() -> Path | None:
    from .load import embedded_import_dir

    cached = embedded.cached_source()
    if cached is None:
        return None
    if cached[0] == "hub":
        return cached[1]
    return embedded_import_dir()


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
