"""Every vector path of the host kernels against the portable one, bit for bit, from C++
(``paths_check.cpp``: the quantized matmul at 4, 5 and 8 bits, groups of 32-128, 1-13 rows;
attention over format 1 and format 2 caches, 1-17 queries; SwiGLU with infinities, NaN and
values below exp's range). Built for this machine (AVX2 / AVX-512 VNNI on x86), and for
aarch64 run under qemu where the cross compiler and qemu-user are installed (Debian:
``g++-aarch64-linux-gnu qemu-user``): the NEON paths cannot run on x86 otherwise."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    ROOT / "tests" / "native" / "paths_check.cpp",
    *(
        ROOT / "csrc" / "core" / f
        for f in ("qmm.cpp", "attention.cpp", "rows.cpp", "thread_pool.cpp")
    ),
]


def _build(compiler: str, out: Path) -> None:
    flags = ["-std=c++20", "-O2", "-ffp-contract=off", f"-I{ROOT / 'csrc'}"]
    done = subprocess.run(
        [compiler, *flags, "-o", str(out), *map(str, SOURCES), "-lpthread"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _run(command: list[str], portable: bool) -> tuple[str, bytes]:
    env = {k: v for k, v in os.environ.items() if k != "AGENTKV_CPU"}
    if portable:
        env["AGENTKV_CPU"] = "portable"
    done = subprocess.run(command, capture_output=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stderr.decode().strip(), done.stdout  # "<matmul path> <attention path>"


def _same_bits(command: list[str], vector_paths: tuple[str, ...]) -> None:
    (paths, fast), (portable_paths, slow) = _run(command, False), _run(command, True)
    assert portable_paths == "portable portable"
    assert paths.split()[0] in vector_paths, paths
    assert len(fast) == len(slow) > 80_000
    assert fast == slow


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_this_machines_vector_paths_give_the_portable_bits(tmp_path):
    import platform

    vector = {"x86_64": ("avx512-vnni", "avx2"), "aarch64": ("neon",)}.get(platform.machine())
    if vector is None:
        pytest.skip(f"no vector path on {platform.machine()}")
    binary = tmp_path / "paths_check"
    _build("g++", binary)
    _same_bits([str(binary)], vector)


@pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-g++") is None or shutil.which("qemu-aarch64") is None,
    reason="needs g++-aarch64-linux-gnu and qemu-user (Debian packages) to run NEON on x86",
)
def test_the_neon_paths_give_the_portable_bits_under_qemu(tmp_path):
    binary = tmp_path / "paths_check_aarch64"
    _build("aarch64-linux-gnu-g++", binary)
    _same_bits(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(binary)], ("neon",))
