"""The package layering of docs/architecture.md, checked from the source (``ast``, no imports
run): each package imports only packages of a lower layer, so there are no cycles and no
upward imports between them; mlx-lm is imported only by ``mlx_adapter``; and no function
in src/ grows past the size where it is usually two things.

Every import counts, at module level or inside a function (a deferred import is still a
dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agentkv"

# Lowest first. A package may import its own modules and any package of a lower layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_faults", "_quiet", "_blas", "_numerics", "_ext", "errors"),
    ("agent_id", "paths"),
    ("progress",),
    ("format",),
    ("kernels", "mlx_adapter"),
    ("pool", "kv"),
    ("store",),
    ("model", "text", "tools"),
    ("engine", "prompt_cache"),
    ("__init__",),
    ("server", "doctor"),
    ("cli",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_FUNCTION_LINES = 120


def _package(path: Path) -> str:
    """``format`` for src/agentkv/format/quant.py, ``paths`` for src/agentkv/paths.py."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module(path: Path, root: Path) -> list[str]:
    rel = path.relative_to(root).with_suffix("")
    parts = ["agentkv", *rel.parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: Path, root: Path = SRC) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import x` / `from agentkv import x` may name a submodule
            if module == "agentkv":
                found += [(node.lineno, f"agentkv.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return found


def _target_package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "agentkv":
        return None
    if len(parts) == 1:
        return "__init__"
    name = parts[1]
    return name if name in RANK else "__init__"  # a name of the package root (BLAS_STATUS)


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "benchmarks" not in p.relative_to(SRC).parts)


def test_every_module_has_a_layer():
    missing = sorted({_package(p) for p in _sources()} - set(RANK))
    assert not missing, f"give these packages a layer in LAYERS: {missing}"


def test_packages_import_only_lower_layers():
    wrong = []
    for path in _sources():
        source = _package(path)
        for line, module in _imports(path):
            target = _target_package(module)
            if target is None or target == source:
                continue
            if RANK[target] >= RANK[source]:
                rel = path.relative_to(SRC.parent)
                wrong.append(f"{rel}:{line} ({source}, layer {RANK[source]}) imports {module}")
    assert not wrong, "upward or sideways imports:\n" + "\n".join(wrong)


def test_only_the_adapter_imports_mlx_lm():
    wrong = [
        f"{path.relative_to(SRC.parent)}:{line} imports {module}"
        for path in _sources()
        if path.name != "mlx_adapter.py"
        for line, module in _imports(path)
        if module.split(".")[0] == "mlx_lm"
    ]
    assert not wrong, "mlx-lm is reached only through agentkv.mlx_adapter:\n" + "\n".join(wrong)


def test_no_function_is_too_long():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_checker_resolves_what_it_must_catch(tmp_path):
    """Relative, deferred and ``from agentkv import x`` imports all resolve to their package."""
    root = tmp_path / "agentkv"
    (root / "format").mkdir(parents=True)
    probe = root / "format" / "probe.py"
    probe.write_text(
        "from ..engine import Engine\n"
        "from . import geometry\n"
        "def f():\n"
        "    from agentkv import kernels\n"
        "    import mlx_lm.models.cache\n"
    )
    found = [module for _, module in _imports(probe, root)]
    assert found == ["agentkv.engine", "agentkv.format", "agentkv.kernels", "mlx_lm.models.cache"]
    assert [_target_package(m) for m in found[:3]] == ["engine", "format", "kernels"]
    assert RANK["engine"] > RANK["format"] < RANK["kernels"]
