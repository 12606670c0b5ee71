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
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines < 200, f"README.md has {lines} lines; move detail to docs/"
    results = text.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in results.splitlines() if row.startswith("| ")][2:]  # past the header
    assert len(rows) >= 5 and "benchmarks/RESULTS.md" in results and "docs/benchmarks.md" in results
    long = [row[:60] for row in rows if len(row) > 200]
    assert not long, f"README's results: one claim a row, each short; these are paragraphs: {long}"


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


# -- figures: the model's size, its wide layers, the test suite's counts ---------------------
#
# What README.md and docs/ say of these must be what the code gives, or what the newest test
# run recorded in benchmarks/RESULTS.md gives. A size in MB or MiB on a line that speaks of
# weights or a GGUF file is one of the embedded model's: its 4-bit weights as loaded, the same
# weights in float32, or its GGUF file, at the precision written. A pair of wide layers
# (`q4.v2+k8@19,20`, "layers 19 and 20", "19 and 20 with its 4-bit weights") is the default
# engine's, or on a line (or after one) that says float32, the float32 weights' (the other
# shipped calibration). Test counts
# ("passed N tests and skipped M in S s") are the newest run's.

RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SIZE = re.compile(r"\b(\d+(?:\.\d+)?) ?(MB|MiB)\b")
WIDE_LABEL = re.compile(r"k8@(\d+),(\d+)")
WIDE_PAIR = re.compile(
    r"(?:layers?|model:?)\s+\(?(\d{1,2}) and (\d{1,2})\b"
    r"|\b(\d{1,2}) and (\d{1,2}) with (?:its |the )?(?:default )?(?:4-bit|float32) weights"
)
CITED_RUN = re.compile(r"passed ([\d,]+)\s+tests\s+and\s+skipped\s+([\d,]+)\s+in\s+([\d,]+)\s+s\b")
RECORDED_RUN = re.compile(r"\*\*([\d,]+) passed, ([\d,]+) skipped\s+in\s+([\d,]+) s\*\*")
# A run named by an internal session letter ("session C", "sessions I-P", "R's type") instead
# of its date, commit and machine.
SESSION_LETTER = re.compile(
    r"\b[Ss]essions [A-Z]-[A-Z]\b|\b[Ss]essions? [A-Z]\b"
    r"|\b[A-Z]'s (?:runs?|type|hours?|build|figures|section|table|VM)\b"
)


def _prose_lines(page: Path) -> list[str]:
    return FENCE.sub("", page.read_text(encoding="utf-8")).splitlines()


def _written(value: float, text: str) -> bool:
    """Whether ``text`` (a number as written) is ``value`` rounded to its precision."""
    places = len(text.split(".")[1]) if "." in text else 0
    return round(value, places) == float(text)


