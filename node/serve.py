"""`shoal run`: resolve the model, start its runner, join the mesh, serve the HTTP API; one trio loop."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import logging
import signal
import time
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from api.app import create_app
from node.cluster.links import LinkProbe
from node.cluster.profile import detect_accelerator, read_profile
from node.cluster.service import MEMORY_ROUNDING, ClusterConfig, ClusterService
from node.config import NodeConfig
from node.control.instances import InstanceManager, InstanceOptions
from node.files import Fetcher, FileServer, HashCache, sidecar_path
from node.files.cluster import ClusterFiles, live_members
from node.models.harmony_vocab import HarmonyVocabError, prepare_harmony_vocab, vocab_folder
from node.native import load_kernels, tensor_links_seal
from node.net.auth import derive_key
from node.net.mesh import Mesh
from node.pipeline.link_auth import stage_links
from node.serving.backend import NodeBackend
from node.serving.failover import FailoverConfig
from node.serving.routing import RemoteGenerations, serve_generations
from protocol.cluster_records import NodeProfile
from protocol.ids import ModelId
from protocol.record_limits import MAX_MULTIADDRS, MAX_TEXT_CHARS
from protocol.runner_wire import RunnerSpec

log = logging.getLogger("shoal")


def _prepare_vocab(data_dir: Path) -> Path:
    """Best effort: only GPT-OSS models need the vocab, and their runner reports a missing one."""
    try:
        prepare_harmony_vocab(data_dir)
    except HarmonyVocabError as exc:
        log.warning("harmony vocab unavailable (only GPT-OSS models need it): %s", exc)
    return vocab_folder(data_dir)


def _hypercorn_config(config: NodeConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.api_host}]" if ":" in config.api_host else config.api_host
    hc.bind = [f"{host}:{config.api_port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("shoal.http")
    hc.graceful_timeout = 1.0
    return hc


def _is_loopback(host: str) -> bool:
    """Whether only this machine can reach an API bound to `host` (an address or a name)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _public_api_url(bind: str, p2p_addrs: list[str]) -> str:
    """The API URL other machines can use: a wildcard bind is replaced by an advertised p2p address."""
    scheme, _, hostport = bind.partition("://")
    host, _, port = hostport.rpartition(":")
    if host in ("0.0.0.0", "[::]") and p2p_addrs:
        host = p2p_addrs[0].split("/")[2]
    return f"{scheme}://{host}:{port}"


def _cluster_files(config: NodeConfig, mesh: Mesh, cluster: ClusterService) -> ClusterFiles:
    """Model files between this node and its peers: served to members who sign with the cluster
    key (the key that admits them to the mesh), fetched from those that advertise them."""
    key = derive_key(config.mesh.cluster, config.mesh.secret)
    cache = HashCache(sidecar_path(config.data_dir))
    server = FileServer(key, members=lambda: live_members(cluster))
    fetcher = Fetcher(key, mesh.peer_id, cache)
    return ClusterFiles(cluster, server, fetcher, cache, config.data_dir, cap_bytes=config.max_model_bytes)


async def run_node(config: NodeConfig) -> None:
    """Run until SIGINT/SIGTERM; then stop the API, the mesh and the runners within a second or two."""
    vocab_dir = await trio.to_thread.run_sync(_prepare_vocab, config.data_dir)
    mesh = Mesh(config.mesh)
    log.info("node id %s (cluster %r)", mesh.peer_id, config.mesh.cluster)
    api_url = ""
    started_at = time.time()
    accelerator = detect_accelerator()
    version = importlib.metadata.version("shoal")

    def profile() -> NodeProfile:
        machine = read_profile(accelerator)
        return NodeProfile(
            hostname=machine.hostname[:MAX_TEXT_CHARS],
            os=machine.os[:MAX_TEXT_CHARS],
            accelerator=machine.accelerator,
            memory_total=machine.memory_total,
            memory_available=machine.memory_available // MEMORY_ROUNDING * MEMORY_ROUNDING,
            api_url=api_url,
            version=version,
            started_at=started_at,
            multiaddrs=tuple(mesh.addrs()[:MAX_MULTIADDRS]),
            links=links.links(),
        )

    def runner_spec(model_id: ModelId, model_path: Path) -> RunnerSpec:
        return RunnerSpec.of(config.runner, model_id, model_path, vocab_dir=vocab_dir)

    cluster = ClusterService(
        mesh, profile, ClusterConfig(cluster=config.mesh.cluster), files=lambda: files.records()
    )
    files = _cluster_files(config, mesh, cluster)
    links = LinkProbe(cluster.peer_urls)
    options = InstanceOptions(
        data_dir=config.data_dir,
        runtime_dtype_bytes=4 if accelerator == "cpu" else None,
        kernels=accelerator == "cpu" and config.runner.fast_path and load_kernels().module is not None,
        runner_spec=runner_spec,
        stage_links=stage_links(derive_key(config.mesh.cluster, config.mesh.secret), config.mesh.secret),
        unsealed_tensor=bool(config.mesh.secret) and not tensor_links_seal(),
    )
    instances = InstanceManager(cluster, mesh, options, files)
    backend = NodeBackend(
        cluster,
        instances,
        RemoteGenerations(mesh),
        load_wait_s=config.load_wait_s,
        failover=FailoverConfig(timeout_s=config.failover_timeout_s),
    )
    backend.serving = serve_generations(mesh, backend.attempts.open_local, backend.attempts.cancel_local)
    app = create_app(backend, keepalive_s=config.keepalive_s, api_key=config.api_key, files=files.server)
    if config.api_key is None and not _is_loopback(config.api_host):
        log.warning(
            "the HTTP API on %s has no API key: anyone who can reach it may use and change the "
            "cluster (set --api-key, --api-key-file or $SHOAL_API_KEY)",
            config.api_host,
        )

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, _hypercorn_config(config))
        for bind in binds:
            log.info("API listening on %s", bind)
        addrs = await nursery.start(mesh.run)
        for addr in addrs:
            log.info("p2p listening on %s", addr)
        api_url = _public_api_url(binds[0], addrs)
        await nursery.start(cluster.run)
        nursery.start_soon(links.run)
        await nursery.start(instances.run)
        nursery.start_soon(backend.keep_cards)
        if config.model is not None:
            nursery.start_soon(instances.ensure_instance, config.model, config.replicas, config.sharding)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s; shutting down", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
