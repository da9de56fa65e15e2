"""Start real `shoal run` processes for tests and wait for them on events, not on sleeps."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

_LISTENING = re.compile(r"API listening on (http://\S+)")
_P2P = re.compile(r"p2p listening on (/ip4/\S+)")
_READY = re.compile(r"model (\S+) ready")


@dataclass
class RunningNode:
    process: subprocess.Popen[str]
    base_url: str
    model_id: str | None
    p2p_addr: str = ""
    netns: str | None = None
    """The network namespace the node runs in (its API is reachable only from there)."""
    log: list[str] = field(default_factory=list)
    _lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    _output_closed: threading.Event = field(default_factory=threading.Event)

    def wait_output_closed(self, timeout: float) -> None:
        """Wait until every process writing to the node's output (it and its runners) has let go."""
        assert self._output_closed.wait(timeout), "the node's output is still open"

    def wait_for_log(self, pattern: str | re.Pattern[str], timeout: float) -> re.Match[str]:
        """Wait until a log line (old or new) matches; fail with the log when it doesn't in time."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        for line in self.log:
            if match := regex.search(line):
                return match
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if item is None:
                raise AssertionError(f"node exited before {regex.pattern!r}:\n" + "".join(self.log[-40:]))
            if match := regex.search(item):
                return match
        raise AssertionError(f"no log line {regex.pattern!r} within {timeout}s:\n" + "".join(self.log[-40:]))

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.base_url}/health", timeout=10).json()

    def cluster(self) -> dict[str, Any]:
        if self.netns is None:
            return httpx.get(f"{self.base_url}/v1/cluster", timeout=10).json()
        # From inside the namespace, through `shoal status --json`.
        status = [sys.executable, "-m", "node.cli", "status", "--api", self.base_url, "--json"]
        done = subprocess.run(
            ["ip", "netns", "exec", self.netns, *status],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    @property
    def node_id(self) -> str:
        return self.p2p_addr.rsplit("/", 1)[-1]

    def runner_pid(self) -> int:
        return int(self.health()["runners"][0]["pid"])

    def stop(self, timeout: float = 10) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


DEFAULT = "default"
"""Pass as `model` to start a node without `--model`, i.e. with the built-in default."""


def spawn_node(cmd: list[str], *, env: dict[str, str] | None = None, netns: str | None = None) -> RunningNode:
    """Start `cmd` (a `shoal run` command line) with its output collected into the node's log."""
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    node = RunningNode(process=process, base_url="", model_id=None, netns=netns)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            node.log.append(line)
            node._lines.put(line)
        node._lines.put(None)
        node._output_closed.set()

    threading.Thread(target=pump, daemon=True).start()
    return node


def start_node(
    *args: str,
    data_dir: Path,
    model: str | None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 120,
    netns: str | None = None,
    prefix: Sequence[str] = (),
    module: str = "node.cli",
    await_model: bool = True,
) -> RunningNode:
    """`shoal run` with a free API port; returns once the API listens and the model is ready here
    (not awaited with `await_model=False`: when the model may be placed on other nodes).

    `model` is a model reference, `DEFAULT` (no `--model` flag) or None (`--no-model`). By default
    the node stays on loopback with mDNS off; with `netns` it runs inside that network namespace
    (which the test created) with mDNS on, and `args` say which addresses to use there. `prefix`
    runs the node under another command (e.g. `unshare -m ...`, a mount namespace); `module` is
    the CLI module (a test's wrapper of `node.cli`).
    """
    cmd = [*prefix, sys.executable, "-m", module, "run", "--api-port", "0", "--data-dir", str(data_dir)]
    if netns is None:
        # Loopback only, and no multicast on the machine's real interfaces (mDNS is tested in namespaces).
        cmd += ["--api-host", "127.0.0.1", "--p2p-host", "127.0.0.1", "--no-mdns"]
    else:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    if model is None:
        cmd.append("--no-model")
    elif model != DEFAULT:
        cmd += ["--model", model]
    cmd += list(args)
    node = spawn_node(cmd, env=env, netns=netns)
    try:
        node.base_url = str(node.wait_for_log(_LISTENING, ready_timeout).group(1))
        node.p2p_addr = str(node.wait_for_log(_P2P, ready_timeout).group(1))
        if model is not None and await_model:
            node.model_id = node.wait_for_log(_READY, ready_timeout).group(1)
    except BaseException:
        node.stop()
        raise
    return node


def hidden_from(folder: Path) -> list[str]:
    """A `start_node` prefix: the node runs in a mount namespace of its own in which `folder` is an
    empty tmpfs, as if it were another machine that lacks what `folder` holds (needs root)."""
    return ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(folder)]


def can_hide_folders() -> bool:
    """Whether this process may make mount namespaces for `hidden_from` (root, or CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0


def statuses(node: RunningNode) -> dict[str, str]:
    return {m["id"]: m["status"] for m in node.cluster()["members"]}


def agreed_leader(nodes: list[RunningNode]) -> str | None:
    """The leader every node names, once all see all the others alive; None before that."""
    ids = {n.node_id for n in nodes}
    views = [n.cluster() for n in nodes]
    for view in views:
        alive = {m["id"] for m in view["members"] if m["status"] == "alive"}
        if alive != ids:
            return None
    leaders = {(v["leader"], v["term"]) for v in views}
    return views[0]["leader"] if len(leaders) == 1 and views[0]["leader"] else None
