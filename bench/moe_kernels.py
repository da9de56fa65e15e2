"""The expert MLP kernels against the machine's memory bandwidth, side by side in one run.

Bench-shaped experts (hidden 2048, 64 experts, top 8, expert ffn 768; qwen3_moe affine 4-bit
g64 with bfloat16 scales, gpt_oss MXFP4 with expert biases), `--layers` layers of them (far more
than the caches hold). For 1 token and a few (continuous batching), each layer's MLP as:
- `moe_mlp`: the one operation node/cpu/moe_blocks.py runs at decode;
- `switchglu`: the route before it, mlx-lm's SwitchGLU on `gather_matmul` (three expert products,
  the activation, the weighting and the sum as separate MLX operations);
- `dense`: the chosen experts' rows as one dense weight_matmul each (gate, up, down), no gathering,
  no activation: what the rows kernel alone reads at.
It prints ms per token for all layers, the GB/s of expert bytes read, and the ratio to a plain numpy
sum over 1 GiB on the same threads (this host's bandwidth moves within minutes: the ratio is what
means something).

    .venv/bin/python bench/moe_kernels.py [--layers 8] [--tokens 1 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx
import numpy as np

from bench.runner_speed import memory_bandwidth
from node.native import load_kernels

HIDDEN, FFN, EXPERTS, TOP = 2048, 768, 64, 8


def experts(kind: str, n: int, k: int) -> tuple[Any, ...]:
    """One projection's stack of experts, made an expert at a time (a whole stack at once takes GBs)."""
    parts: list[tuple[mx.array, mx.array, mx.array | None]] = []
    for _ in range(EXPERTS):
        w = mx.random.normal((n, k)) * (1 / k**0.5)
        if kind == "mxfp4":
            q, s, *_ = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
            parts.append((q, s, None))
        else:
            q, s, b = mx.quantize(w, group_size=64, bits=4)
            parts.append((q, s.astype(mx.bfloat16), b.astype(mx.bfloat16)))
        mx.eval(*[a for a in parts[-1] if a is not None])
    wq, scales = mx.stack([p[0] for p in parts]), mx.stack([p[1] for p in parts])
    biases = None if kind == "mxfp4" else mx.stack([p[2] for p in parts if p[2] is not None])
    bias = mx.random.normal((EXPERTS, n)) * 0.1 if kind == "mxfp4" else None
    group = 32 if kind == "mxfp4" else 64
    mx.eval(wq, scales, *[a for a in (biases, bias) if a is not None])
    return (wq, scales, biases, bias, group, 4)


def expert_bytes(p: tuple[Any, ...], chosen: int) -> int:
    """Stored bytes of `chosen` experts of a projection (weights, scales, biases, bias)."""
    return sum(a.nbytes // EXPERTS * chosen for a in p[:4] if a is not None)


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def switchglu(
    k: Any, x: mx.array, idx: mx.array, scores: mx.array, layer: list[tuple[Any, ...]], oai: bool
) -> mx.array:
    """mlx-lm's SwitchGLU + the block's weighting on gather_matmul, as KernelSwitchLinear runs it."""

    def product(p: tuple[Any, ...], h: mx.array) -> mx.array:
        y = k.gather_matmul(h, p[0], p[1], p[2], idx, group_size=p[4], bits=p[5])
        return y + mx.expand_dims(p[3][idx], -2) if p[3] is not None else y

    h = mx.expand_dims(x, (-2, -3))
    up, gate = product(layer[1], h), product(layer[0], h)
    if oai:
        gate = mx.minimum(gate, 7.0)
        act = (mx.clip(up, -7.0, 7.0) + 1.0) * (gate * mx.sigmoid(1.702 * gate))
    else:
        act = gate * mx.sigmoid(gate) * up
    y = product(layer[2], act).squeeze(-2)
    return (y * scores[..., None]).sum(axis=-2)


def measure(
    k: Any, kind: str, layers: list[list[tuple[Any, ...]]], tokens: int, repeats: int
) -> list[tuple[str, float, float]]:
    """(route, seconds for all layers, GB/s of expert bytes) for each route at `tokens` tokens."""
    act, oai = ("swiglu_oai", True) if kind == "mxfp4" else ("swiglu", False)
    x = mx.random.normal((tokens, HIDDEN))
    idx = mx.stack([mx.random.permutation(EXPERTS)[:TOP] for _ in range(tokens)]).astype(mx.int32)
    scores = mx.softmax(mx.random.normal((tokens, TOP)), axis=-1)
    h = mx.random.normal((tokens, FFN))
    mx.eval(x, idx, scores, h)
    distinct = len({int(e) for e in np.array(idx).flatten()})
    nbytes = len(layers) * sum(expert_bytes(p, distinct) for p in layers[0])
    runs: dict[str, tuple[Callable[[], None], int]] = {
        "moe_mlp": (
            lambda: mx.eval([k.moe_mlp(x, idx, scores, *lay, activation=act) for lay in layers]),
            nbytes,
        ),
        "switchglu": (lambda: mx.eval([switchglu(k, x, idx, scores, lay, oai) for lay in layers]), nbytes),
    }
    if tokens == 1:  # the token's experts as plain dense matrices: gate, up (of x), down (of h)
        dense = [
            [tuple(a[idx[0]].reshape(-1, a.shape[2]) for a in p[:3] if a is not None) for p in lay]
            for lay in layers
        ]
        mx.eval(dense)
        group = layers[0][0][4]
        runs["dense"] = (
            lambda: mx.eval(
                [
                    k.weight_matmul(x if i < 2 else h, *p, group_size=group, bits=4)
                    for lay in dense
                    for i, p in enumerate(lay)
                ]
            ),
            sum(a.nbytes for lay in dense for p in lay for a in p),
        )
    out = []
    for name, (fn, read) in runs.items():
        seconds = best_of(repeats, fn)
        out.append((name, seconds, read / seconds / 1e9))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kinds", nargs="+", default=["affine4", "mxfp4"])
    args = parser.parse_args()
    load = load_kernels()
    if load.module is None:
        sys.exit(f"no kernels: {load.reason}")
    k = load.module
    print(f"kernels: {load.reason}")
    threads = int(k.threads())
    before = memory_bandwidth(threads, 1.0)
    results = []
    for kind in args.kinds:
        layers = [
            [experts(kind, FFN, HIDDEN), experts(kind, FFN, HIDDEN), experts(kind, HIDDEN, FFN)]
            for _ in range(args.layers)
        ]
        for tokens in args.tokens:
            results += [(kind, tokens, *r) for r in measure(k, kind, layers, tokens, args.repeats)]
        del layers
    after = memory_bandwidth(threads, 1.0)
    sum_bw = max(before, after)
    print(f"numpy sum on {threads} threads: {before:.1f} GB/s before, {after:.1f} after (using {sum_bw:.1f})")
    print(f"{'experts':<8} {'tokens':>6} {'route':<10} {'ms (all layers)':>16} {'GB/s':>6} {'ratio':>6}")
    for kind, tokens, name, seconds, rate in results:
        print(f"{kind:<8} {tokens:>6} {name:<10} {seconds * 1e3:16.2f} {rate:6.1f} {rate / sum_bw:6.2f}")


if __name__ == "__main__":
    main()
