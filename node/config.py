"""Every setting of a node in one place: each default with its reason, and the `shoal run` flag
that sets it (`RUN_FLAGS`: the flag's default is the setting's, never written twice).

The runners' settings are `protocol.runner_wire.RunnerSettings`, because a runner receives them in
its first frame; the mesh's are `node.net.config.MeshConfig`, which adds its own flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.net.config import MeshConfig, derive_secret
from protocol.placement import MAX_REPLICAS
from protocol.runner_wire import RunnerSettings
from protocol.sharding import SHARDING_CHOICES, ShardingChoice

API_KEY_ENV = "SHOAL_API_KEY"
DEFAULT_MODEL = "smollm2-135m"
"""The built-in model: small enough for any laptop, real enough to answer questions."""


@dataclass(frozen=True)
class NodeConfig:
    data_dir: Path
    """Models, the harmony vocab and the node identity live here."""
    mesh: MeshConfig
    """How this node finds, admits and talks to its peers (cluster name, secret, ports, mDNS)."""
    model: str | None = DEFAULT_MODEL
    """A model reference (built-in name, folder, .gguf file or Hugging Face repo id); None serves nothing."""
    replicas: int = 1
    """Instances of `model` the cluster should run, each on nodes of its own (requests go to the least
    loaded): 1, since a small cluster usually has room for one; more once nodes sit idle."""
    sharding: ShardingChoice = "pipeline"
    """How an instance of `model` spreads over nodes: "pipeline" (by layers: room for a larger
    model), "tensor" (a slice of every layer on each node: faster decode, `node.tensor`) or "auto"
    (the leader picks by the measured round trip and the model: `protocol.auto_sharding`)."""
    api_host: str = "0.0.0.0"
    """All interfaces: any machine of the cluster's network may send requests to any node."""
    api_port: int = 52415
    """0 picks a free port (the log says which)."""
    keepalive_s: float = 10.0
    """An SSE comment goes out after this long without events, so proxies keep the stream open."""
    load_wait_s: float = 300.0
    """How long a request waits for its model's instance, placed but not started on its entry node yet
    (files still moving there, later stages loading their layers), before a 503 `model_loading`:
    5 minutes, as long as Ollama lets a load take (OLLAMA_LOAD_TIMEOUT), enough for a few GB over
    Wi-Fi, and within the 10 minutes the OpenAI and Anthropic SDKs wait. A stream gets keep-alives
    meanwhile. A started runner's own load has its own bound (`RunnerSpec.ready_timeout_s`)."""
    failover_timeout_s: float = 60.0
    """How long a generation whose instance broke off (node dead, runner crashed, stage lost) waits
    for another instance to take it over (`node.serving.failover`) before its stream ends with the error. The
    slow case is re-placing a lost node's instance: the leader declares the node dead (a few
    seconds), places the instance elsewhere and that node loads the model (~10 s for a small one).
    60 s covers that for models of a few GB, well within the 10 minutes the OpenAI and Anthropic SDKs
    wait for a stream; a replica takes over at once."""
    api_key: str | None = None
    """None: the API is open to whoever reaches it (zero configuration on a home network; `shoal run`
    warns when it binds beyond loopback). Set: every route but /health and the page needs it."""
    max_model_bytes: int | None = None
    """A cap on the data dir's model store (imports, downloads, files from peers); past it the least
    recently used models not in use are evicted. None: the disk is the limit."""
    runner: RunnerSettings = field(default_factory=RunnerSettings)
    """How every runner of this node runs its model (batch size, queue, prefix cache, fast path)."""


@dataclass(frozen=True)
class Flag:
    """One `shoal run` flag: the setting it sets (`runner.NAME` for a runner's) and its help."""

    name: str
    setting: str
    help: str
    switch: bool = False
    """A flag without a value that sets the setting to `value` (`--no-fast-path`)."""
    value: object = None
    check: tuple[Callable[[Any], bool], str] | None = None
    """A test of the value, and what to tell a user whose value fails it."""
    parse: Callable[[str], object] | None = None
    """How to read the value; default: the type of the setting's default."""

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


_PORT = (lambda port: 0 <= port <= 65535, "must be between 0 and 65535")
_SIZE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """`20G`, `500M`, `1.5T` or plain bytes (decimal units, as disks are sold)."""
    number, unit = text.strip().upper().removesuffix("B"), ""
    if number and number[-1] in _SIZE_UNITS:
        number, unit = number[:-1], number[-1]
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 20G, 500M)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return size


_POSITIVE_SECONDS = (lambda seconds: seconds > 0, "must be a positive number of seconds")

