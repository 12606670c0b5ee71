"""Stored Responses (``POST /v1/responses`` with ``store``), durable across restarts.

One JSON file per response under ``<cache dir>/responses/``: the response object as it was
returned, the agent whose KV cache holds the conversation, and the conversation itself
(normalized chat messages, the instructions apart) that a ``previous_response_id`` turn
continues. Written as every agentkv file that matters is (temporary file, fsync, atomic
rename, fsync of the directory): a crash leaves the record whole or absent. Ids are checked
against ``resp_<hex>`` before any path is built from them.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ..paths import atomic_write_text, secure_mkdir

log = logging.getLogger("agentkv.server")

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
FORMAT = 1


def valid_id(response_id) -> bool:
    return isinstance(response_id, str) and RESPONSE_ID.match(response_id) is not None


class ResponseStore:
    """``put`` / ``get`` / ``delete`` of response records by id (blocking file I/O: call
    from a worker thread)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def _path(self, response_id: str) -> Path:
        if not valid_id(response_id):
            raise ValueError(f"not a response id: {response_id!r}")
        return self.dir / f"{response_id}.json"

    def put(self, record: dict) -> None:
        secure_mkdir(self.dir)
        text = json.dumps({"format": FORMAT, **record}, ensure_ascii=False)
        atomic_write_text(self._path(record["id"]), text)

    def get(self, response_id: str) -> dict | None:
        """The record, or None when there is none (or it cannot be read: a warning says why)."""
        path = self._path(response_id)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("agentkv: stored response %s is unreadable (%s); ignored", path, exc)
            return None
        if (
            not isinstance(record, dict)
            or record.get("format") != FORMAT
            or record.get("id") != response_id
        ):
            log.warning("agentkv: stored response %s is not a response record; ignored", path)
            return None
        return record

    def delete(self, response_id: str) -> bool:
        try:
            self._path(response_id).unlink()
        except FileNotFoundError:
            return False
        return True
