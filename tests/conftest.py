"""Shared fixtures: the built-in model, small random-weight models and running nodes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from node.models import default_data_dir, ensure_builtin_model
from tests.model_factory import make_random_model
from tests.nodes import RunningNode, start_node


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
