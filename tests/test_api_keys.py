"""With an API key set, every route but the open ones answers 401 without it, in its surface's shape.

Runs against a real node started with `--api-key-file`; the table of routes is the app's own route
list, so a route added later is covered (or the test says it lacks an example path).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from starlette.routing import Route

from api.app import create_app
from api.auth import is_open
from api.backend import Backend
from tests.nodes import RunningNode, start_node

KEY = "sk-test-0123456789"
PARAMS = {"model_id": "m", "request_id": "r", "instance_id": "i", "name": "app.js", "path": "x"}
"""An example value for every path parameter of the app's routes."""


def _routes() -> list[tuple[str, str]]:
    """Every (method, concrete path) the app serves."""
    app = create_app(cast(Backend, None))
    found: list[tuple[str, str]] = []
    for route in app.routes:
        assert isinstance(route, Route), route
        path = re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: PARAMS[m.group(1)], route.path)
        found += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    found.append(("HEAD", "/"))  # Ollama's liveness probe: a HEAD-only route
    return found


ROUTES = _routes()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    key_file = tmp_path_factory.mktemp("secrets") / "api-key"
    key_file.write_text(KEY + "\n")  # a trailing newline, as editors write it, is not part of the key
    running = start_node(
        "--api-key-file", str(key_file), data_dir=tmp_path_factory.mktemp("data"), model=None
    )
    yield running
    running.stop()


def _status_and_body(node: RunningNode, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    """The status, and the JSON body of a 401 (streams are closed after their status line)."""
    with (
        httpx.Client(base_url=node.base_url, timeout=30) as http,
        http.stream(
            method, path, headers={"content-type": "application/json", **headers}, content=b"{}"
        ) as r,
    ):
        return r.status_code, (r.read() and r.json()) if r.status_code == 401 else None


def _check_shape(path: str, body: Any) -> None:
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    elif path.startswith("/api/"):
        assert isinstance(body["error"], str) and "API key" in body["error"], body
    else:
        assert body["error"]["code"] == "invalid_api_key", body


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_every_route_needs_the_key(node: RunningNode, method: str, path: str) -> None:
    wrong = {"authorization": "Bearer sk-wrong"}
    for headers in ({}, wrong, {"x-api-key": "sk-wrong"}, {"authorization": f"Basic {KEY}"}):
        status, body = _status_and_body(node, method, path, headers)
        if is_open(method, path):
            assert status != 401, (headers, status)
        else:
            assert status == 401, (headers, status)
            _check_shape(path, body)
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert _status_and_body(node, method, path, headers)[0] != 401, headers


def test_official_clients_send_the_key_their_way(node: RunningNode) -> None:
    import anthropic
    import ollama
    import openai

    assert openai.OpenAI(base_url=f"{node.base_url}/v1", api_key=KEY, max_retries=0).models.list().data == []
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=node.base_url, api_key="nope", max_retries=0).messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    # Ollama's client sends no key of its own: headers go through as given.
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=node.base_url).list()
    assert refused.value.status_code == 401
    assert ollama.Client(host=node.base_url, headers={"authorization": f"Bearer {KEY}"}).list().models == []


def test_a_refused_request_changes_nothing(node: RunningNode) -> None:
    http = httpx.Client(base_url=node.base_url, timeout=30)
    assert http.post("/v1/instances", json={"model": "smollm2-135m"}).status_code == 401
    listed = http.get("/v1/instances", headers={"x-api-key": KEY})
    assert listed.status_code == 200 and listed.json()["data"] == []


def test_the_cli_passes_the_key(node: RunningNode, tmp_path: Path) -> None:
    import subprocess
    import sys

    def status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "node.cli", "status", "--api", node.base_url, "--json", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)

    refused = status()
    assert refused.returncode == 1 and "needs an API key" in refused.stderr
    assert status("--api-key", KEY).returncode == 0
