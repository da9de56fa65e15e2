"""The `shoal` command: `shoal run` starts a node, `shoal models` shows what each node holds."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import trio
from rich.console import Console
from rich.logging import RichHandler

from node.config import API_KEY_ENV, add_run_flags, node_config
from node.models import ModelResolveError, default_data_dir, ensure_builtin_model
from node.net.config import add_mesh_arguments, mesh_config_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve one language model from many machines.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a node: load the model and serve the OpenAI-compatible API")
    add_run_flags(run)
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_mesh_arguments(run)

    models = sub.add_parser("models", help="show the model files each node holds (--local: this data dir)")
    models.add_argument("--api", default=None, help="a node's API URL (default http://127.0.0.1:52415)")
    models.add_argument("--api-key", default=None, help="the node's API key (default $SHOAL_API_KEY)")
    models.add_argument("--json", action="store_true", help="print the raw JSON, for scripts")
    models.add_argument("--local", action="store_true", help="list this machine's data dir; no node needed")
    models.add_argument("--data-dir", type=Path, default=None, help="the data dir to list (implies --local)")

    status = sub.add_parser("status", help="show the cluster as one node sees it")
    status.add_argument("--api", default=None, help="a node's API URL (default http://127.0.0.1:52415)")
    status.add_argument("--api-key", default=None, help="the node's API key (default $SHOAL_API_KEY)")
    status.add_argument("--json", action="store_true", help="print the raw JSON, for scripts")
    status.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")

    prepare = sub.add_parser(
        "prepare", help="get (download if needed) and import the built-in model, and the harmony vocab"
    )
    prepare.add_argument("--data-dir", type=Path, default=None)
    return parser


def _setup_logging(verbose: bool) -> None:
    """Rich on a terminal; plain unwrapped lines otherwise, so logs stay greppable."""
    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per model-file request otherwise


def _run(args: argparse.Namespace) -> int:
    """Exit 2 when the model can never be served here: found before the start where that is cheap
    (`node.models.preflight`), else when the node's own request for it fails (an import that fails)."""
    from node.models.preflight import preflight
    from node.serve import run_node  # keeps `shoal models` fast: no MLX/HTTP imports

    _setup_logging(args.verbose)
    data_dir = args.data_dir or default_data_dir()
    try:
        config = node_config(args, data_dir=data_dir, mesh=mesh_config_from_args(args, data_dir))
        if config.model is not None:
            preflight(config.model, data_dir)  # a typo or a refused .gguf fails now, not after the start
    except (ValueError, OSError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(run_node, config)
    except BaseExceptionGroup as group:  # errors from inside the node's nursery
        if (unservable := group.subgroup(ModelResolveError)) is not None:
            print(f"shoal: {_first_leaf(unservable)}", file=sys.stderr)
            return 2
        if (os_errors := group.subgroup(OSError)) is None:
            raise
        print(
            f"shoal: cannot listen (API {config.api_host}:{config.api_port}, p2p port "
            f"{config.mesh.p2p_port}): {_first_leaf(os_errors)}",
            file=sys.stderr,
        )
        return 1
    except ModelResolveError as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    return 0


def _first_leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def _status(args: argparse.Namespace) -> int:
    from node.cli.status import DEFAULT_API, StatusError, show_status

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        show_status(args.api or DEFAULT_API, api_key=api_key, as_json=args.json, watch=args.watch)
    except StatusError as exc:
        print(f"shoal status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from node.models.builtin_fetch import fetch_builtin_gguf
    from node.models.harmony_vocab import prepare_harmony_vocab

    _setup_logging(verbose=False)  # the download's progress
    data_dir = args.data_dir or default_data_dir()
    try:
        print(f"built-in model file: {fetch_builtin_gguf(data_dir)}", flush=True)
        print(f"built-in model:      {ensure_builtin_model(data_dir)}", flush=True)
    except ModelResolveError as exc:
        print(f"shoal prepare: {exc}", file=sys.stderr)
        return 1
    print(f"harmony vocab:       {prepare_harmony_vocab(data_dir)}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from node.cli.models import show_cluster_models, show_local_models
    from node.cli.status import DEFAULT_API, StatusError

    if args.local or args.data_dir is not None:
        show_local_models(args.data_dir or default_data_dir(), as_json=args.json)
        return 0
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        show_cluster_models(args.api or DEFAULT_API, api_key=api_key, as_json=args.json)
    except StatusError as exc:
        print(f"shoal models: {exc} (`shoal models --local` lists this data dir)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"run": _run, "models": _models, "status": _status, "prepare": _prepare}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
