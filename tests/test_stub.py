"""The committed type stub of the extension matches the built extension."""

import sys

from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))

from write_stub import STUB, generate  # noqa: E402


def test_committed_stub_is_current():
    assert STUB.read_text() == generate(), (
        "src/agentkv/_ext.pyi is stale: run `python tests/scripts/write_stub.py` and commit it"
    )
