"""Shared fixtures: the built-in model, small random-weight models and running nodes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.models import default_data_dir, ensure_builtin_model
from tests.gptoss_model import make_scripted_gptoss
from tests.model_factory import make_random_model
from tests.nodes import RunningNode, agreed_leader, start_node
from tests.waiting import wait_until

FAULT_MODULES = frozenset(
    {
        "test_chaos",
        "test_cluster_nodes",
        "test_failover",
        "test_failover_nodes",
        "test_instances",
        "test_loading_wait",
        "test_net_mesh",
        "test_pipeline_instances",
        "test_replicas_nodes",
        "test_routing",
        "test_runner_lifecycle",
    }
)
"""Tests that kill, freeze or restart real node processes and wait on a failure detector. On a
2-core machine shared with the rest of the suite, a node starved of CPU for a few heartbeats is
rightly declared dead, which moves instances for nothing; such a test gets one rerun (pytest
-rerunfailures; `-raR` names every rerun, so a flaky one stays visible). A real defect fails twice.
Not test_cluster_files_nodes: its first test leaves the instance and fetched files in its module's
cluster, so a rerun fails on those ("200 == 201") and hides the first failure's traceback."""

os.environ.setdefault("SHOAL_KERNEL_CALIBRATE", "off")
"""Test processes, and the nodes, runners and stages they start, run the widest kernel set, as
before calibration: processes that measured apart could pick different sets, whose results differ
in the last bits, enough to turn a random model's near-ties where a test compares text across
processes (pipeline stages against one process). tests/test_calibration.py turns it on."""


def pytest_sessionstart(session: pytest.Session) -> None:
    """With SHOAL_NATIVE=required (CI), a missing kernel extension or BLAS shim ends the run
    instead of letting the tests that need them skip."""
    if os.environ.get("SHOAL_NATIVE", "").strip().lower() != "required":
        return
    from node.native import SHIM_PATH, load_kernels

    loaded = load_kernels()
    if loaded.module is None:
        pytest.exit(f"SHOAL_NATIVE=required, but {loaded.reason}", returncode=1)
    if not SHIM_PATH.is_file():
        pytest.exit(f"SHOAL_NATIVE=required, but the BLAS shim {SHIM_PATH} was not built", returncode=1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in FAULT_MODULES:
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=2))


@pytest.fixture(scope="session")
def builtin_model_dir() -> Path:
    """SmolLM2-135M-Instruct imported into the default data dir (`make install` already did it)."""
    return ensure_builtin_model(default_data_dir())


@pytest.fixture(scope="session")
def random_model_dir(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight llama with SmolLM2's real tokenizer and chat template."""
    return make_random_model(
        tmp_path_factory.mktemp("models") / "tiny-llama", tokenizer_from=builtin_model_dir
    )


@pytest.fixture(scope="session")
def random_node(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningNode]:
    """One `shoal run` serving the random model, shared by tests that don't disturb it."""
    node = start_node(data_dir=tmp_path_factory.mktemp("data"), model=str(random_model_dir))
    yield node
    node.stop()


@pytest.fixture(scope="session")
def scripted_gptoss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted gpt_oss model with GPT-OSS's real tokenizer (tests/gptoss_model.py), built once."""
    return make_scripted_gptoss(tmp_path_factory.mktemp("gptoss") / "scripted-gpt-oss")


@pytest.fixture(scope="session")
def scripted_gptoss_node(
    scripted_gptoss_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningNode]:
    """One `shoal run` serving the scripted gpt_oss model, shared by the tests of its surfaces."""
    node = start_node(data_dir=tmp_path_factory.mktemp("data"), model=str(scripted_gptoss_dir))
    yield node
    node.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RunningNode]]:
    """Two model-less nodes in one cluster (one pair per test module)."""
    first = start_node(data_dir=tmp_path_factory.mktemp("a"), model=None)
    nodes = [first]
    try:
        nodes.append(start_node("--peer", first.p2p_addr, data_dir=tmp_path_factory.mktemp("b"), model=None))
        wait_until(lambda: agreed_leader(nodes) == min(n.node_id for n in nodes), 20, "agreed")
        yield nodes
    finally:
        for node in nodes:
            node.stop()
