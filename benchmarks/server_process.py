"""A real ``agentkv serve`` process on 127.0.0.1 (for ``bench serve`` and the server tests)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``agentkv serve`` in a subprocess on a free port; ``start`` waits for ``/health``."""

    def __init__(self, cache_dir: Path, env: dict | None, *extra: str, api_key: str | None = None):
        self.cache_dir = cache_dir
        self.env = env
        self.extra = extra
        self.api_key = api_key
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = cache_dir.parent / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 120) -> ServerProcess:
        args = [sys.executable, "-m", "agentkv.cli.main", "serve", "--port", str(self.port)]
        args += ["--cache-dir", str(self.cache_dir), "--log-level", "warning", *self.extra]
        if self.api_key:
            args += ["--api-key", self.api_key]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agentkv serve exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise RuntimeError("agentkv serve did not come up")

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.proc = None
        return code

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)
