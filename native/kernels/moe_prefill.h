// The mixture-of-experts MLP of many tokens (prefill) inside `moe_mlp` / `moe_routed`: the
// (token, expert) pairs grouped by expert, then, on the kernels' `gemm`, five pool jobs for the
// whole layer whatever the number of experts: x rounded once per pair row, every expert's gate and
// up panels with the activation on each panel's outputs, the activations rounded for down, every
// expert's down panels, and the sum weighted by the router's scores. mlx-lm's SwitchGLU path runs
// the same products as three gather_matmul ops, each sorting and copying x again, with the
// activation, the weighting and the sum as MLX ops over [tokens, k, ...] arrays in between.
// Experts with up to kMaxRows pairs (few tokens, or a batch of 9-63 decoding) take the `rows`
// kernel as gather_product's do: two more pool jobs.
// Without a `gemm` (AVX2, portable) each expert's products go to `product` one after another.
#pragma once

#include "moe.h"

namespace shoal {

// y [T, D] for T tokens of x [T, D] (T > kMaxRows pays; any T is right) with their k experts and scores.
void moe_prefill(const BoundExperts& gate, const BoundExperts& up, const BoundExperts& down, Activation act,
                 float alpha, float limit, const float* x, const uint32_t* indices, const float* scores, int T,
                 int k, float* y);

}  // namespace shoal
