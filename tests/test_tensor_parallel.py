"""Tensor-parallel groups: each rank holds a slice of every layer; together they give one
process's text. Ranks other than 0 are real `node.tensor.follower` processes on 127.0.0.1; every
comparison is against one process running the whole model on the same kernels."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio

from node.children.process import spawn, terminate
from node.cpu.dtype import apply_dtype_policy
from node.pipeline.driver import PipelineGenerator
from node.pipeline.hop import HopError
from node.pipeline.link_auth import LinkSecurity
from node.pipeline.shard import ShardError, load_shard
from node.tensor.mesh import native
from node.tensor.shard import TensorGenerator, TensorLinkError, load_tensor_shard
from protocol.sampling import Sampling
from protocol.tensor_split import Shape, SplitError, split
from tests.model_factory import make_random_model, quantized_copy
from tests.tensor_group import follower_command, ready_address, tensor_group

# --- the split (pure) -------------------------------------------------------------------------


def test_ranks_hold_whole_kv_heads_and_whole_groups() -> None:
    pieces = split(Shape(q_heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152), 2)
    assert [p.kv_heads for p in pieces] == [(0, 1), (1, 3)]  # uneven: rank 0 (which samples) less
    assert [p.q_heads for p in pieces] == [(0, 3), (3, 9)]
    assert [p.ffn for p in pieces] == [(0, 768), (768, 1536)]
    assert [p.vocab for p in pieces] == [(0, 24576), (24576, 49152)]
    three = split(Shape(q_heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, group=64), 3)
    assert [p.ffn for p in three] == [(0, 2688), (2688, 5440), (5440, 8192)]
    assert all((b - a) % 64 == 0 for a, b in (p.ffn for p in three))
    assert three[-1].vocab[1] == 128256 and three[0].kv_heads == (0, 2)


@pytest.mark.parametrize(
    ("shape", "size", "reason"),
    [
        (Shape(32, 1, 64, 8192, 1000), 2, "1 KV heads cannot be spread over 2 ranks"),
        (Shape(4, 4, 16, 512, 1000), 2, "do not fill whole quantization groups of 32"),
        (Shape(8, 4, 64, 500, 1000), 2, "not whole groups of 32"),
        (Shape(8, 4, 64, 512, 1000), 1, "at least 2 ranks"),
    ],
)
def test_shapes_that_cannot_be_cut_say_why(shape: Shape, size: int, reason: str) -> None:
    with pytest.raises(SplitError, match=reason):
        split(shape, size)


# --- the link (two real processes) ------------------------------------------------------------

_PEER = """
import sys, time, mlx.core as mx
from node.tensor.mesh import native
k = native()
keys = [bytes.fromhex(sys.argv[3]), b""] if sys.argv[3] else []
link = k.TensorLink([int(sys.argv[1]), -1], 1, 2.0, keys)
x = mx.array([1e8, 1.0, -3.5, 0.1], dtype=mx.float32)
s = k.link_sum(x, link); mx.eval(s); print(s.tolist(), flush=True)
g = k.link_gather(mx.full((2, 1), 7.0), link, [3, 1]); mx.eval(g)
print(link.receive(5.0).decode(), flush=True)
if sys.argv[2] == "silent":
    time.sleep(30)
"""


KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))


def _peer(
    mode: str, key: bytes | None = None, peer_key: bytes | None = None
) -> tuple[Any, subprocess.Popen[str]]:
    """Rank 0's link to a rank 1 in another process (`_PEER`), both sealed with their key if given."""
    a, b = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-c", _PEER, str(b.fileno()), mode, (peer_key or b"").hex()],
        pass_fds=[b.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    b.close()
    return native().TensorLink([-1, a.detach()], 0, 2.0, [b"", key] if key else []), process


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "sealed"])
def test_sums_are_added_in_rank_order_so_every_rank_has_the_same_bits(key: bytes | None) -> None:
    link, process = _peer("close", key, key)
    try:
        assert link.sealed == (key is not None)
        x = mx.array([1.0, 1e-8, 2.0, 0.2], dtype=mx.float32)
        s = native().link_sum(x, link)
        mx.eval(s)
        assert link.ok, link.error
        want = (x + mx.array([1e8, 1.0, -3.5, 0.1], dtype=mx.float32)).tolist()
        assert s.tolist() == want
        assert process.stdout is not None and process.stdout.readline().strip() == str(want)
        g = native().link_gather(mx.arange(6, dtype=mx.float32).reshape(2, 3), link, [3, 1])
        mx.eval(g)
        assert g.tolist() == [[0.0, 1.0, 2.0, 7.0], [3.0, 4.0, 5.0, 7.0]]
        link.broadcast(b"step 1")
        assert process.stdout.readline().strip() == "step 1"
        assert process.wait(timeout=10) == 0
        s = native().link_sum(x, link)  # the peer has exited: the step fails, and says why
        mx.eval(s)
        assert not link.ok and "rank 1 closed the link (sum" in link.error
    finally:
        process.kill()
        process.wait()


