"""Models that only one node has, served across three: real nodes, files moving between them.

Node A holds the models; B and C run in mount namespaces of their own (`unshare -m`) in which A's
model folder is an empty tmpfs, so whatever they run they must have fetched from A, into their own
data dir (`models/cluster/<manifest id>/`). The cluster has a secret, and A an API key: peers
download without the user's key, strangers cannot download at all. Every node serves files slowly
(5 MB/s, `tests.slow_node`, which also logs each response's bytes), so the transfers are seen in
progress in `/v1/cluster`, not only done, and a node can be killed half way through one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.files import HashCache, folder_manifest
from node.files.signing import sign
from node.models import builtin_gguf_path
from node.net.auth import derive_key
from protocol.manifest import INDEX_FILE, Manifest, stage_paths
from tests.model_factory import make_random_model, sharded_copy, write_llama_gguf
from tests.nodes import RunningNode, can_hide_folders, hidden_from, start_node
from tests.test_instances import _tokens
from tests.waiting import wait_until

CLUSTER, SECRET, API_KEY = "files-e2e", "the cluster secret", "the user's key"
SLOW = "tests.slow_node"
AUTH = {"authorization": f"Bearer {API_KEY}"}


pytestmark = pytest.mark.skipif(not can_hide_folders(), reason="needs mount namespaces (unshare -m, as root)")


@dataclass
class Trio:
    a: RunningNode
    b: RunningNode
    c: RunningNode
    hidden: Path
    """A's model folder; an empty tmpfs for B and C."""
    data: dict[str, Path]
    """node id -> data dir."""
    start_peer: Callable[..., RunningNode]
    """Start (or restart) a node like B and C on this data dir (with `model=X`: `--model X`)."""

    @property
    def nodes(self) -> list[RunningNode]:
        return [self.a, self.b, self.c]


def _view(node: RunningNode) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{node.base_url}/v1/cluster", headers=AUTH, timeout=10).json()
    return body


@pytest.fixture(scope="module")
def trio_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    hidden = tmp_path_factory.mktemp("only-a")
    common = ("--cluster", CLUSTER, "--cluster-secret", SECRET)
    env = {"HF_HUB_OFFLINE": "1"}
    dirs = [tmp_path_factory.mktemp(name) for name in ("a", "b", "c")]
    a = start_node(*common, "--api-key", API_KEY, data_dir=dirs[0], model=None, env=env, module=SLOW)
    started = [a]

    def start_peer(data_dir: Path, model: str | None = None) -> RunningNode:
        peer, hide = ("--peer", a.p2p_addr), hidden_from(hidden)
        node = start_node(
            *common,
            *peer,
            data_dir=data_dir,
            model=model,
            env=env,
            prefix=hide,
            module=SLOW,
            await_model=False,
        )
        started.append(node)
        return node

    try:
        nodes = [a, *(start_peer(d) for d in dirs[1:])]

        def all_alive() -> bool:
            views = [_view(n) for n in nodes]
            return all(sum(m["status"] == "alive" for m in v["members"]) == 3 and v["leader"] for v in views)

        wait_until(all_alive, 30, "three nodes alive, with a leader")
        data = {n.node_id: d for n, d in zip(nodes, dirs, strict=True)}
        yield Trio(nodes[0], nodes[1], nodes[2], hidden, data, start_peer)
    finally:
        for node in started:
            node.stop()


def _place(trio: Trio, model: Path) -> dict[str, Any]:
    created = httpx.post(
        f"{trio.a.base_url}/v1/instances", json={"model": str(model), "nodes": 3}, headers=AUTH, timeout=120
    )
    assert created.status_code == 201, created.text
    instance: dict[str, Any] = created.json()
    assert len({s["node_id"] for s in instance["stages"]}) == 3 and instance["manifest_id"]
    return instance


def _wait_ready(trio: Trio, instance: dict[str, Any], watch: list[dict[str, Any]]) -> None:
    """Until the entry's runner is ready and A's view has every fetching node's transfer done,
    recording every transfer of the model that view shows (gossip may bring a "done" after the
    entry is ready)."""
    entry = next(n for n in trio.nodes if n.node_id == instance["stages"][0]["node_id"])
    fetching = {s["node_id"] for s in instance["stages"]} - {trio.a.node_id}

    def ready() -> bool:
        for member in _view(trio.a)["members"]:
            watch.extend(
                {"node": member["id"], **t}
                for t in member["transfers"]
                if t["manifest_id"] == instance["manifest_id"]
            )
        done = {t["node"] for t in watch if t["state"] == "done"}
        return fetching <= done and any(f"model {instance['model']} ready" in line for line in entry.log)

    wait_until(ready, 120, f"{instance['model']} ready on its entry node", interval=0.1)


