"""`shoal run --model X` when X can never be served here ends the node with exit 2 and the reason
(before it starts when the GGUF's header says so; after, when only the import finds out); when X
only does not fit the nodes alive yet, the node keeps running, says so, and X is placed once a node
with room joins. Real `shoal run` processes; the GGUFs are tiny ones written with gguf-py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFReader

from tests.nodes import RunningNode, spawn_node, start_node
from tests.test_gguf_import import Q, TinyModel, write_tiny_gguf

EXIT_BOUND_S = 60
"""A refused model stops the node within this (measured: 1.5-2 s on this 2-core machine; a name
only the cluster may hold, on a node alone: after `node.control.requests.LONE_ASK_WAIT_S`)."""
FP16_NAN = bytes.fromhex("007e")


def _run_command(data_dir: Path, model: str) -> list[str]:
    command = [sys.executable, "-m", "node.cli", "run", "--model", model, "--data-dir", str(data_dir)]
    return [*command, "--api-host", "127.0.0.1", "--api-port", "0", "--p2p-host", "127.0.0.1", "--no-mdns"]


def _refused_file(case: str, folder: Path) -> Path:
    path = folder / f"{case.replace(' ', '-')}.gguf"
    if case == "bert":
        write_tiny_gguf(TinyModel("bert"), path)
    elif case == "Q3_K weights":
        write_tiny_gguf(TinyModel("llama", types={"attn_q": Q.Q3_K}), path)
    elif case == "unknown pre-tokenizer":
        write_tiny_gguf(TinyModel("llama", pre="nonsense"), path)
    elif case == "truncated":
        write_tiny_gguf(TinyModel("llama"), path)
        path.write_bytes(path.read_bytes()[:100_000])
    else:
        path.write_bytes(b"not a GGUF file at all\n" * 100)
    return path


REFUSED = {
    "bert": "architecture 'bert' is not supported",
    "Q3_K weights": "tensor 'blk.0.attn_q.weight' has type Q3_K: not supported",
    "unknown pre-tokenizer": "pre-tokenizer 'nonsense' is not supported",
    "truncated": "cannot read",
    "not a GGUF": "GGUF magic invalid",
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_gguf_that_can_never_be_served_stops_the_node_before_it_starts(case: str, tmp_path: Path) -> None:
    gguf = _refused_file(case, tmp_path)
    started = time.monotonic()
    done = subprocess.run(
        _run_command(tmp_path / "data", str(gguf)), capture_output=True, text=True, timeout=EXIT_BOUND_S
    )
    assert done.returncode == 2, done.stderr
    reason = done.stderr.strip().splitlines()[-1]
    assert reason.startswith(f"shoal: cannot serve '{gguf}': ") and REFUSED[case] in reason, done.stderr
    assert "API listening" not in done.stderr
    assert time.monotonic() - started < EXIT_BOUND_S


def test_an_import_that_fails_after_the_start_stops_the_node_cleanly(tmp_path: Path) -> None:
    """A header the check accepts, a block whose scale is NaN: only the import finds it."""
    gguf = tmp_path / "nan-scale.gguf"
    write_tiny_gguf(TinyModel("llama"), gguf)  # every matrix Q8_0: fp16 scale first in each block
    offset = next(t.data_offset for t in GGUFReader(gguf).tensors if t.name == "blk.0.attn_q.weight")
    with open(gguf, "r+b") as handle:
        handle.seek(offset)
        handle.write(FP16_NAN)
    node = spawn_node(_run_command(tmp_path / "data", str(gguf)))
    try:
        node.wait_for_log("API listening", EXIT_BOUND_S)
        assert node.process.wait(EXIT_BOUND_S) == 2
        node.wait_output_closed(10)  # no child process (import, runner) holds the output any more
    finally:
        node.stop()
    assert node.log[-1].startswith(f"shoal: cannot serve '{gguf}': ")
    assert "Q8_0 scales overflow float16 (or are not finite in the file)" in node.log[-1]


def test_a_name_no_node_of_the_cluster_holds_stops_the_node_once_it_asked(tmp_path: Path) -> None:
    """A plain name this node lacks may be a peer's model (`node.control.finder`): the node starts,
    asks the cluster (here only itself) once it has a leader, and stops with exit 2 and both reasons."""
    node = spawn_node(_run_command(tmp_path / "data", "no-such-model"))
    try:
        node.wait_for_log("API listening", EXIT_BOUND_S)
        assert node.process.wait(EXIT_BOUND_S) == 2
    finally:
        node.stop()
    assert node.log[-1].startswith("shoal: cannot serve 'no-such-model': model 'no-such-model' not found")
    assert node.log[-1].rstrip().endswith("nor does any node of the cluster hold 'no-such-model'")


def _with_memory(limit_bytes: int) -> list[str]:
    """A prefix: the node runs in a mount namespace whose cgroup v2 files say it may use
    `limit_bytes` (`node.cpu.memory` reads them), as in a container that small (needs root)."""
    script = (
        'mount -t tmpfs tmpfs /sys/fs/cgroup && echo "$0" > /sys/fs/cgroup/memory.max'
        ' && echo 0 > /sys/fs/cgroup/memory.current && exec "$@"'
    )
    return ["unshare", "-m", "sh", "-c", script, str(limit_bytes)]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_model_too_big_for_the_nodes_alive_waits_for_a_node_with_room(
    random_model_dir: Path, tmp_path: Path
) -> None:
    model = random_model_dir.name
    small = spawn_node([*_with_memory(10**6), *_run_command(tmp_path / "small", str(random_model_dir))])
    nodes: list[RunningNode] = [small]
    try:
        small.wait_for_log(f"{model} does not fit the nodes alive now .*waiting for more nodes", 120)
        small.p2p_addr = str(small.wait_for_log(r"p2p listening on (/ip4/\S+)", 1).group(1))
        assert small.process.poll() is None  # still running, and saying why it serves nothing
        roomy = start_node("--peer", small.p2p_addr, data_dir=tmp_path / "roomy", model=None)
        nodes.append(roomy)
        roomy.wait_for_log(f"model {model} ready", 120)  # asked again when it joined; placed on it
        assert small.process.poll() is None
    finally:
        for node in nodes:
            node.stop()