def test_a_silent_rank_fails_the_step_within_the_timeout() -> None:
    link, process = _peer("silent")
    try:
        mx.eval(native().link_sum(mx.ones(4), link))
        mx.eval(native().link_gather(mx.ones((2, 3)), link, [3, 1]))
        link.broadcast(b"go")
        started = time.monotonic()
        mx.eval(native().link_sum(mx.ones(4), link))  # the peer sleeps instead of summing
        assert time.monotonic() - started < 10
        assert not link.ok and "timed out after 2" in link.error and "(sum)" in link.error
    finally:
        process.kill()
        process.wait()


def test_sealed_frames_hide_their_payload_and_another_key_fails_them() -> None:
    for key, shown in ((None, True), (KEY, False)):
        a, b = socket.socketpair()
        link = native().TensorLink([-1, a.detach()], 0, 2.0, [b"", key] if key else [])
        link.broadcast(b"the secret words")
        b.settimeout(5)
        wire = b.recv(4096)
        b.close()
        assert (b"the secret words" in wire) == shown
        assert len(wire) == 16 + len(b"the secret words") + (0 if shown else 2 * 16)  # header, payload, tags
    link, process = _peer("close", KEY, OTHER_KEY)
    try:
        mx.eval(native().link_sum(mx.ones(4), link))
        assert not link.ok and "failed authentication (sum" in link.error
    finally:
        process.kill()
        process.wait()


# --- groups of real follower processes --------------------------------------------------------