RUN_FLAGS = (
    Flag("--model", "model", "built-in name, folder, .gguf or HF repo id (default %(default)s)"),
    Flag("--no-model", "model", "serve no model", switch=True, value=None),
    Flag(
        "--replicas",
        "replicas",
        "instances of --model to run, each on nodes of its own, as many as fit (default %(default)s)",
        check=(lambda n: 1 <= n <= MAX_REPLICAS, f"must be between 1 and {MAX_REPLICAS}"),
    ),
    Flag(
        "--sharding",
        "sharding",
        "pipeline (layers over nodes), tensor (every layer over nodes) or auto (the faster, by the "
        "measured round trip) for --model (default %(default)s)",
        check=(lambda s: s in SHARDING_CHOICES, f"must be one of {', '.join(SHARDING_CHOICES)}"),
    ),
    Flag("--api-host", "api_host", "address the HTTP API binds (default %(default)s)"),
    Flag("--api-port", "api_port", "HTTP API port, 0 = any free port (default %(default)s)", check=_PORT),
    Flag(
        "--data-dir",
        "data_dir",
        "where models and state live (default $SHOAL_DATA_DIR or ~/.local/share/shoal)",
        parse=Path,
    ),
    Flag(
        "--max-model-bytes",
        "max_model_bytes",
        "cap on the model store, e.g. 50G; least recently used models are evicted (default: none)",
        parse=parse_size,
    ),
    Flag(
        "--prefill-step-size",
        "runner.prefill_step_size",
        "prompt tokens per prefill chunk (default %(default)s)",
    ),
    Flag(
        "--max-concurrent",
        "runner.max_concurrent",
        "requests to one model decoded together (default %(default)s)",
    ),
    Flag(
        "--max-queued",
        "runner.max_queued",
        "requests that may wait beyond --max-concurrent; more get HTTP 429 (default %(default)s)",
    ),
    Flag(
        "--prefix-cache-tokens",
        "runner.prefix_cache_tokens",
        "KV cache kept for later requests sharing a prefix, in tokens; 0 = off (default %(default)s)",
    ),
    Flag(
        "--sse-keepalive",
        "keepalive_s",
        "seconds without events after which a stream gets a keep-alive comment (default %(default)s)",
        check=_POSITIVE_SECONDS,
    ),
    Flag(
        "--failover-timeout",
        "failover_timeout_s",
        "seconds a broken-off generation waits for another instance to take it over (default %(default)s)",
        check=_POSITIVE_SECONDS,
    ),
    Flag(
        "--load-wait",
        "load_wait_s",
        "seconds a request waits for its model's instance to start before a 503 (default %(default)s)",
        check=_POSITIVE_SECONDS,
    ),
    Flag(
        "--no-fast-path",
        "runner.fast_path",
        "run models on plain MLX, not the BLAS fast path",
        switch=True,
        value=False,
    ),
)
"""In the order `shoal run --help` lists them."""


def _default(setting: str) -> Any:
    """The setting's default; None for one without (the data dir: `node.models.default_data_dir`)."""
    owner, _, name = setting.rpartition(".")
    kind: Any = RunnerSettings if owner == "runner" else NodeConfig
    found = next(f for f in dataclasses.fields(kind) if f.name == name)
    return None if found.default is dataclasses.MISSING else found.default


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None, help=f"key the HTTP API requires (default ${API_KEY_ENV})")
    parser.add_argument("--api-key-file", type=Path, default=None, help="read the API key from a file")
    for flag in RUN_FLAGS:
        if flag.switch:
            parser.add_argument(flag.name, action="store_true", help=flag.help)
        else:
            default = _default(flag.setting)
            parse = flag.parse or type(default)
            parser.add_argument(flag.name, type=parse, default=default, help=flag.help)


def node_config(args: argparse.Namespace, *, data_dir: Path, mesh: MeshConfig) -> NodeConfig:
    """The config `RUN_FLAGS` give; ValueError with a message for the user for an unusable value."""
    node: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for flag in RUN_FLAGS:
        value = getattr(args, flag.dest)
        if flag.switch and not value:
            continue
        if flag.check is not None and not flag.check[0](value):
            raise ValueError(f"{flag.name} {flag.check[1]}, got {value}")
        owner, _, name = flag.setting.rpartition(".")
        (runner if owner == "runner" else node)[name] = flag.value if flag.switch else value
    key = derive_secret(args.api_key, args.api_key_file, env=API_KEY_ENV, what="API key")
    node.update(data_dir=data_dir, mesh=mesh, api_key=None if key is None else key.decode())
    return NodeConfig(**node, runner=RunnerSettings(**runner))
