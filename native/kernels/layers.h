// A decoder layer's products as two MLX operations instead of ~20 (native/kernels/layers.cpp).
//
// On the CPU every MLX operation costs 10-20 us of scheduling around its work, and a llama-shaped
// layer's decode step is ~27 of them (norm, three products, six reshapes and transposes, rope,
// cache, attention, product, add, norm, two products, silu, multiply, product, add). For a small
// model that overhead is most of the step. These two primitives do the same arithmetic, in the
// same order, with the same kernels, so their results are the bits of the separate operations:
//
// - `decoder_head`: rms_norm(x) * w, then the q, k and v products (each + its bias, if any), each
//   written as [B, heads, L, head_dim] (what attention reads; for one token that is the product's
//   own layout, so no copy).
// - `decoder_tail`: h = x + o(attention); out = h + down(silu(gate(n)) * up(n)), n = rms_norm(h) * w.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "matmul.h"
#include "tensor_link.h"

namespace shoal {

// One projection as Python hands it over: weight, scales, biases (affine), bias (added to the
// output), group size, bits. Absent parts are None.
using Projection = std::tuple<mx::array, std::optional<mx::array>, std::optional<mx::array>,
                              std::optional<mx::array>, int, int>;

// How a projection's arrays sit in a primitive's inputs, and its layout.
struct ProjectionDesc {
  WeightSpec spec;
  bool scales, biases, bias;
};

class DecoderHead : public mx::Primitive {
 public:
  DecoderHead(mx::Stream stream, float eps, std::vector<ProjectionDesc> projections, std::vector<int> heads)
      : mx::Primitive(stream), eps_(eps), projections_(std::move(projections)), heads_(std::move(heads)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override { return "ShoalDecoderHead"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
  std::vector<ProjectionDesc> projections_;
  std::vector<int> heads_;
};

class DecoderTail : public mx::Primitive {
 public:
  DecoderTail(mx::Stream stream, float eps, std::vector<ProjectionDesc> projections,
              std::shared_ptr<TensorLink> link)
      : mx::Primitive(stream), eps_(eps), projections_(std::move(projections)), link_(std::move(link)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override;
  const char* name() const override { return "ShoalDecoderTail"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[1].shape()}; }

 private:
  float eps_;
  std::vector<ProjectionDesc> projections_;  // o, gate, up, down
  std::shared_ptr<TensorLink> link_;         // a tensor-parallel slice's: sums o's and down's outputs
};

// x [B, L, E] float32; norm_weight [E]; projections q, k, v; heads: each one's head count.
// Returns each projection's output as [B, heads, L, N / heads].
std::vector<mx::array> decoder_head(const mx::array& x, const mx::array& norm_weight, float eps,
                                    const std::vector<Projection>& projections, const std::vector<int>& heads,
                                    mx::StreamOrDevice s = {});

// attention [B, L, A]; x [B, L, E] (the layer's input); o: A -> E; gate, up: E -> I; down: I -> E;
// none of them with a bias. Returns the layer's output [B, L, E].
mx::array decoder_tail(const mx::array& attention, const mx::array& x, const Projection& o,
                       const mx::array& norm_weight, float eps, const Projection& gate, const Projection& up,
                       const Projection& down, std::shared_ptr<TensorLink> link = nullptr,
                       mx::StreamOrDevice s = {});

// silu(x) into y over n values, split over the pool as FusedSiLU splits it (so the same bits).
void silu_into(const float* x, long n, float* y);

// ---- what the two primitives and the layer stack (stack.h) share ----

// A projection's layout checked against its input's K features (`what` names it in the error).
ProjectionDesc describe(const Projection& p, int K, const char* what);
// Appends a projection's arrays to a primitive's inputs (a bias as float32).
void push(const Projection& p, std::vector<mx::array>& inputs, mx::StreamOrDevice s);
// A projection's evaluated arrays, read from `inputs` at `at` (advanced past them).
struct Bound {
  Weights weights;
  const float* bias;
};
Bound bound_at(const ProjectionDesc& d, const std::vector<mx::array>& inputs, size_t& at);
// y = (x * rsqrt(mean(x^2) + eps)) * w per row of D values, as FusedRMSNorm computes it.
void rms_rows(const float* x, long rows, int D, const float* w, float eps, float* y);
// A 1-D float32 array's values, dense: its own data's or a copy's.
const float* weight_row(const mx::array& w, std::vector<float>& copy);
// decoder_head on M rows of x [M, E]: each projection (+ its bias) into ys[i], [M, N_i] row-major.
void head_rows(const float* x, long M, int E, const float* norm_w, float eps, const std::vector<Bound>& projections,
               const std::vector<float*>& ys);
// decoder_tail on M rows: att [M, A], x [M, E] into y [M, E]. With a link (a tensor-parallel
// slice: o's columns and down's are this rank's), o's and down's outputs are summed over the ranks
// before each residual.
void tail_rows(const float* att, const float* x, long M, int E, const float* norm_w, float eps, const Bound& o,
               const Bound& gate, const Bound& up, const Bound& down, float* y, TensorLink* link = nullptr);

}  // namespace shoal
