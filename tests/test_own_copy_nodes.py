"""A node's own files are a source like a peer, on real nodes: the sole holder of a model is killed
(kill -9) mid-stream and the instance is re-placed on a node that never had it.

1. The built-in model: the new host imports it from its own install (the GGUF the manifest was
   derived from) instead of waiting for a peer, and the client's stream goes on with the text of
   an uninterrupted greedy run.
2. A folder only the dead node could see: no copy exists anywhere, so the instance shows `failed`
   with the reason, and the stream ends with that error at once, not after `--failover-timeout`.

(Failover with files that survive on a peer: tests/test_failover_nodes.py; files fetched from
peers: tests/test_cluster_files_nodes.py.)
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.models import BUILTIN_MODEL_NAME
from node.net.identity import load_or_create_identity, peer_id_of
from protocol.events import MODEL_FILES_UNAVAILABLE
from tests.model_factory import make_random_model
from tests.nodes import RunningNode, agreed_leader, can_hide_folders, hidden_from, start_node
from tests.test_failover_nodes import Streamed, assert_seamless, stream
from tests.test_instances import _instances
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

STORY = {
    "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and his cat."}],
    "max_tokens": 300,
    "temperature": 0,
}
"""SmolLM2 writes all 300 tokens (~3 s here): the kill after 3 chunks lands mid-answer."""
OFFLINE = {"HF_HUB_OFFLINE": "1"}
"""No hub: a node's sources are its peers and its own files."""


def _dirs(tmp_path: Path) -> list[Path]:
    """Three data dirs by peer id: the first one's node leads (the smallest id), the last one's
    node will be killed (never the leader, so the re-placement needs no election)."""
    dirs = [tmp_path / name for name in ("x", "y", "z")]
    return sorted(dirs, key=lambda d: peer_id_of(load_or_create_identity(d)))


def _cluster(tmp_path: Path, *flags: str, hide: Path | None = None) -> Iterator[list[RunningNode]]:
    """[A, B, C], model-less, all alive with B leading; A sees everything, B and C do not see
    `hide` (a folder of A's), when given; B (the client's entry) has `flags`."""
    leader, other, doomed = _dirs(tmp_path)
    prefix = hidden_from(hide) if hide is not None else []
    a = start_node(data_dir=doomed, model=None, env=OFFLINE)
    nodes = [a]
    try:
        peer = ("--peer", a.p2p_addr)
        nodes.append(start_node(*peer, *flags, data_dir=leader, model=None, env=OFFLINE, prefix=prefix))
        nodes.append(start_node(*peer, data_dir=other, model=None, env=OFFLINE, prefix=prefix))
        wait_until(lambda: agreed_leader(nodes) == nodes[1].node_id, 30, "three nodes alive, B leading")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[list[RunningNode]]:
    yield from _cluster(tmp_path)


def _place_on(a: RunningNode, model: str) -> dict[str, Any]:
    """`model` placed by A with nodes=1: A resolves it, holds its files, and runs it."""
    created = httpx.post(f"{a.base_url}/v1/instances", json={"model": model, "nodes": 1}, timeout=120)
    assert created.status_code == 201, created.text
    instance: dict[str, Any] = created.json()
    assert [s["node_id"] for s in instance["stages"]] == [a.node_id] and instance["manifest_id"]
    a.wait_for_log(rf"model {instance['model']} ready", timeout=60)
    return instance


def _kill_mid_stream(
    a: RunningNode, b: RunningNode, model: str, body: dict[str, Any]
) -> tuple[Streamed, float]:
    """A stream through B, A killed (SIGKILL) after its third chunk; the stream, and the seconds
    from the kill to the stream's end."""
    killed: list[float] = []

    def kill() -> None:
        a.process.send_signal(signal.SIGKILL)
        killed.append(time.monotonic())

    out = stream(b, model, body, kill)
    return out, time.monotonic() - killed[0]


def test_the_builtin_model_fails_over_to_a_node_that_imports_its_own_copy(plain: list[RunningNode]) -> None:
    a, b, c = plain
    instance = _place_on(a, BUILTIN_MODEL_NAME)
    whole = stream(b, BUILTIN_MODEL_NAME, STORY)
    assert not whole.errors and whole.finish == "length", whole.errors

    broken, seconds = _kill_mid_stream(a, b, BUILTIN_MODEL_NAME, STORY)
    assert_seamless(broken, whole)
    print(f"\nkill -9 of the sole holder -> the stream complete: {seconds:.1f} s")
    [host] = [s["node_id"] for s in _instances(b)[0]["stages"]]
    new = next(n for n in (b, c) if n.node_id == host)
    # It imported the model from its own install: no peer held it, none was asked.
    new.wait_for_log(
        rf"{BUILTIN_MODEL_NAME} \({instance['manifest_id'][:12]}\) runs from this node's own copy", 5
    )
    assert not any("no peer holds" in line for line in new.log)


@pytest.fixture
def hiding(tmp_path: Path, builtin_model_dir: Path) -> Iterator[tuple[list[RunningNode], Path]]:
    """The cluster, with a random model in a folder only A sees, and B waiting 10 minutes for an
    instance to take a broken-off request over."""
    hidden = tmp_path / "only-a"
    model = make_random_model(hidden / "tiny-only-a", tokenizer_from=builtin_model_dir)
    cluster = _cluster(tmp_path / "nodes", "--failover-timeout", "600", hide=hidden)
    yield from ((nodes, model) for nodes in cluster)


def _unobtainable(reason: str) -> bool:
    """The new host found no live holder, or its fetch from A (dead, not yet known to be) failed:
    either way no live node holds the files, so the error is final (timing decides which)."""
    return "no peer holds" in reason or "tries failed" in reason


@pytest.mark.skipif(not can_hide_folders(), reason="needs mount namespaces (unshare -m, as root)")
def test_a_model_no_node_can_get_fails_at_once(hiding: tuple[list[RunningNode], Path]) -> None:
    """With A dead, no node holds A's model, it has no hub repo, and B and C have no copy of their
    own: the stream ends with that reason within seconds, and the instance shows it."""
    (a, b, _c), model = hiding
    instance = _place_on(a, str(model))
    long = {**STORY, "max_tokens": 600}  # the random model writes ~100 tok/s
    cut, seconds = _kill_mid_stream(a, b, instance["model"], long)
    assert cut.done and [e["code"] for e in cut.errors] == [MODEL_FILES_UNAVAILABLE], cut.errors
    assert _unobtainable(cut.errors[0]["message"]), cut.errors
    assert seconds < 30, f"the error came {seconds:.1f} s after the kill"
    print(f"\nkill -9 of the sole holder -> the stream's error: {seconds:.1f} s")

    def failed() -> dict[str, Any]:
        view: dict[str, Any] = next(i for i in b.cluster()["instances"] if i["id"] == instance["id"])
        return view if view["state"] == "failed" else {}

    shown = wait_until(failed, 10, "the instance shown failed")
    assert _unobtainable(shown["error"]) and shown["stages"][0]["node_id"] != a.node_id
