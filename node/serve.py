"""`shoal run`: resolve the model, start its runner, serve the HTTP API; all on one trio loop."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from api.app import create_app
from node.backend import NodeBackend
from node.config import NodeConfig
from node.models import resolve_model
from node.models.harmony_vocab import HarmonyVocabError, prepare_harmony_vocab, vocab_folder
from node.runner.supervisor import RunnerSpec, RunnerSupervisor
from protocol.ids import ModelId

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


async def run_node(config: NodeConfig) -> None:
    """Run until SIGINT/SIGTERM; then stop the API and the runners within a second or two."""
    runners: list[RunnerSupervisor] = []
    if config.model is not None:
        resolved = await trio.to_thread.run_sync(resolve_model, config.model, config.data_dir)
        vocab_dir = await trio.to_thread.run_sync(_prepare_vocab, config.data_dir)
        spec = RunnerSpec(
            model_id=ModelId(resolved.name),
            model_path=resolved.path,
            vocab_dir=vocab_dir,
            prefill_step_size=config.prefill_step_size,
        )
        runners.append(RunnerSupervisor(spec))
        log.info("serving model %s from %s", resolved.name, resolved.path)
    backend = NodeBackend(runners)
    app = create_app(backend, keepalive_s=config.keepalive_s)

    async with trio.open_nursery() as nursery:
        for runner in runners:
            await nursery.start(runner.run)
        binds = await nursery.start(serve, app, _hypercorn_config(config))
        for bind in binds:
            log.info("API listening on %s", bind)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s; shutting down", signal.Signals(signum).name)
                break
        nursery.cancel_scope.cancel()
