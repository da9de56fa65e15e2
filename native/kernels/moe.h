// `moe_mlp`: a mixture-of-experts MLP for a few tokens (decode, small batches) as ONE MLX operation:
// each token's gate and up products with its chosen experts, the activation, the down product and
// the sum weighted by the router's scores. mlx-lm's SwitchGLU path is ~15 operations a layer
// (broadcasts, three expert products, the activation, the weighting, the sum), each 10-20 us of
// scheduling on the CPU stream; at decode those cost as much as the products themselves.
//
// The products are gather.h's: the (token, expert) pairs grouped by expert, each expert's rows
// read once for all its tokens, and every expert's gate and up rows one pool job (the down rows
// another). x is rounded to int16 once per token and shared by every expert's gate and up.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include "gather.h"
#include "layers.h"

namespace shoal {

// The activation between the gate/up and down products.
// - SwiGLU: silu(gate) * up (qwen3_moe, mixtral, ...).
// - ClampedSwiGLU (gpt_oss): g = min(gate, limit), u = clip(up, -limit, limit);
//   (u + 1) * g * sigmoid(alpha * g).
enum class Activation { SwiGLU, ClampedSwiGLU };

// One expert projection as Python hands it over: weight [E, N, K * bits / 32], scales, biases (absent:
// symmetric or MXFP4), bias [E, N] added to the output (absent: none), group size, bits.
using ExpertProjection = std::tuple<mx::array, mx::array, std::optional<mx::array>, std::optional<mx::array>, int, int>;

// An expert projection's layout, checked (std::invalid_argument names what is wrong).
struct ExpertDesc {
  WeightSpec spec;
  int E;
  bool biases, bias;
};

// How `moe_routed` picks each token's experts from its router logits (x @ W.T + bias):
// - SoftmaxTopK (qwen3_moe): softmax over all experts, the k largest probabilities as scores
//   (divided by their sum when `norm`);
// - TopKSoftmax (gpt_oss): the k largest logits, softmax over those k as scores.
enum class Routing { SoftmaxTopK, TopKSoftmax };
struct RouterDesc {
  ProjectionDesc router;
  int top_k;
  Routing routing;
  bool norm;
};

// An expert projection's evaluated arrays: the experts and the output bias [E, N] (or null).
struct BoundExperts {
  Experts experts;
  const float* bias;
};

// h = act(g + gate bias, u + up bias) over n values (g, u overwritten); biases may be null.
void activate(Activation act, float alpha, float limit, float* g, float* u, const float* gate_bias,
              const float* up_bias, int n, float* h);

// y[t] for t in [t0, t1): the sum over its k pairs p, in their order, of scores[p] x (row
// row_of[p] of d (D wide) + expert indices[p]'s down bias); pairs with row -1 add nothing.
void weighted_sum(const float* d, const int* row_of, const uint32_t* indices, const float* scores,
                  const float* down_bias, int t0, int t1, int k, int D, float* y);

class MoeMlp : public mx::Primitive {
 public:
  MoeMlp(mx::Stream stream, std::optional<RouterDesc> router, ExpertDesc gate, ExpertDesc up, ExpertDesc down,
         Activation activation, float alpha, float limit)
      : mx::Primitive(stream),
        router_(std::move(router)),
        gate_(gate),
        up_(up),
        down_(down),
        activation_(activation),
        alpha_(alpha),
        limit_(limit) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShoalMoeMlp"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
  const ExpertDesc& gate_desc() const { return gate_; }
  const ExpertDesc& up_desc() const { return up_; }
  const ExpertDesc& down_desc() const { return down_; }
  Activation activation() const { return activation_; }

 private:
  std::optional<RouterDesc> router_;  // absent: indices and scores are inputs
  ExpertDesc gate_, up_, down_;
  Activation activation_;
  float alpha_, limit_;
};

// y[t] = sum_j scores[t, j] * (down_e(act(gate_e(x[t]) + gate_bias_e, up_e(x[t]) + up_bias_e)) + down_bias_e),
// e = indices[t, j]. x float [..., D]; indices (integers) and scores [..., k] with x's leading
// shape. activation: "swiglu" or "swiglu_oai" (alpha, limit: gpt_oss's 1.702 and 7). Any number
// of tokens: blocks of kMaxRows, or more at once (moe_prefill.h). An index outside [0, E) adds nothing.
// Returns float32 [..., D].
mx::array moe_mlp(const mx::array& x, const mx::array& indices, const mx::array& scores, const ExpertProjection& gate,
                  const ExpertProjection& up, const ExpertProjection& down, const std::string& activation,
                  float alpha, float limit, mx::StreamOrDevice s = {});

// moe_mlp with the routing inside the same operation: router (a Projection, [E, D]) gives each
// token's logits, `routing` ("softmax_topk" or "topk_softmax", see Routing) its top_k experts and scores.
mx::array moe_routed(const mx::array& x, const Projection& router, const ExpertProjection& gate,
                     const ExpertProjection& up, const ExpertProjection& down, int top_k, const std::string& routing,
                     bool norm_topk_prob, const std::string& activation, float alpha, float limit,
                     mx::StreamOrDevice s = {});

}  // namespace shoal
