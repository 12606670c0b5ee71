"""A real S3-compatible server for the tests: moto's server mode in a subprocess on
127.0.0.1 and a free port (``moto[server]``, in the test extra). The tests talk to it over
HTTP through boto3 exactly as agentkv talks to AWS S3 or MinIO; nothing is mocked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

BUCKET = "agentkv-tests"


@dataclass
class S3Server:
    port: int
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client of this server reads."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def start(self) -> S3Server:
        """Start (or start again, on the same port: the store comes back empty)."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.05)
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def stop(self) -> None:
        """Kill the server (a store that goes down)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def client(self):
        import boto3

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_REGION"],
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_env(monkeypatch, server: S3Server) -> None:
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    assert os.environ["AWS_ENDPOINT_URL"] == server.endpoint
