"""The docs cite only what exists: README.md and docs/*.md checked against the code.

The convention the docs are written to (outside fenced code blocks, in `inline code`):

* A code name is spelled in full from the package: `agentkv.engine.resume.Resumer`,
  `agentkv.Engine.chat`. Every backticked span that starts with ``agentkv.`` is read up
  to its first character that cannot be part of a dotted name (so `agentkv.kernels.backend()`
  checks ``agentkv.kernels.backend``); the longest importable prefix must import and the rest
  must resolve as attributes (a dataclass field, an annotated attribute, or one the class's
  own code assigns to ``self`` counts). In examples of the Python API, `eng.` stands for an
  ``agentkv.Engine``, `r.` for an ``agentkv.ChatResult`` and `r.stats.` for its
  ``agentkv.TurnStats``, and are checked as those (`eng.fork_agent(src, dst)` checks
  ``agentkv.Engine.fork_agent``). Other short forms (`KVQuant.layer(i)`) are prose and are not
  checked.
* A repository file is spelled from the repository root (`src/agentkv/pool/blocks.py`,
  `csrc/core/gemm.cpp`, `kernels/shim.h`, `tests/pool/test_blocks.py`) or, for the package's
  own modules, from ``src/agentkv`` (`pool/blocks.py`, `mlx_adapter.py`). A backticked span
  with no spaces that starts with a repository folder (``src/``, ``csrc/``, ``kernels/``,
  ``tests/``, ``benchmarks/``, ``docs/``, ``.ci/``) or ends in a source extension (``.py``,
  ``.pyi``, ``.metal``, ``.h``, ``.c``, ``.cpp``, ``.inc``, ``.md``, ``.toml``) must exist
  under one of those two roots; a ``*`` in it is a glob that must match something. Spans
  with placeholders or other roots (``<``, ``$``, ``~``, ``/`` first) are not paths of ours;
  other projects' files are written with their package first (`mlx_lm/models/cache.py`) and
  skipped.
* Relative Markdown links (``[text](docs/pool.md)``) must point at existing files.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "agentkv"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

REPO_FOLDERS = ("src/", "csrc/", "kernels/", "tests/", "benchmarks/", "docs/", ".ci/")
SOURCE_SUFFIXES = (".py", ".pyi", ".metal", ".h", ".c", ".cpp", ".inc", ".md", ".toml")
FOREIGN = ("mlx_lm/", "mlx/", "vllm/", "llama.cpp/")
NOT_PATHS = ("<", "$", "~", "/", "http")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")  # inline code may wrap onto the next line
DOTTED = re.compile(r"agentkv(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")


ALIASES = {"eng.": "agentkv.Engine.", "r.stats.": "agentkv.TurnStats.", "r.": "agentkv.ChatResult."}


def _spans(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [" ".join(span.split()) for span in SPAN.findall(text)]


def _cited_names(page: Path) -> set[str]:
    found = set()
    for span in _spans(page):
        for short, full in ALIASES.items():
            if span.startswith(short):
                span = full + span[len(short) :]
                break
        m = DOTTED.match(span)
        if m:
            found.add(m.group(0))
    return found


def _is_path(span: str) -> bool:
    if " " in span or span.startswith(NOT_PATHS) or span.startswith(FOREIGN):
        return False
    return span.startswith(REPO_FOLDERS) or span.endswith(SOURCE_SUFFIXES)


def _cited_paths(page: Path) -> set[str]:
    return {s.rstrip(".,:;") for s in _spans(page) if _is_path(s.rstrip(".,:;"))}


def _has_attribute(obj: object, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if isinstance(obj, type):
        if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
            return True
        assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=[^=]")
        for cls in obj.__mro__:
            if name in getattr(cls, "__annotations__", {}):
                return True
            if cls.__module__.startswith("agentkv") and assigned.search(inspect.getsource(cls)):
                return True
    return False


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` imports (module) or resolves (attribute), else what failed."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # this prefix is not a module: try a shorter one
            return f"importing {module_name} failed: {exc}"
        for i, attr in enumerate(parts[cut:]):
            if not _has_attribute(obj, attr):
                return f"{'.'.join(parts[: cut + i])} has no attribute {attr!r}"
            obj = getattr(obj, attr, None)
        return None
    return f"no module {parts[0]!r}"


def exists(path: str) -> bool:
    """Whether ``path`` names something inside the repository, from its root or src/agentkv."""
    for root in (ROOT, PACKAGE):
        if "*" in path:
            if any(p.resolve().is_relative_to(ROOT) for p in root.glob(path)):
                return True
        elif (root / path).resolve().is_relative_to(ROOT) and (root / path).exists():
            return True
    return False


def exists_from(page: Path, target: str) -> bool:
    target = (page.parent / target.split("#", 1)[0]).resolve()
    return target.is_relative_to(ROOT) and target.exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_code_names_exist(page):
    missing = {name: why for name in sorted(_cited_names(page)) if (why := resolve(name))}
    assert not missing, f"{page.name} cites names the code lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_files_exist(page):
    missing = sorted(p for p in _cited_paths(page) if not exists(p))
    assert not missing, f"{page.name} cites files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_exist(page):
    links = [t for t in LINK.findall(page.read_text(encoding="utf-8")) if "://" not in t]
    missing = [t for t in links if not t.startswith("#") and not exists_from(page, t)]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_readme_is_a_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < 250, f"README.md has {lines} lines; move detail to docs/"


def test_the_checks_catch_drift(tmp_path):
    """The checks themselves: a name or file that is not there is reported."""
    page = tmp_path / "probe.md"
    page.write_text(
        "`eng.fork_agent(src, dst)`, `r.stats.match`, `agentkv.kernels.backend()`, `agentkv\n"
        "doctor`\n```python\nx = `agentkv.not_checked`\n```\n`pool/blocks.py`.\n"
    )
    assert _cited_names(page) == {
        "agentkv.Engine.fork_agent",
        "agentkv.TurnStats.match",
        "agentkv.kernels.backend",
    }
    assert _cited_paths(page) == {"pool/blocks.py"}
    assert resolve("agentkv.Engine.chat") is None
    assert resolve("agentkv.engine.results.TurnStats.match") is None
    assert resolve("agentkv.pool.arena.KVArena.copies") is None  # assigned in __init__
    assert resolve("agentkv.Engine.no_such_method") is not None
    assert resolve("agentkv.no_such_module.thing") is not None
    assert exists("pool/blocks.py") and exists("csrc/core/gemm.cpp") and exists("kernels/*.metal")
    assert not exists("pool/no_such_file.py") and not exists("../shared/DESIGN.md")
    assert _is_path("kernels/shim.h") and _is_path("mlx_adapter.py")
    assert not _is_path("mlx_lm/models/cache.py") and not _is_path("/v1/chat/completions")
