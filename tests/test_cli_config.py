"""Settings defined once: `shoal run`'s flags come from `node.config`, a runner's spec travels as
the first frame of its wire, and the runner (a real `python -m node.runner`) reads it there."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import trio

from node.children.supervisor import ChildFailed, Launch, running
from node.cli.main import _parser, main
from node.config import RUN_FLAGS, NodeConfig, node_config
from node.net.config import MeshConfig
from node.runner.supervisor import RUNNER_COMMAND, child_environment
from protocol.ids import ModelId, RequestId
from protocol.runner_wire import (
    MAX_FRAME_BYTES,
    Cancel,
    LoadFailed,
    MessageDecoder,
    RunnerSettings,
    RunnerSpec,
    Start,
    decode_message,
    encode_frame,
)

AS_USERS_SEE_THEM = {
    "model": "smollm2-135m",
    "no_model": False,
    "replicas": 1,
    "sharding": "pipeline",
    "api_host": "0.0.0.0",
    "api_port": 52415,
    "data_dir": None,
    "max_model_bytes": None,
    "prefill_step_size": 512,
    "max_concurrent": 8,
    "max_queued": 32,
    "prefix_cache_tokens": 8192,
    "sse_keepalive": 10.0,
    "failover_timeout": 60.0,
    "load_wait": 300.0,
    "no_fast_path": False,
}
"""`shoal run`'s flags and defaults as the README documents them."""


def _config(*flags: str) -> NodeConfig:
    args = _parser().parse_args(["run", *flags])
    return node_config(args, data_dir=Path("/data"), mesh=MeshConfig(data_dir=Path("/data")))


def test_the_flags_and_their_defaults_are_the_documented_ones() -> None:
    args = vars(_parser().parse_args(["run"]))
    assert {dest: args[dest] for dest in AS_USERS_SEE_THEM} == AS_USERS_SEE_THEM
    assert [flag.dest for flag in RUN_FLAGS] == list(AS_USERS_SEE_THEM)


def test_no_flags_give_the_configs_own_defaults() -> None:
    config = _config()
    assert config == NodeConfig(data_dir=Path("/data"), mesh=MeshConfig(data_dir=Path("/data")))
    assert config.runner == RunnerSettings()


def test_each_flag_sets_its_setting() -> None:
    config = _config(
        "--no-model",
        "--api-host=127.0.0.1",
        "--api-port=0",
        "--prefill-step-size=64",
        "--max-concurrent=2",
        "--max-queued=3",
        "--prefix-cache-tokens=0",
        "--sse-keepalive=0.5",
        "--failover-timeout=5",
        "--load-wait=2",
        "--no-fast-path",
        "--replicas=3",
    )
    assert (config.model, config.api_host, config.api_port, config.keepalive_s) == (None, "127.0.0.1", 0, 0.5)
    assert config.load_wait_s == 2.0
    assert config.failover_timeout_s == 5.0
    assert config.replicas == 3
    assert config.runner == RunnerSettings(
        prefill_step_size=64, max_concurrent=2, max_queued=3, prefix_cache_tokens=0, fast_path=False
    )
    assert _config("--model", "org/name").model == "org/name"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--api-port", "70000"], "shoal: --api-port must be between 0 and 65535, got 70000"),
        (["--sse-keepalive", "0"], "shoal: --sse-keepalive must be a positive number of seconds, got 0.0"),
        (["--replicas", "0"], "shoal: --replicas must be between 1 and 64, got 0"),
    ],
)
def test_an_unusable_value_is_refused_with_the_flag_named(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--data-dir", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("settings", [RunnerSettings, NodeConfig])
def test_every_setting_says_why_it_has_its_default(settings: type) -> None:
    """memberlist style: the line under each field is its reason."""
    body = ast.parse(inspect.getsource(settings)).body[0]
    assert isinstance(body, ast.ClassDef)
    reasons = {
        statement.target.id
        for statement, following in zip(body.body, body.body[1:], strict=False)
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
    }
    assert reasons == {field.name for field in dataclasses.fields(settings)}


def test_a_spec_made_from_the_settings_crosses_the_wire_unchanged() -> None:
    settings = RunnerSettings(prefill_step_size=64, max_queued=3, fast_path=False)
    spec = RunnerSpec.of(settings, ModelId("m"), Path("/models/m"), vocab_dir=Path("/vocab"))
    assert {f.name: getattr(spec, f.name) for f in dataclasses.fields(RunnerSettings)} == dataclasses.asdict(
        settings
    )
    piped = dataclasses.replace(spec, pipeline=(2, "10.0.0.1", ("10.0.0.2:7000",)))
    (message,) = MessageDecoder().feed(encode_frame(Start(spec=piped)))
    assert message == Start(spec=piped)


def _first_answer(spec_frame: bytes) -> LoadFailed | str:
    """What a real runner answers to `spec_frame`: its first message, or why it had none."""

    async def ask() -> LoadFailed | str:
        spec = RunnerSpec(ModelId("m"), Path("/nonexistent/model"), fast_path=False)
        launch = Launch(RUNNER_COMMAND, child_environment(spec), MAX_FRAME_BYTES, spec_frame=spec_frame)
        async with running(launch) as child:
            try:
                answer = decode_message(bytes(await child.handshake(timeout=120)))
            except ChildFailed as exc:
                return str(exc)
        assert isinstance(answer, LoadFailed)
        return answer

    return trio.run(ask)


def test_a_runner_loads_what_its_first_frame_says() -> None:
    spec = RunnerSpec(ModelId("m"), Path("/nonexistent/model"), fast_path=False)
    answer = _first_answer(encode_frame(Start(spec=spec)))
    assert isinstance(answer, LoadFailed) and "/nonexistent/model" in answer.message


def test_a_runner_whose_first_frame_is_no_spec_exits_without_loading_anything() -> None:
    answer = _first_answer(encode_frame(Cancel(request_id=RequestId("r"))))
    assert answer == "exited with 2 before it was ready"


def test_the_api_key_comes_from_the_flag_else_the_file_else_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("SHOAL_API_KEY", "from-env")
    assert _config("--api-key", "from-flag", "--api-key-file", str(key_file)).api_key == "from-flag"
    assert _config("--api-key-file", str(key_file)).api_key == "from-file"
    assert _config().api_key == "from-env"
    monkeypatch.delenv("SHOAL_API_KEY")
    assert _config().api_key is None
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        _config("--api-key-file", str(key_file))


@pytest.mark.parametrize("ref", ["/no/such/model", "missing.gguf"])
def test_a_model_that_cannot_be_found_stops_the_node_at_once(ref: str, tmp_path: Path) -> None:
    """`shoal run --model /typo` exits 2 with the resolver's message, before it starts anything (a
    plain name may be a peer's: tests/test_unservable_models.py)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "node.cli", "run", "--model", ref, "--data-dir", str(tmp_path)]
    command += ["--api-host", "127.0.0.1", "--api-port", "0", "--p2p-host", "127.0.0.1", "--no-mdns"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert ref in done.stderr and "API listening" not in done.stderr


def test_the_model_store_cap_reads_sizes_as_disks_are_sold() -> None:
    assert _config("--max-model-bytes", "20G").max_model_bytes == 20 * 10**9
    assert _config("--max-model-bytes", "1.5T").max_model_bytes == 1_500 * 10**9
    assert _config("--max-model-bytes", "4096").max_model_bytes == 4096
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(SystemExit):
            _config("--max-model-bytes", bad)
