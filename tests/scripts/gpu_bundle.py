"""Make the bundle that tests/scripts/gpu_check.sh installs on a lent CUDA machine that
reaches no package index: MLX's CUDA wheels and the agentkv dependencies its Python lacks,
unpacked into one ``site.tar.xz``, and the embedded tokenizer's files (the tiny test models'
tokenizer; the embedded model's own package is too large to carry).

The lent machines take at most 64 MiB a call, and ``libmlx.so`` of ``mlx-cuda-13`` is 145 MB:
its CUDA fat binary holds machine code for several GPU generations. ``--arch`` keeps one
(sm_90: H100, H200) and the PTX, and zeroes the other entries' bytes in place, so the file
keeps its layout and the zeros compress away (the bundle is ~40 MB).

    python tests/scripts/gpu_bundle.py .devkit   # then, there: bash tests/scripts/gpu_check.sh

``.devkit/`` is git-ignored: carry it to the machine (the device tool's ``carry``).
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MLX = "0.32.4"
WHEELS = [
    f"mlx=={MLX}",
    f"mlx-cuda-13=={MLX}",
    "nanobind==3.1.0",
    "mlx-lm==0.32.2",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "pydantic==2.14.4",
    "pydantic_core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "llguidance==1.9.1",
    "scipy-openblas32==0.3.34.481.3",
    "gguf==0.19.0",
]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64"]  # fmt: skip
FATBIN_MAGIC = 0xBA55ED50
PTX = 1


def download(dest: Path, python: str) -> list[Path]:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    args += ["--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        args += ["--platform", p]
    subprocess.run(args + WHEELS, check=True)
    return sorted(dest.glob("*.whl"))


def fatbin_section(path: Path) -> tuple[int, int]:
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)  # file offset, size
    raise SystemExit(f"no .nv_fatbin section in {path}")


def keep_one_arch(path: Path, arch: int) -> dict[tuple[int, int], int]:
    """Zero every cubin of ``path``'s fat binaries but ``arch``'s (PTX stays); bytes per
    (kind, arch) before."""
    data = bytearray(path.read_bytes())
    start, size = fatbin_section(path)
    pos, end, seen = start, start + size, {}
    while pos < end:
        magic, _, header, fat = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8
            continue
        entry, stop = pos + header, pos + header + fat
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            seen[(kind, sm)] = seen.get((kind, sm), 0) + payload
            if kind != PTX and sm != arch:
                body = entry + entry_header
                data[body : body + payload] = bytes(payload)
            entry += entry_header + payload
        pos = stop
    path.write_bytes(data)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="folder for site.tar.xz and tokenizer/")
    parser.add_argument("--arch", type=int, default=90, help="the GPU's sm_ number (90: H100)")
    parser.add_argument("--python", default="3.12", help="the lent machine's Python")
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        for wheel in download(wheels, args.python):
            zipfile.ZipFile(wheel).extractall(site)
        seen = keep_one_arch(site / "mlx" / "lib" / "libmlx.so", args.arch)
        sizes = {k: round(v / 1e6, 1) for k, v in seen.items()}
        print("libmlx.so fat binary, MB per (kind, sm):", sizes)
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
        with open(args.dest / "site.tar.xz", "wb") as out:
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=out, check=True)
        tar.wait()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import TOKENIZER_FILES

    from agentkv.model.load import ensure_embedded_model

    (args.dest / "tokenizer").mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(ensure_embedded_model() / name, args.dest / "tokenizer" / name)
    print(f"{args.dest / 'site.tar.xz'}: {(args.dest / 'site.tar.xz').stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
