"""A local stand-in for the Hugging Face hub: the few endpoints huggingface_hub calls to
fetch one model repository (model info, file tree, file metadata and download).

No hub is reachable from our machines, so the hub route of the embedded-model fetch is
tested against this server, through the real huggingface_hub client, with HF_ENDPOINT.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repo: str, files: dict[str, Path]):
        self.repo = repo
        self.files = files
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, *, body: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                api = f"/api/models/{hub.repo}"
                if path in (api, f"{api}/revision/main", f"{api}/revision/{COMMIT}"):
                    return self._json(hub.info(), body)
                if path.startswith(f"{api}/tree/"):
                    return self._json(hub.tree(), body)
                prefix = f"/{hub.repo}/resolve/"
                if path.startswith(prefix):
                    name = path[len(prefix) :].split("/", 1)[1]
                    if name in hub.files:
                        return self._file(hub.files[name], body)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, data, body: bool):
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                if body:
                    self.wfile.write(raw)

            def _file(self, path: Path, body: bool):
                raw = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.send_header("ETag", f'"{hashlib.sha256(raw).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if body:
                    self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def info(self) -> dict:
        siblings = [{"rfilename": n, "size": p.stat().st_size} for n, p in self.files.items()]
        return {"id": self.repo, "modelId": self.repo, "sha": COMMIT, "siblings": siblings}

    def tree(self) -> list[dict]:
        return [
            {
                "type": "file",
                "path": name,
                "size": path.stat().st_size,
                "oid": hashlib.sha1(path.read_bytes()).hexdigest(),
            }
            for name, path in self.files.items()
        ]

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
