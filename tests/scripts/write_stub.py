"""Write src/agentkv/_ext.pyi from the built extension (nanobind's stubgen).

Run after changing csrc/bindings.cpp and rebuilding; tests/test_stub.py fails while
the committed stub differs from what the extension would generate:

    python tests/scripts/write_stub.py
"""

import sys
from pathlib import Path

STUB = Path(__file__).resolve().parents[2] / "src" / "agentkv" / "_ext.pyi"


def generate() -> str:
    from nanobind.stubgen import StubGen

    import agentkv  # noqa: F401  (BLAS preload and mlx.core before the extension)
    import agentkv._ext as ext

    gen = StubGen(ext)
    gen.put(ext)
    return gen.get()


if __name__ == "__main__":
    STUB.write_text(generate())
    print(f"wrote {STUB}", file=sys.stderr)