def _delete(trio: Trio, instance: dict[str, Any]) -> None:
    deleted = httpx.delete(f"{trio.a.base_url}/v1/instances/{instance['id']}", headers=AUTH, timeout=30)
    assert deleted.status_code == 200, deleted.text


def test_a_folder_on_one_node_serves_over_three_each_fetching_only_its_shards(
    trio_cluster: Trio, builtin_model_dir: Path
) -> None:
    trio = trio_cluster
    original = make_random_model(trio.hidden / "original", num_layers=4, tokenizer_from=builtin_model_dir)
    model = sharded_copy(original, trio.hidden / "tiny4")  # one shard per layer, as big checkpoints come
    manifest = folder_manifest(model, HashCache(None))
    instance = _place(trio, model)
    assert instance["manifest_id"] == manifest.id
    seen: list[dict[str, Any]] = []
    _wait_ready(trio, instance, seen)
    reference = _tokens(trio.b, instance["model"])
    assert reference[2] == 24

    # B and C fetched, into their own data dirs, exactly what their stages need: the metadata and
    # the shards of their layers (by the weight index), no other byte of the model.
    index, config = (json.loads((model / name).read_text()) for name in (INDEX_FILE, "config.json"))
    for stage in instance["stages"]:
        if stage["node_id"] == trio.a.node_id:
            continue
        wanted = stage_paths(manifest, index, config, start=stage["start_layer"], end=stage["end_layer"])
        copy = trio.data[stage["node_id"]] / "models" / "cluster" / manifest.id
        assert {p.name for p in copy.iterdir() if not p.name.startswith(".")} == wanted
        assert all((copy / p).read_bytes() == (model / p).read_bytes() for p in wanted)
        shards = sum(e.size for e in manifest.subset(wanted) if e.path.endswith(".safetensors"))
        done = [t for t in seen if t["node"] == stage["node_id"] and t["state"] == "done"]
        assert done and done[-1]["source"] == "peers" and done[-1]["bytes_total"] == shards
        assert sum(e.size for e in manifest.subset(wanted)) < manifest.total_bytes

    # Progress moved: some node's transfer was seen part-way, its bytes growing, before it was done.
    moving = [t for t in seen if t["state"] == "fetching" and 0 < t["bytes_done"] < t["bytes_total"]]
    assert moving, seen[-3:]
    # The largest transfer: a small one may pass within one gossip round (a single reading).
    largest = max(moving, key=lambda t: t["bytes_total"])
    node, total = largest["node"], largest["bytes_total"]
    steps = [
        t["bytes_done"]
        for t in seen
        if (t["node"], t["bytes_total"], t["state"]) == (node, total, "fetching")
    ]
    assert steps == sorted(steps) and len(set(steps)) >= 2, steps
    assert next(m for m in _view(trio.b)["members"] if m["id"] == node)["models"]  # it serves them on

    _models_show_what_each_node_holds(trio, instance, manifest)
    # Peers download without the user's API key (their requests are signed with the cluster key);
    # a request not signed, or signed with another cluster's key, gets nothing.
    _secret_guards_the_files(trio, manifest)
    _delete(trio, instance)
    _relaunch_by_name(trio, instance, trio.c)


