"""Model-file transfer between two processes on loopback: HTTP with `Range` vs a libp2p stream.

    .venv/bin/python bench/transfer.py [--mb 256] [--repeats 3]

One random file of `--mb` MB, served by a separate process each time, received by this one:
- curl <- `python -m http.server`: the issue's reference (C client, Python server);
- curl <- the files route (`api.files` on hypercorn + trio, as a node serves it, signed headers):
  what the server side alone costs;
- Fetcher <- the files route: the product path (`node.files.Fetcher`: signed ranged GET through
  httpx with 1 MiB reads, written in 1 MiB batches from a worker thread, hashed on the way, the
  SHA-256 checked before the file is placed);
- Fetcher <- two serving processes: the file in two pieces, one from each (joined, then hashed);
- libp2p stream: two `Mesh`es (TCP + Noise + Yamux, the cluster's own transport), the file in
  1 MiB length-prefixed frames on one channel (`Mesh.open_channel`), written to disk; no hash check.
Figures are MB/s (1 MB = 10^6 bytes), the median of `--repeats` runs, with the page cache warm
(every server reads the same file) and the files in /dev/shm unless `--dir` says otherwise (disk
writeback would otherwise dominate 256 MB writes on a small VM). The SHA-256 rate of the file is
printed for reference. On a 2-core machine each end gets about one core: the figures measure
CPU per byte, which is what decides between the transports.

    .venv/bin/python bench/transfer.py --first-token [--shards]

instead times a cold start through the product: three `shoal run --no-model` nodes on loopback,
a random-weight llama of ~1 GB (float32, 14 layers) that only node A has (B and C run in mount
namespaces where its folder is empty: needs root), `POST /v1/instances {"nodes": 3}` to A, then
one streamed chat request as soon as the entry's runner is ready; printed: the time from the POST
to the first token, and when the POST answered (A hashed the folder), when B's and C's files were
all verified, when the runner was ready. `--shards` saves the model with one shard per layer, so
that each stage fetches only its own.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import builtin_model, chat_body, loadavg, stream_chat
from node.files import Fetcher, FileServer, HashCache, Peer, folder_manifest
from node.files.hashing import file_sha256
from node.files.signing import sign
from node.net.channel import Channel, ChannelClosed
from protocol.manifest import Manifest
from protocol.model_files import file_url_path
from tests.file_peers import CLUSTER, KEY, SECRET, file_app, serving
from tests.meshes import config as mesh_config
from tests.meshes import running
from tests.model_factory import make_random_model, sharded_copy
from tests.nodes import RunningNode, hidden_from, start_node
from tests.waiting import wait_until, wait_until_async

BLOB = "blob.bin"
MESH_PROTOCOL = "/shoal/bench-file/1"
FRAME_BYTES = 1 << 20
START_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 300.0


# --- serving processes -----------------------------------------------------------------------------


def serve_http(folder: Path) -> None:
    """Child: the files route over `folder`; prints `URL <url> MANIFEST <json>`, serves until killed."""
    manifest = folder_manifest(folder, HashCache(None))
    server = FileServer(KEY)
    server.offer(manifest, folder)

    async def main() -> None:
        async with serving(file_app(server)) as url:
            print("URL", url, "MANIFEST", manifest.model_dump_json(), flush=True)
            await trio.sleep_forever()

    trio.run(main)


def serve_mesh(folder: Path, data_dir: Path) -> None:
    """Child: a Mesh that sends a file in frames to whoever asks; prints `ADDR <multiaddr>`."""

    async def send_file(peer_id: str, channel: Channel) -> None:
        name = (await channel.receive(idle_timeout_s=10)).decode()
        with open(folder / name, "rb") as handle:
            while chunk := handle.read(FRAME_BYTES):
                await channel.send(chunk)

    async def main() -> None:
        cfg = mesh_config(
            data_dir, "server", cluster=CLUSTER, secret=SECRET, max_request_bytes=FRAME_BYTES + 64
        )
        async with running(cfg) as mesh:
            mesh.set_channel_handler(MESH_PROTOCOL, send_file)
            print("ADDR", mesh.addrs()[0], flush=True)
            await trio.sleep_forever()

    trio.run(main)


def spawn(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start this script in a child mode; returns it and the words of its first line."""
    child = subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.kill()
        raise RuntimeError(f"{args[0]} child exited before it was ready")
    return child, line.split(maxsplit=3)