@pytest.fixture(scope="module")
def llama_q4(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tensor")
    source = make_random_model(
        root / "f32", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4,
        tokenizer_from=builtin_model_dir,
    )  # fmt: skip
    return quantized_copy(source, root / "q4", bits=4, group_size=32)


@pytest.fixture(scope="module")
def qwen3_q8(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3 (per-head q/k norms) with 3 KV heads: 2 ranks hold 1 and 2 of them."""
    root = tmp_path_factory.mktemp("tensor")
    source = make_random_model(
        root / "f32", model_type="qwen3", num_layers=3, hidden_size=192, intermediate_size=384, num_heads=6,
        num_kv_heads=3, tokenizer_from=builtin_model_dir, seed=3,
    )  # fmt: skip
    return quantized_copy(source, root / "q8", bits=8, group_size=64)


@pytest.fixture(scope="module")
def qwen3_moe_q4(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """qwen3_moe: 8 experts of width 64 (32 rows of each on a rank), top 2, the router whole."""
    from tests.test_expert_layers import make_qwen3_moe

    root = tmp_path_factory.mktemp("tensor")
    return quantized_copy(
        make_qwen3_moe(root / "bf16", tokenizer_from=builtin_model_dir), root / "q4", bits=4, group_size=32
    )


@cache
def _one_process(model_dir: Path) -> PipelineGenerator:
    return PipelineGenerator(load_shard(model_dir, start=0, prepare=apply_dtype_policy))


PROMPT = list(range(300, 337))


def _assert_logits_match(generator: TensorGenerator, one: PipelineGenerator, prompt: list[int]) -> None:
    """The group's logits after `prompt` are one process's. Partial sums add in another order than
    one product: float32 rounding, nothing more."""
    shard = generator.tensor
    got = shard.logits(shard.forward(mx.array(prompt)[None], shard.make_cache()))
    want = one.shard.logits(one.shard.forward(mx.array(prompt)[None], one.shard.make_cache()))
    assert mx.abs(got - want).max() < 2e-3 * mx.abs(want).max()


@pytest.mark.parametrize(
    ("model", "size"), [("llama_q4", 2), ("llama_q4", 3), ("qwen3_q8", 2), ("qwen3_moe_q4", 2)]
)
def test_greedy_tokens_and_logits_match_one_process(
    model: str, size: int, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(model)
    one = _one_process(model_dir)
    expected = list(one.generate(PROMPT, max_tokens=24, prefill_step_size=8))
    with tensor_group(model_dir, size) as (generator, _):
        assert list(generator.generate(PROMPT, max_tokens=24, prefill_step_size=8)) == expected
        assert list(generator.generate(PROMPT[:1], max_tokens=4)) == list(
            one.generate(PROMPT[:1], max_tokens=4)
        )
        _assert_logits_match(generator, one, PROMPT)


@pytest.mark.parametrize("size", [2, 3])
def test_a_long_prefill_chunk_summed_in_parts_matches_one_process(llama_q4: Path, size: int) -> None:
    """A 400-row chunk: the tail's sums queue on the link part by part (3 parts), as a real
    prompt's 512-token chunks do; the text and the last logits are one process's."""
    prompt = [(7 * i) % 40000 + 300 for i in range(400)]
    one = _one_process(llama_q4)
    expected = list(one.generate(prompt, max_tokens=8, prefill_step_size=512))
    with tensor_group(llama_q4, size) as (generator, _):
        assert list(generator.generate(prompt, max_tokens=8, prefill_step_size=512)) == expected
        _assert_logits_match(generator, one, prompt)


def test_a_sealed_group_answers_as_an_open_one(llama_q4: Path) -> None:
    """A cluster with a secret: every pair's frames sealed with the key of its handshake."""
    expected = list(_one_process(llama_q4).generate(PROMPT, max_tokens=12, prefill_step_size=8))
    sealed = LinkSecurity(bytes(range(32)), sealed=True)
    with tensor_group(llama_q4, 3, security=sealed) as (generator, _):
        assert generator.tensor.link.sealed
        assert list(generator.generate(PROMPT, max_tokens=12, prefill_step_size=8)) == expected


def test_seeded_sampling_repeats_itself(llama_q4: Path) -> None:
    """The same seed gives the same tokens (what failover's replay needs). Not one process's: a
    draw from a random model's nearly flat distribution turns on the last bits of its logits."""
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=0, min_p=0.0, seed=1234)
    with tensor_group(llama_q4, 2) as (generator, _):
        first = list(generator.generate(PROMPT, max_tokens=12, sampling=sampling))
        assert list(generator.generate(PROMPT, max_tokens=12, sampling=sampling)) == first
        assert first != list(generator.generate(PROMPT, max_tokens=12))


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_rank_that_dies_or_freezes_fails_the_request_within_the_timeout(llama_q4: Path, how: str) -> None:
    with tensor_group(llama_q4, 3, link_timeout=2.0, connect_timeout=3.0) as (generator, followers):
        tokens = generator.generate(PROMPT, max_tokens=500)
        assert len([next(tokens) for _ in range(3)]) == 3
        os.kill(followers[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        started = time.monotonic()
        try:
            # Frozen: rank 0 times out, or rank 1 did first (waiting for rank 2) and closed its link.
            frozen = "timed out after 2|rank 1 closed the link"
            with pytest.raises(TensorLinkError, match="closed the link" if how == "killed" else frozen):
                for _ in tokens:
                    pass
            assert time.monotonic() - started < 10
            with pytest.raises(HopError):  # the next request cannot form the group: it fails at once
                next(generator.generate(PROMPT, max_tokens=3))
        finally:
            os.kill(followers[1].pid, signal.SIGKILL)


def test_the_next_request_forms_the_group_again_after_a_failure(llama_q4: Path) -> None:
    """A link that broke (here: rank 0 closed it) is formed again by the next request; the other
    ranks kept their slices loaded and waited."""
    one = _one_process(llama_q4)
    expected = list(one.generate(PROMPT, max_tokens=8))
    with tensor_group(llama_q4, 3, link_timeout=2.0) as (generator, followers):
        assert list(generator.generate(PROMPT, max_tokens=8)) == expected
        generator.disconnect()
        assert list(generator.generate(PROMPT, max_tokens=8)) == expected
        assert all(process.poll() is None for process in followers)


def test_families_and_sizes_without_a_tensor_split_are_refused_before_loading(
    llama_q4: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "sinks"
    folder.mkdir()
    config = json.loads((llama_q4 / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "model_type": "gpt_oss"})
    )  # no weights: never read
    with pytest.raises(ShardError, match="'gpt_oss' has no tensor-parallel forward yet"):
        load_tensor_shard(folder, rank=0, size=2)
    with pytest.raises(ShardError, match="4 KV heads cannot be spread over 5 ranks"):
        load_tensor_shard(llama_q4, rank=0, size=5)


def test_a_link_of_another_rank_is_refused(llama_q4: Path) -> None:
    shard = load_tensor_shard(llama_q4, rank=1, size=2)
    link, process = _peer("close")
    try:
        with pytest.raises(ValueError, match="rank 1 of 2"):
            shard.attach(link)
    finally:
        link.close()
        process.kill()
        process.wait()


def test_a_runner_in_tensor_mode_answers_as_a_whole_model_runner(llama_q4: Path) -> None:
    """Real runner processes as a node starts them: one holds the whole model (and batches), the
    other is rank 0 of a 2-rank group whose rank 1 is a follower process; greedy answers agree."""
    from node.runner.supervisor import RunnerSpec, RunnerSupervisor
    from protocol.chat import SamplingParams
    from tests.test_seeded_sampling import MODEL, answer, request

    follower = spawn(follower_command(llama_q4, 1, 2, link_timeout=10.0), env=None, stdin=False)
    try:
        address = ready_address(follower)
        whole = RunnerSupervisor(
            RunnerSpec(MODEL, model_path=llama_q4, prefill_step_size=16, prefix_cache_tokens=0)
        )
        split = RunnerSupervisor(
            RunnerSpec(
                MODEL, model_path=llama_q4, prefill_step_size=16, prefix_cache_tokens=0, tensor=(address,)
            )
        )
        greedy = SamplingParams(temperature=0.0, max_tokens=16)

        async def scenario() -> None:
            async with trio.open_nursery() as nursery:
                await nursery.start(whole.run)
                await nursery.start(split.run)
                with trio.fail_after(120):
                    alone = await answer(whole.open_stream(request("whole", greedy)))
                    assert await answer(split.open_stream(request("split", greedy))) == alone
                    assert alone[1].usage.completion_tokens == 16
                nursery.cancel_scope.cancel()

        trio.run(scenario)
    finally:
        terminate(follower, 5.0)
