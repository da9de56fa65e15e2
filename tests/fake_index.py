"""A package index on 127.0.0.1 for tests: PEP 503 simple pages and the files they link to.

`FakeIndex.add(project, filename, body)` publishes a file; its link carries the body's sha256 unless
the test gives another (`listed_sha256`). With `credentials`, the simple pages need Basic auth with
them (a private index); a file's link answers with a redirect to `localhost` (another host name
for the same server: a CDN), which serves it to anyone. Every request's path is kept in
`requests`, and those that carried an `Authorization` header in `authorized`.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class FakeIndex:
    url: str = ""
    """`http://127.0.0.1:PORT/simple/` once serving."""
    port: int = 0
    credentials: tuple[str, str] | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    links: dict[str, list[str]] = field(default_factory=dict)
    """Project -> the anchors of its simple page."""
    requests: list[str] = field(default_factory=list)
    authorized: list[str] = field(default_factory=list)

    def add(self, project: str, filename: str, body: bytes, listed_sha256: str | None = None) -> None:
        self.files[filename] = body
        sha256 = listed_sha256 or hashlib.sha256(body).hexdigest()
        self.links.setdefault(project, []).append(
            f'<a href="../../files/{filename}#sha256={sha256}">{filename}</a>'
        )

    def index_url(self, *, with_credentials: bool = False) -> str:
        if not with_credentials or self.credentials is None:
            return self.url
        user, password = self.credentials
        return self.url.replace("http://", f"http://{user}:{password}@", 1)


def _handler(index: FakeIndex) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            index.requests.append(self.path)
            if self.headers.get("Authorization") is not None:
                index.authorized.append(self.path)
            parts = self.path.strip("/").split("/")
            if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.links:
                if not self._authorized():
                    self._send(401, b"unauthorized", "text/plain")
                    return
                page = "<html><body>" + "".join(index.links[parts[1]]) + "</body></html>"
                self._send(200, page.encode(), "text/html")
            elif parts[0] == "files" and len(parts) == 2 and parts[1] in index.files:
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{index.port}/cdn/{parts[1]}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif parts[0] == "cdn" and len(parts) == 2 and parts[1] in index.files:
                self._send(200, index.files[parts[1]], "application/octet-stream")
            else:
                self._send(404, b"not found", "text/plain")

        def _authorized(self) -> bool:
            if index.credentials is None:
                return True
            expected = base64.b64encode(":".join(index.credentials).encode()).decode()
            return self.headers.get("Authorization") == f"Basic {expected}"

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def serving(index: FakeIndex) -> Iterator[FakeIndex]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(index))
    index.port = int(server.server_address[1])
    index.url = f"http://127.0.0.1:{index.port}/simple/"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def make_wheel(path: Path, members: dict[str, bytes | Path], *, compress: bool = False) -> bytes:
    """A wheel-shaped zip: `members` by name, each bytes or a file to copy in; returns its bytes."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        for name, body in members.items():
            if isinstance(body, Path):
                archive.write(body, name)
            else:
                archive.writestr(name, body)
    return path.read_bytes()