def _relaunch_by_name(trio: Trio, instance: dict[str, Any], via: RunningNode) -> None:
    """The deleted model, placed again by the name the cluster showed for it, from a node that
    cannot see its folder (it asks the holder, A), previewed first; it serves the same files."""
    name, body = instance["model"], {"model": instance["model"], "nodes": 3}
    preview = httpx.get(f"{via.base_url}/v1/instances/preview", params=body, headers=AUTH, timeout=60)
    assert preview.status_code == 200, preview.text
    again = httpx.post(f"{via.base_url}/v1/instances", json=body, headers=AUTH, timeout=120)
    assert again.status_code == 201, again.text
    assert (again.json()["model"], again.json()["manifest_id"]) == (name, instance["manifest_id"])
    _wait_ready(trio, again.json(), [])
    listed = httpx.get(f"{trio.b.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert name in {m["id"] for m in listed}
    assert _tokens(via, name)[2] == 24
    _delete(trio, again.json())


def _shoal_models(node: RunningNode, *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "node.cli", "models", "--api", node.base_url, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def _models_show_what_each_node_holds(trio: Trio, instance: dict[str, Any], manifest: Manifest) -> None:
    """`shoal models`, asked of B: each node with the bytes of the model's files it holds (as on
    its disk), and the instance using them where it runs a stage now."""
    assert _shoal_models(trio.a, "--json").returncode == 1  # A has an API key: refused without it
    table = _shoal_models(trio.b)
    assert table.returncode == 0 and "tiny4" in table.stdout, table.stderr

    def every_node_holds_it() -> dict[str, Any]:
        """B's answer once every node's holding of the model has reached B by gossip."""
        answer: dict[str, Any] = json.loads(_shoal_models(trio.b, "--json").stdout)
        holders = {n["node"] for n in answer["nodes"] for m in n["models"] if m["manifest_id"] == manifest.id}
        return answer if holders == {n.node_id for n in trio.nodes} else {}

    answer = wait_until(every_node_holds_it, 30, "every node's holding known to B", interval=0.5)
    nodes = {n["node"]: n for n in answer["nodes"]}
    assert set(nodes) == {n.node_id for n in trio.nodes} and answer["self"] == trio.b.node_id
    running = {
        s["node_id"] for i in _view(trio.b)["instances"] if i["id"] == instance["id"] for s in i["stages"]
    }
    for node in trio.nodes:
        [held] = [m for m in nodes[node.node_id]["models"] if m["manifest_id"] == manifest.id]
        assert held["model"] == "tiny4" and held["in_use"] == (
            [instance["id"]] if node.node_id in running else []
        )
        assert (held["files_total"], held["bytes_total"]) == (len(manifest.files), manifest.total_bytes)
        if node is trio.a:  # the original: every file
            assert held["bytes_held"] == manifest.total_bytes
            continue
        copy = trio.data[node.node_id] / "models" / "cluster" / manifest.id
        on_disk = [p for p in copy.iterdir() if not p.name.startswith(".")]
        assert held["files_held"] == len(on_disk) < len(manifest.files)
        assert held["bytes_held"] == sum(p.stat().st_size for p in on_disk)


def _secret_guards_the_files(trio: Trio, manifest: Manifest) -> None:
    path = f"/v1/files/{manifest.id}/config.json"
    url = trio.a.base_url + path
    right, wrong = derive_key(CLUSTER, SECRET.encode()), derive_key(CLUSTER, b"another secret")
    as_member = httpx.get(url, headers=sign(right, "GET", path, trio.b.node_id, time.time()), timeout=10)
    assert as_member.status_code == 200
    assert as_member.json() == json.loads((trio.hidden / "tiny4" / "config.json").read_text())
    assert httpx.get(url, timeout=10).status_code == 401
    assert (
        httpx.get(url, headers=sign(wrong, "GET", path, trio.b.node_id, time.time()), timeout=10).status_code
        == 403
    )
    stranger = sign(right, "GET", path, "12D3KooWnotamember", time.time())
    assert httpx.get(url, headers=stranger, timeout=10).status_code == 403


def test_a_gguf_on_one_node_serves_over_three(
    trio_cluster: Trio, builtin_model_dir: Path, tmp_path: Path
) -> None:
    trio = trio_cluster
    original = trio.hidden / "original"  # the first test's weights, as llama.cpp would write them
    if not original.is_dir():
        make_random_model(original, num_layers=4, tokenizer_from=builtin_model_dir)
    gguf = write_llama_gguf(original, trio.hidden / "tiny-gguf.gguf", tokenizer_gguf=builtin_gguf_path())
    instance = _place(trio, gguf)  # A imports it, hashes the import (and the .gguf), serves the folder
    assert instance["model"] == "tiny-gguf"
    seen: list[dict[str, Any]] = []
    _wait_ready(trio, instance, seen)
    text, _prompt, completion_tokens = _tokens(trio.c, "tiny-gguf")
    assert completion_tokens == 24 and text
    for node in (trio.b, trio.c):
        copy = trio.data[node.node_id] / "models" / "cluster" / instance["manifest_id"]
        assert (copy / "config.json").is_file() and (copy / "model.safetensors").is_file()
    _delete(trio, instance)
    _relaunch_by_name(trio, instance, trio.b)
    _run_by_name(trio, instance, tmp_path)


def _run_by_name(trio: Trio, instance: dict[str, Any], tmp_path: Path) -> None:
    """`shoal run --model tiny-gguf` on a fourth node that cannot see the file: it asks the
    cluster, which places the model (on the holders) and the node keeps running."""
    d = trio.start_peer(tmp_path / "d", instance["model"])
    try:

        def placed() -> dict[str, Any]:
            return next((i for i in _view(trio.a)["instances"] if i["model"] == instance["model"]), {})

        try:
            again = wait_until(placed, 60, "the model placed by the fourth node's --model")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the fourth node's log:\n" + "".join(d.log[-40:])) from None
        assert again["manifest_id"] == instance["manifest_id"] and d.process.poll() is None
        _delete(trio, again)
    finally:
        d.stop()

    def gone() -> bool:  # else the next placement may still count on it
        return all(
            m["status"] != "alive" for n in trio.nodes for m in _view(n)["members"] if m["id"] == d.node_id
        )

    wait_until(gone, 60, "the fourth node no longer alive in any view", interval=0.2)


SERVED = re.compile(r"^served (\S+) /v1/files/(\w+)/(\S+) from (\d+) (\d+)$")
WEIGHTS = "model.safetensors"
WRITE_SLACK = 2 * 1024 * 1024
"""Bytes a killed fetcher may have received but not written (its 1 MiB write buffer, and more)."""


def _served(trio: Trio, requester: str, manifest_id: str, path: str) -> list[tuple[int, int]]:
    """(range start, bytes sent) of each response of `path` any node sent `requester`."""
    found = []
    for node in trio.nodes:
        for line in node.log:
            if (m := SERVED.match(line.strip())) and m.groups()[:3] == (requester, manifest_id, path):
                found.append((int(m[4]), int(m[5])))
    return found


def _restart_b(trio: Trio) -> None:
    """Start B again on its data dir (same identity), and wait until the cluster has it back."""
    trio.b = trio.start_peer(trio.data[trio.b.node_id])
    ids = {n.node_id for n in trio.nodes}
    wait_until(
        lambda: all(
            {m["id"] for m in _view(n)["members"] if m["status"] == "alive"} == ids for n in trio.nodes
        ),
        30,
        "B alive again in every view",
    )


def _place_again(trio: Trio, instance: dict[str, Any], model: Path) -> dict[str, Any]:
    """Delete `instance` (re-placed without B while B was down) and place the model on all three,
    retrying while the cluster settles (a leader that B's restart unseated answers 503 meanwhile)."""
    again = _place_afresh(trio, instance, model)
    _wait_ready(trio, again, [])
    return again


def _place_afresh(trio: Trio, instance: dict[str, Any], model: Path) -> dict[str, Any]:
    """`instance` deleted and the model placed on all three again, without waiting for it to run."""

    def deleted() -> bool:
        url = f"{trio.a.base_url}/v1/instances/{instance['id']}"
        return httpx.delete(url, headers=AUTH, timeout=30).status_code in (200, 404)

    wait_until(deleted, 60, "the instance deleted", interval=0.5)
    placed: dict[str, Any] = wait_until(
        lambda: _place(trio, model), 60, "the model placed on all three again", interval=0.5
    )
    return placed


def test_a_node_killed_half_way_resumes_after_its_restart(
    trio_cluster: Trio, builtin_model_dir: Path
) -> None:
    """B is killed (SIGKILL) with part of the weights on disk; restarted, it asks only for the rest."""
    trio = trio_cluster
    model = make_random_model(
        trio.hidden / "resumable", num_layers=3, tokenizer_from=builtin_model_dir, seed=1
    )
    manifest = folder_manifest(model, HashCache(None))
    size = next(e.size for e in manifest.files if e.path == WEIGHTS)
    instance = _place(trio, model)  # no weight index: every stage needs the one weights file
    parts = trio.data[trio.b.node_id] / "models" / "cluster" / f".{manifest.id}.fetch" / ".parts"

    def part_bytes() -> int:
        return sum(p.stat().st_size for p in parts.glob(f"{WEIGHTS}.*.part")) if parts.is_dir() else 0

    wait_until(lambda: 0 < part_bytes() < size // 2, 60, "B part way through the weights", interval=0.02)
    trio.b.process.kill()
    trio.b.process.wait(10)
    kept = part_bytes()
    _restart_b(trio)
    _place_again(trio, instance, model)

    copy = trio.data[trio.b.node_id] / "models" / "cluster" / manifest.id / WEIGHTS
    assert copy.read_bytes() == (model / WEIGHTS).read_bytes()
    served = _served(trio, trio.b.node_id, manifest.id, WEIGHTS)
    assert kept in {start for start, _ in served if start > 0}, (kept, served)  # it resumed from its part
    assert sum(sent for _, sent in served) <= size + WRITE_SLACK, served  # never the whole file twice
