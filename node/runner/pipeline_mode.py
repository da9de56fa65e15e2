"""The runner's pipeline and tensor modes: this process drives the other processes of its instance.

A runner whose spec has a `pipeline` route (k, host, HOST:PORT of each later stage) loads only
its shard and generates with `node.pipeline.driver.PipelineGenerator`, one request at a time (no
batching, no prefix cache). One with a `tensor` group (HOST:PORT of ranks 1..) loads rank 0's
slice of every layer and generates with `node.tensor.shard.TensorGenerator`, the same way. The
per-request logic is the engine's: `admit` checks the prompt, `RequestOutput` turns tokens into
events and ends each request with exactly one terminal event. A link or stage failure mid-request
ends that request with a `server_error`; the next one reconnects.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from node.cpu.dtype import apply_dtype_policy
from node.pipeline.driver import PipelineError, PipelineGenerator
from node.pipeline.hop import HopError, parse_address
from node.pipeline.link_auth import LinkSecurity
from node.pipeline.shard import load_shard
from node.runner.engine import Admitted, LoadedModel, RequestOutput, admit, loaded_model
from protocol.chat import GenerateRequest
from protocol.events import PIPELINE_FAILED, ChunkEvent, FinishReason
from protocol.ids import RequestId

log = logging.getLogger("shoal.runner")


def load_pipeline(
    path: Path, *, end: int, stages: list[str], host: str, vocab_dir: Path | None
) -> tuple[LoadedModel, PipelineGenerator]:
    shard = load_shard(path, start=0, end=end, prepare=apply_dtype_policy)
    config = shard.config
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    loaded = loaded_model(shard, tokenizer, config, vocab_dir=vocab_dir, folder=path)
    if loaded.sampling.repetition_penalty not in (None, 1.0):
        log.warning(
            "this model's repetition_penalty %s is not applied in a pipeline: the last stage samples "
            "from hidden states and never sees the tokens it penalizes",
            loaded.sampling.repetition_penalty,
        )
    stage_addresses = [parse_address(s) for s in stages]
    driver = PipelineGenerator(shard, stages=stage_addresses, host=host, security=LinkSecurity.from_env())
    return loaded, driver


def load_tensor(
    path: Path, *, followers: list[str], vocab_dir: Path | None
) -> tuple[LoadedModel, PipelineGenerator]:
    """Rank 0 of a tensor-parallel group (`node.tensor`); the group forms at the first request."""
    from node.tensor.shard import TensorGenerator, load_tensor_shard

    shard = load_tensor_shard(path, rank=0, size=len(followers) + 1, prepare=apply_dtype_policy)
    tokenizer = load_tokenizer(path, eos_token_ids=shard.config.get("eos_token_id"))
    loaded = loaded_model(shard, tokenizer, shard.config, vocab_dir=vocab_dir, folder=path)
    return loaded, TensorGenerator(shard, followers, security=LinkSecurity.from_env())


def run_one(
    loaded: LoadedModel,
    driver: PipelineGenerator,
    request: GenerateRequest,
    *,
    emit: Callable[[RequestId, ChunkEvent], None],
    is_cancelled: Callable[[RequestId], bool],
    prefill_step_size: int,
) -> None:
    """Generate one request through the pipeline; `emit` gets its events, the last one terminal."""
    rid = request.request_id

    def send(event: ChunkEvent) -> None:
        emit(rid, event)

    admitted = admit(loaded, request)
    if not isinstance(admitted, Admitted):
        send(admitted)
        return
    output = RequestOutput(loaded, admitted, send)
    eos = loaded.tokenizer.eos_token_ids
    reason: FinishReason = "length"
    try:
        if (replayed_to_end := output.replay(admitted)) is not None:
            output.finish(replayed_to_end)
            return
        for n, token in enumerate(
            driver.generate(
                admitted.context,
                max_tokens=admitted.remaining,
                sampling=admitted.sampling,
                forced=admitted.replayed if admitted.forced else (),
                eos_token_ids=eos,
                prefill_step_size=prefill_step_size,
                progress_callback=lambda processed, _total: output.progress(processed),
                is_cancelled=lambda: is_cancelled(rid),
            )
        ):
            is_eos = token in eos
            last = is_eos or n + 1 == admitted.remaining
            if output.token(token, last=last):
                reason = "stop"
                break
            if last:
                reason = "stop" if is_eos else "length"
                break
        else:
            # The generator ended without a last token: it was cancelled.
            if is_cancelled(rid):
                reason = "cancelled"
    except (HopError, PipelineError) as exc:
        log.warning("request %s failed in the pipeline: %s", rid, exc)
        output.fail(f"the pipeline failed: {exc}", code=PIPELINE_FAILED)
        return
    except Exception as exc:  # never leave a request without its terminal event
        log.exception("request %s failed", rid)
        output.fail(f"{type(exc).__name__}: {exc}")
        return
    output.finish(reason)