def stop(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait(timeout=10)


# --- measurements --------------------------------------------------------------------------------


def median_mbps(size: int, runs: list[float]) -> str:
    rates = [size / s / 1e6 for s in runs]
    return f"{statistics.median(rates):7.0f}  (runs: {', '.join(f'{r:.0f}' for r in rates)})"


def curl_seconds(url: str, out: Path, headers: dict[str, str] | None = None) -> float:
    cmd = ["curl", "-sf", "-o", str(out), "-w", "%{time_total}", url]
    for key, value in (headers or {}).items():
        cmd += ["-H", f"{key}: {value}"]
    answer = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return float(answer.stdout)


def time_it(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def fetch_seconds(manifest: Manifest, urls: list[str], target: Path) -> float:
    fetcher = Fetcher(KEY, "bench-client", HashCache(None))
    peers = [Peer(f"server-{i}", url) for i, url in enumerate(urls)]
    run = functools.partial(fetcher.fetch, manifest, target, peers, paths={BLOB})
    seconds = time_it(lambda: trio.run(run))
    shutil.rmtree(target)
    return seconds


def mesh_seconds(addr: str, data_dir: Path, out: Path, repeats: int) -> list[float]:
    """Receive the file `repeats` times over one connection (a new channel each time)."""
    peer_id = addr.rsplit("/", 1)[-1]
    runs: list[float] = []

    async def main() -> None:
        cfg = mesh_config(
            data_dir,
            "client",
            cluster=CLUSTER,
            secret=SECRET,
            bootstrap_peers=(addr,),
            max_request_bytes=FRAME_BYTES + 64,
        )
        async with running(cfg) as mesh:
            await wait_until_async(
                lambda: peer_id in mesh.connected_peers(), START_TIMEOUT_S, "mesh connected"
            )
            for _ in range(repeats):
                with trio.fail_after(RUN_TIMEOUT_S):
                    begin = time.perf_counter()
                    channel = await mesh.open_channel(peer_id, MESH_PROTOCOL)
                    await channel.send(BLOB.encode())
                    with open(out, "wb") as handle:
                        while True:
                            try:
                                handle.write(await channel.receive(idle_timeout_s=10))
                            except ChannelClosed:
                                break
                    runs.append(time.perf_counter() - begin)
                    await channel.aclose()

    trio.run(main)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    shm = Path("/dev/shm")
    where = "where the files go (default: /dev/shm, so that disk writeback stays out of the figures)"
    parser.add_argument("--dir", type=Path, default=shm if shm.is_dir() else None, help=where)
    parser.add_argument("--first-token", action="store_true", help="time a 1 GB model's cold start instead")
    parser.add_argument("--shards", action="store_true", help="with --first-token: one shard per layer")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shoal-transfer-", dir=args.dir))
    try:
        if args.first_token:
            first_token(root, shards=args.shards)
        else:
            run_all(root, args.mb * 1_000_000, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def first_token(root: Path, *, shards: bool) -> None:
    """See the module docstring: POST /v1/instances -> first token, a 1 GB model only A has."""
    hidden = root / "only-a"
    model = make_random_model(
        hidden / "random-1gb",
        tokenizer_from=builtin_model(),
        num_layers=14,
        hidden_size=1024,
        intermediate_size=2816,
        num_heads=16,
        num_kv_heads=4,
    )
    if shards:
        model = sharded_copy(model, hidden / "random-1gb-sharded")
    size = sum(f.stat().st_size for f in model.iterdir())
    offline = {"HF_HUB_OFFLINE": "1"}
    nodes = [start_node(data_dir=root / "a", model=None, env=offline)]
    try:
        for name in ("b", "c"):
            peer = ("--peer", nodes[0].p2p_addr)
            nodes.append(
                start_node(*peer, data_dir=root / name, model=None, env=offline, prefix=hidden_from(hidden))
            )
        wait_until(lambda: all(_alive(n) == 3 for n in nodes), 30, "three nodes alive")
        files = len(list(model.iterdir()))
        print(f"model: {size / 1e9:.2f} GB in {files} files, on node A only; load {loadavg()}")
        start = time.perf_counter()
        created = httpx.post(
            f"{nodes[0].base_url}/v1/instances", json={"model": str(model), "nodes": 3}, timeout=RUN_TIMEOUT_S
        )
        answered = time.perf_counter()
        if created.status_code != 201:
            raise RuntimeError(f"placing the model: {created.text}")
        instance = created.json()
        marks = _cold_start(nodes, instance)
        marks = {"POST answered (A hashed the model)": answered, **marks}
        for what, at in marks.items():
            print(f"{what:48} {at - start:7.2f} s")
        layers = ", ".join(f"[{s['start_layer']},{s['end_layer']})" for s in instance["stages"])
        print(f"stages {layers}; load {loadavg()}; what B and C logged of their transfers:")
        for name, node in zip("BC", nodes[1:], strict=True):
            for line in node.log:
                if "shoal.files:" in line and ("fetching" in line or "verified" in line):
                    print(f"  {name}: {line.strip()}")
    finally:
        for node in nodes:
            node.stop()


def _alive(node: RunningNode) -> int:
    return sum(m["status"] == "alive" for m in node.cluster()["members"])


def _cold_start(nodes: list[RunningNode], instance: dict[str, object]) -> dict[str, float]:
    """When the other stage nodes' files were all verified, the runner ready, the first token came."""
    stages = instance["stages"]
    assert isinstance(stages, list)
    entry = next(n for n in nodes if n.node_id == stages[0]["node_id"])
    fetching = {s["node_id"] for s in stages} - {nodes[0].node_id}
    marks: dict[str, float] = {}

    def progressed() -> bool:
        mine = (instance["manifest_id"], "done")
        members = nodes[0].cluster()["members"]
        done = {
            m["id"] for m in members if any((t["manifest_id"], t["state"]) == mine for t in m["transfers"])
        }
        if fetching <= done:
            marks.setdefault("files on B and C, verified", time.perf_counter())
        return any(r["state"] == "ready" for r in entry.health()["runners"])

    wait_until(progressed, RUN_TIMEOUT_S, "the entry's runner ready", interval=0.05)
    marks["runner ready"] = time.perf_counter()
    with httpx.Client(timeout=RUN_TIMEOUT_S) as client:
        body = chat_body(str(instance["model"]), [{"role": "user", "content": "Hello"}], 4)
        stream = stream_chat(client, entry.base_url, body)
    marks["first token (POST -> first token)"] = stream.start + stream.ttft
    return marks


def run_all(root: Path, size: int, repeats: int) -> None:
    folder = root / "model"
    folder.mkdir()
    with open(folder / BLOB, "wb") as handle:
        for left in range(size, 0, -(1 << 24)):
            handle.write(os.urandom(min(left, 1 << 24)))
    out = root / "received.bin"
    sha_s = time_it(functools.partial(file_sha256, folder / BLOB))
    print(f"file: {size / 1e6:.0f} MB random in {root.parent}; load {loadavg()}; cores {os.cpu_count()}")
    print(f"{'path':52} {'MB/s':>7}")
    print(f"{'SHA-256 of the file (reference)':52} {size / sha_s / 1e6:7.0f}")

    port_server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory", str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert port_server.stdout is not None
        port = int(port_server.stdout.readline().split(" port ")[1].split()[0])
        url = f"http://127.0.0.1:{port}/{BLOB}"
        wait_until(
            lambda: subprocess.run(["curl", "-sfI", url], capture_output=True).returncode == 0, 10, "up"
        )
        runs = [curl_seconds(url, out) for _ in range(repeats)]
        print(f"{'curl <- python -m http.server':52} {median_mbps(size, runs)}")
    finally:
        stop(port_server)

    first, words = spawn("--serve-http", str(folder))
    second, second_words = spawn("--serve-http", str(folder))
    try:
        url, manifest = words[1], Manifest.model_validate_json(words[3])
        path = file_url_path(manifest.id, BLOB)
        runs = [
            curl_seconds(url + path, out, sign(KEY, "GET", path, "curl", time.time())) for _ in range(repeats)
        ]
        print(f"{'curl <- files route (hypercorn + trio)':52} {median_mbps(size, runs)}")
        runs = [fetch_seconds(manifest, [url], root / f"one-{i}") for i in range(repeats)]
        print(f"{'Fetcher <- files route, 1 peer (incl. SHA-256)':52} {median_mbps(size, runs)}")
        urls = [url, second_words[1]]
        runs = [fetch_seconds(manifest, urls, root / f"two-{i}") for i in range(repeats)]
        print(f"{'Fetcher <- 2 peers, 2 pieces (incl. SHA-256)':52} {median_mbps(size, runs)}")
    finally:
        stop(first)
        stop(second)

    mesh_server, words = spawn("--serve-mesh", str(folder), str(root / "mesh"))
    try:
        runs = mesh_seconds(words[1], root / "mesh", out, repeats)
        print(f"{'libp2p channel, 1 MiB frames (no hash check)':52} {median_mbps(size, runs)}")
    finally:
        stop(mesh_server)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-http"]:
        serve_http(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["--serve-mesh"]:
        serve_mesh(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
