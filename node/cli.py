"""The `shoal` command: `shoal run` starts a node, `shoal models` lists what the data dir holds."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import trio
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from node.config import DEFAULT_MODEL, NodeConfig
from node.models import ModelResolveError, default_data_dir, ensure_builtin_model, list_local_models
from node.net.config import add_mesh_arguments, mesh_config_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="Serve one language model from many machines.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a node: load the model and serve the OpenAI-compatible API")
    run.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"built-in name, folder, .gguf or HF repo id (default {DEFAULT_MODEL})",
    )
    run.add_argument("--no-model", action="store_true", help="serve no model")
    run.add_argument(
        "--api-host", default=NodeConfig.api_host, help="address the HTTP API binds (default %(default)s)"
    )
    run.add_argument(
        "--api-port",
        type=int,
        default=NodeConfig.api_port,
        help="HTTP API port, 0 = any free port (default %(default)s)",
    )
    run.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where models and state live (default $SHOAL_DATA_DIR or ~/.local/share/shoal)",
    )
    run.add_argument(
        "--prefill-step-size",
        type=int,
        default=NodeConfig.prefill_step_size,
        help="prompt tokens per prefill chunk (default %(default)s)",
    )
    run.add_argument(
        "--max-concurrent",
        type=int,
        default=NodeConfig.max_concurrent,
        help="requests to one model decoded together (default %(default)s)",
    )
    run.add_argument(
        "--max-queued",
        type=int,
        default=NodeConfig.max_queued,
        help="requests that may wait beyond --max-concurrent; more get HTTP 429 (default %(default)s)",
    )
    run.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=NodeConfig.prefix_cache_tokens,
        help="KV cache kept for later requests sharing a prefix, in tokens; 0 = off (default %(default)s)",
    )
    run.add_argument(
        "--sse-keepalive",
        type=float,
        default=NodeConfig.keepalive_s,
        help="seconds without events after which a stream gets a keep-alive comment (default %(default)s)",
    )
    run.add_argument(
        "--no-fast-path", action="store_true", help="run models on plain MLX, not the BLAS fast path"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_mesh_arguments(run)

    models = sub.add_parser("models", help="list the models in the data dir")
    models.add_argument("--data-dir", type=Path, default=None)

    status = sub.add_parser("status", help="show the cluster as one node sees it")
    status.add_argument("--api", default=None, help="a node's API URL (default http://127.0.0.1:52415)")
    status.add_argument("--json", action="store_true", help="print the raw JSON, for scripts")
    status.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")

    prepare = sub.add_parser("prepare", help="import the built-in model and the harmony vocab ahead of time")
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


def _run(args: argparse.Namespace) -> int:
    from node.serve import run_node  # keeps `shoal models` fast: no MLX/HTTP imports

    _setup_logging(args.verbose)
    if args.api_port < 0 or args.api_port > 65535:
        print(f"shoal: --api-port must be between 0 and 65535, got {args.api_port}", file=sys.stderr)
        return 2
    if not args.sse_keepalive > 0:
        print(
            f"shoal: --sse-keepalive must be a positive number of seconds, got {args.sse_keepalive}",
            file=sys.stderr,
        )
        return 2
    data_dir = args.data_dir or default_data_dir()
    try:
        mesh = mesh_config_from_args(args, data_dir)
    except (ValueError, OSError) as exc:
        print(f"shoal: {exc}", file=sys.stderr)
        return 2
    config = NodeConfig(
        data_dir=data_dir,
        mesh=mesh,
        model=None if args.no_model else args.model,
        api_host=args.api_host,
        api_port=args.api_port,
        prefill_step_size=args.prefill_step_size,
        max_concurrent=args.max_concurrent,
        max_queued=args.max_queued,
        prefix_cache_tokens=args.prefix_cache_tokens,
        keepalive_s=args.sse_keepalive,
        fast_path=not args.no_fast_path,
    )
    try:
        trio.run(run_node, config)
    except BaseExceptionGroup as group:  # errors from inside the node's nursery
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
    from node.status import DEFAULT_API, StatusError, show_status

    try:
        show_status(args.api or DEFAULT_API, as_json=args.json, watch=args.watch)
    except StatusError as exc:
        print(f"shoal status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from node.models.harmony_vocab import prepare_harmony_vocab

    data_dir = args.data_dir or default_data_dir()
    print(f"built-in model: {ensure_builtin_model(data_dir)}")
    print(f"harmony vocab:  {prepare_harmony_vocab(data_dir)}")
    return 0


def _models(args: argparse.Namespace) -> int:
    data_dir = args.data_dir or default_data_dir()
    models = list_local_models(data_dir)
    if not models:
        print(f"no models in {data_dir / 'models'} (run `shoal run` to prepare the built-in one)")
        return 0
    table = Table(title=f"models in {data_dir}")
    for column in ("name", "type", "size", "path"):
        table.add_column(column)
    for model in models:
        table.add_row(model.name, model.model_type, f"{model.size_bytes / 1e6:.0f} MB", str(model.path))
    Console().print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"run": _run, "models": _models, "status": _status, "prepare": _prepare}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