@pytest.fixture(scope="module")
def model_sizes(engine) -> dict[str, list[float]]:
    """The embedded model's sizes by unit: its 4-bit weights as loaded, the same in float32
    (every parameter at 4 bytes), its GGUF file."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from agentkv.model.load import embedded_gguf_path

    loaded = sum(v.nbytes for _, v in tree_flatten(engine.loaded.model.parameters()))
    shape = llama.Model(llama.ModelArgs.from_dict(engine.loaded.config))
    float32 = 4 * sum(v.size for _, v in tree_flatten(shape.parameters()))
    sizes = [loaded, float32, embedded_gguf_path().stat().st_size]
    return {"MB": [b / 1e6 for b in sizes], "MiB": [b / 2**20 for b in sizes]}


@pytest.fixture(scope="module")
def wide_pairs(engine) -> tuple[tuple[int, ...], set[tuple[int, ...]]]:
    """(the default engine's wide layers, those of the other shipped calibrations)."""
    import json

    from agentkv.model import wide_layers

    default = tuple(engine.quant.wide_layers)
    shipped = [json.loads(p.read_text()) for p in sorted(wide_layers.SHIPPED.glob("*.json"))]
    others = {
        wide_layers.choose(r["errors"])
        for r in shipped
        if r["fingerprint"] != engine.spec.fingerprint
    }
    return default, others


def _wrong_sizes(page: Path, sizes: dict[str, list[float]]) -> list[str]:
    wrong = []
    for line in _prose_lines(page):
        if re.search(r"weights|gguf", line, re.I):
            wrong += [f"{n} {unit}: {line.strip()[:120]}" for n, unit in SIZE.findall(line)
                      if not any(_written(v, n) for v in sizes[unit])]  # fmt: skip
    return wrong


def _wrong_wide_layers(page: Path, default: tuple, float32: set) -> list[str]:
    lines = _prose_lines(page)
    wrong = []
    for i, line in enumerate(lines):
        pairs = WIDE_LABEL.findall(line)
        pairs += [tuple(n for n in found if n) for found in WIDE_PAIR.findall(line)]
        says_float32 = "float32" in " ".join(lines[max(i - 1, 0) : i + 1])
        allowed = {default} | (float32 if says_float32 else set())
        wrong += [f"{a},{b}: {line.strip()[:120]}" for a, b in pairs
                  if (int(a), int(b)) not in allowed]  # fmt: skip
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_model_sizes_are_the_model_s(page, model_sizes):
    wrong = _wrong_sizes(page, model_sizes)
    assert not wrong, f"{page.name}: sizes that are not the embedded model's: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_wide_layers_are_the_engine_s(page, wide_pairs):
    wrong = _wrong_wide_layers(page, *wide_pairs)
    assert not wrong, f"{page.name}: wide layers not the engine's {wide_pairs[0]}: {wrong}"


def test_the_figure_checks_catch_drift(tmp_path, model_sizes, wide_pairs):
    """The figure checks themselves: a size, a wide-layer pair or a run letter that is not
    the code's is reported, and only that."""
    page = tmp_path / "probe.md"
    page.write_text(
        "The 4-bit weights: 98 MB (float32 weights: 538 MB), 84 MB in an older note.\n"
        "A 29 MB cache.\n"
        "Wide layers 19 and 20 with its 4-bit weights, 18 and 19 with float32 weights.\n"
        "\n"
        "`q4.v2+k8@19,20`; once `q4.v2+k8@18,19`.\n"
        "Format 2 keeps layers 18 and 19 wide; formats 1 and 2 differ. As session Q saw.\n"
        "Against R's run, in P's hour, on the VM of G-Q's type; sessions I-P; Session C.\n"
        "Agent B's TTFT, A's chunks, N agents, N x K, an A/B run, Q4_1's scales, KV's type.\n"
    )
    assert [w.split(":")[0] for w in _wrong_sizes(page, model_sizes)] == ["84 MB"]
    wrong = [w.split(":")[0] for w in _wrong_wide_layers(page, *wide_pairs)]
    assert wrong == ["18,19", "18,19"]  # the label of line 5, the pair of line 6
    assert SESSION_LETTER.findall(page.read_text()) == [
        "session Q", "R's run", "P's hour", "Q's type", "sessions I-P", "Session C",
    ]  # fmt: skip
    cited = "passed 855 tests and\nskipped 43 in 1324 s; passed 9 tests and skipped 1 in 2 s"
    assert CITED_RUN.findall(cited) == [("855", "43", "1324"), ("9", "1", "2")]


def _newest_run() -> tuple[str, str, str]:
    """(passed, skipped, seconds) of the newest test run benchmarks/RESULTS.md records (the
    file is newest first)."""
    found = RECORDED_RUN.search(RESULTS.read_text(encoding="utf-8"))
    assert found, "benchmarks/RESULTS.md records no test run"
    return found.groups()


def test_test_counts_are_the_newest_recorded_run():
    newest = _newest_run()
    cited = {page.name: CITED_RUN.findall(page.read_text(encoding="utf-8")) for page in PAGES}
    assert cited["README.md"], "README.md cites no test run"
    wrong = {name: runs for name, runs in cited.items() if any(r != newest for r in runs)}
    assert not wrong, f"test runs that are not the newest recorded one {newest}: {wrong}"


@pytest.mark.parametrize("page", [*PAGES, RESULTS], ids=lambda p: p.name)
def test_runs_are_named_by_date_commit_and_machine(page):
    letters = [m.group(0) for m in SESSION_LETTER.finditer(page.read_text(encoding="utf-8"))]
    assert not letters, f"{page.name} names runs by letter: {letters}"
