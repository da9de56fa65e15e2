// The mixture-of-experts MLP (moe.h): per block of up to kMaxRows tokens, the (token, expert)
// pairs grouped by expert, the gate and up rows of every chosen expert as one pool job, the
// activation, the down rows as another, and the weighted sum, all inside one MLX operation.
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "fused.h"
#include "moe_prefill.h"
#include "mlx/backend/cpu/encoder.h"

namespace shoal {

namespace {

BoundExperts bind_experts(const ExpertDesc& d, const std::vector<mx::array>& inputs, size_t& at) {
  const mx::array& w = inputs[at++];
  const mx::array& scales = inputs[at++];
  const mx::array* biases = d.biases ? &inputs[at++] : nullptr;
  const float* bias = d.bias ? inputs[at++].data<float>() : nullptr;
  const Weights first = weights_of(d.spec, w, &scales, biases);
  // Row-contiguous (checked by weights_of): an expert's bytes are its stride along the first axis.
  return {{first, static_cast<long>(w.strides(0) * w.itemsize()),
           static_cast<long>(scales.strides(0) * scales.itemsize()), d.E},
          bias};
}

}  // namespace

void activate(Activation act, float alpha, float limit, float* g, float* u, const float* gate_bias,
              const float* up_bias, int n, float* h) {
  if (gate_bias)
    for (int i = 0; i < n; i++) g[i] += gate_bias[i];
  if (up_bias)
    for (int i = 0; i < n; i++) u[i] += up_bias[i];
  const FusedKernels& k = active_fused();
  if (act == Activation::SwiGLU) {
    k.silu(g, n, h);
    for (int i = 0; i < n; i++) h[i] *= u[i];
    return;
  }
  // g * sigmoid(alpha g) = silu(alpha g) / alpha, on the vector silu.
  for (int i = 0; i < n; i++) g[i] = alpha * std::min(g[i], limit);
  k.silu(g, n, h);
  for (int i = 0; i < n; i++) h[i] = (std::clamp(u[i], -limit, limit) + 1.0f) * (h[i] / alpha);
}

void weighted_sum(const float* d, const int* row_of, const uint32_t* indices, const float* scores,
                  const float* down_bias, int t0, int t1, int k, int D, float* y) {
  for (int t = t0; t < t1; t++) {
    float* yt = y + static_cast<long>(t) * D;
    std::fill_n(yt, D, 0.0f);
    for (int j = 0; j < k; j++) {
      const int p = t * k + j, r = row_of[p];
      if (r < 0) continue;
      const float w = scores[p], *dr = d + static_cast<long>(r) * D;
      const float* bias = down_bias ? down_bias + static_cast<long>(indices[p]) * D : nullptr;
      if (bias) {
        for (int i = 0; i < D; i++) yt[i] += (dr[i] + bias[i]) * w;
      } else {
        for (int i = 0; i < D; i++) yt[i] += dr[i] * w;
      }
    }
  }
}

namespace {

// Buffers kept across calls (a decode step calls this every MoE layer): no allocation per call.
struct Scratch {
  std::vector<int> order, row_of;
  std::vector<float> g, u, h, d, x;  // x: the float rows of a group (the portable kernels read them)
  std::vector<int16_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<PreparedActs> down_acts;
  std::vector<Acts> acts;
  std::vector<Weights> weights;
  std::vector<RowsJob> jobs;
  PreparedActs tokens;
};

// One block of T <= kMaxRows tokens: x [T, D] -> y [T, D].
void moe_block(const BoundExperts& gate, const BoundExperts& up, const BoundExperts& down, Activation act,
               float alpha, float limit, const float* x, const uint32_t* indices, const float* scores, int T,
               int k, float* y, Scratch& s) {
  const int D = gate.experts.first.K, I = gate.experts.first.N, E = gate.experts.E;
  const int P = T * k;
  s.order.resize(P);
  std::iota(s.order.begin(), s.order.end(), 0);
  std::stable_sort(s.order.begin(), s.order.end(), [&](int a, int b) { return indices[a] < indices[b]; });
  // Groups: runs of one expert in `order`, at most kMaxRows pairs each; pairs of no expert dropped.
  struct Group {
    int e, begin, end;  // pairs order[begin .. end)
  };
  thread_local std::vector<Group> groups;
  groups.clear();
  s.row_of.assign(P, -1);
  int rows = 0;
  for (int i = 0; i < P;) {
    const uint32_t e = indices[s.order[i]];
    int j = i;
    while (j < P && indices[s.order[j]] == e && j - i < kMaxRows) j++;
    if (e < static_cast<uint32_t>(E)) {
      groups.push_back({static_cast<int>(e), i, j});
      for (int b = i; b < j; b++) s.row_of[s.order[b]] = rows++;
    }
    i = j;
  }
  const size_t G = groups.size();
  // x rounded once per token for the gate/up layout; a group of other tokens gets its rows copied.
  const Acts all = s.tokens.prepare(gate.experts.first, x, T, &expert_kernels());
  const int chunks = all.groups;
  s.xq.resize(static_cast<size_t>(rows) * D);
  s.x.resize(static_cast<size_t>(rows) * D);
  s.xscale.resize(static_cast<size_t>(rows) * chunks);
  s.xsum.resize(static_cast<size_t>(rows) * chunks);
  s.g.resize(static_cast<size_t>(rows) * I), s.u.resize(s.g.size()), s.h.resize(s.g.size());
  s.d.resize(static_cast<size_t>(rows) * D);
  s.acts.resize(G), s.weights.resize(3 * G);
  if (s.down_acts.size() < G) s.down_acts.resize(G);
  s.jobs.clear();
  for (size_t gi = 0, row = 0; gi < G; gi++) {
    const Group& g = groups[gi];
    const int n = g.end - g.begin;
    bool identity = n == T;  // the group is every token in order: the prepared rows as they are
    for (int b = 0; identity && b < n; b++) identity = s.order[g.begin + b] / k == b;
    if (identity) {
      s.acts[gi] = all;
    } else {
      for (int b = 0; b < n; b++) {
        const int t = s.order[g.begin + b] / k;
        const size_t r = row + b;
        std::memcpy(&s.x[r * D], x + static_cast<long>(t) * D, D * sizeof(float));
        std::memcpy(&s.xq[r * D], all.xq + static_cast<long>(t) * D, D * sizeof(int16_t));
        std::memcpy(&s.xscale[r * chunks], all.xscale + t * chunks, chunks * sizeof(float));
        std::memcpy(&s.xsum[r * chunks], all.xsum + t * chunks, chunks * sizeof(float));
      }
      s.acts[gi] = {n, D, chunks, &s.x[row * D], &s.xq[row * D], &s.xscale[row * chunks], &s.xsum[row * chunks],
                    all.kernels};
    }
    s.weights[3 * gi] = gate.experts.at(g.e), s.weights[3 * gi + 1] = up.experts.at(g.e);
    s.jobs.push_back({&s.weights[3 * gi], &s.acts[gi], &s.g[row * I]});
    s.jobs.push_back({&s.weights[3 * gi + 1], &s.acts[gi], &s.u[row * I]});
    row += n;
  }
  if (!s.jobs.empty()) run_rows(s.jobs.data(), s.jobs.size());
  // The activation, then the down products of every group as one job.
  s.jobs.clear();
  for (size_t gi = 0, row = 0; gi < G; gi++) {
    const Group& g = groups[gi];
    const int n = g.end - g.begin;
    for (int b = 0; b < n; b++) {
      const size_t r = (row + b) * I;
      activate(act, alpha, limit, &s.g[r], &s.u[r], gate.bias ? gate.bias + static_cast<long>(g.e) * I : nullptr,
               up.bias ? up.bias + static_cast<long>(g.e) * I : nullptr, I, &s.h[r]);
    }
    s.weights[3 * gi + 2] = down.experts.at(g.e);
    s.acts[gi] = s.down_acts[gi].prepare(s.weights[3 * gi + 2], &s.h[row * I], n, &expert_kernels());
    s.jobs.push_back({&s.weights[3 * gi + 2], &s.acts[gi], &s.d[row * D]});
    row += n;
  }
  if (!s.jobs.empty()) run_rows(s.jobs.data(), s.jobs.size());
  weighted_sum(s.d.data(), s.row_of.data(), indices, scores, down.bias, 0, T, k, D, y);
}

// Each token's top k experts and scores from its logits [T, E] (ties: the lower index; NaN lowest).
void route(const float* logits, int T, int E, const RouterDesc& r, uint32_t* indices, float* scores) {
  thread_local std::vector<int> order;
  order.resize(E);
  const int k = r.top_k;
  for (int t = 0; t < T; t++) {
    const float* l = logits + static_cast<long>(t) * E;
    auto key = [&](int e) { return std::isnan(l[e]) ? -std::numeric_limits<float>::infinity() : l[e]; };
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    uint32_t* it = indices + static_cast<long>(t) * k;
    float* st = scores + static_cast<long>(t) * k;
    const float top = key(order[0]);
    float chosen = 0.0f, all = 0.0f;
    for (int j = 0; j < k; j++) {
      it[j] = static_cast<uint32_t>(order[j]);
      st[j] = std::exp(key(order[j]) - top);
      chosen += st[j];
    }
    if (r.routing == Routing::SoftmaxTopK) {  // probabilities over all experts; then renormalized if asked
      for (int e = 0; e < E; e++) all += std::exp(key(e) - top);
      for (int j = 0; j < k; j++) st[j] /= all;
      if (r.norm)
        for (int j = 0; j < k; j++) st[j] /= chosen / all;
    } else {
      for (int j = 0; j < k; j++) st[j] /= chosen;
    }
  }
}

ExpertDesc describe_experts(const ExpertProjection& p, const char* what) {
  const auto& [w, scales, biases, bias, group_size, bits] = p;
  ExpertDesc d{expert_spec(w, scales, biases, group_size, bits, what), w.shape(0), biases.has_value(),
               bias.has_value()};
  if (!is_grouped(d.spec.format))
    throw std::invalid_argument(std::string("[shoal_moe_mlp] ") + what + " must be quantized (affine or MXFP4)");
  if (bias && bias->shape() != mx::Shape{d.E, d.spec.N})
    throw std::invalid_argument(std::string("[shoal_moe_mlp] ") + what + "'s bias must be [experts, N]");
  return d;
}

void push_experts(const ExpertProjection& p, std::vector<mx::array>& inputs, mx::StreamOrDevice s) {
  const auto& [w, scales, biases, bias, group_size, bits] = p;
  inputs.push_back(w);
  inputs.push_back(scales);
  if (biases) inputs.push_back(*biases);
  if (bias) inputs.push_back(mx::contiguous(mx::astype(*bias, mx::float32, s), false, s));
}

bool same(const ExpertDesc& a, const ExpertDesc& b) {
  return a.spec.format == b.spec.format && a.spec.group_size == b.spec.group_size && a.spec.N == b.spec.N &&
         a.spec.K == b.spec.K && a.E == b.E && a.biases == b.biases && a.bias == b.bias;
}

}  // namespace

mx::array moe_mlp(const mx::array& x, const mx::array& indices, const mx::array& scores, const ExpertProjection& gate,
                  const ExpertProjection& up, const ExpertProjection& down, const std::string& activation,
                  float alpha, float limit, mx::StreamOrDevice s) {
  Activation act;
  if (activation == "swiglu") {
    act = Activation::SwiGLU;
  } else if (activation == "swiglu_oai") {
    act = Activation::ClampedSwiGLU;
  } else {
    throw std::invalid_argument("[shoal_moe_mlp] activation must be 'swiglu' or 'swiglu_oai'");
  }
  if (!(alpha > 0.0f)) throw std::invalid_argument("[shoal_moe_mlp] alpha must be positive");
  const ExpertDesc g = describe_experts(gate, "shoal_moe_mlp gate"), u = describe_experts(up, "shoal_moe_mlp up"),
                   d = describe_experts(down, "shoal_moe_mlp down");
  if (!same(g, u)) throw std::invalid_argument("[shoal_moe_mlp] gate and up must have one layout");
  if (x.ndim() < 1 || x.shape(-1) != g.spec.K)
    throw std::invalid_argument("[shoal_moe_mlp] x must be [..., " + std::to_string(g.spec.K) + "]");
  if (d.spec.K != g.spec.N || d.spec.N != g.spec.K || d.E != g.E)
    throw std::invalid_argument("[shoal_moe_mlp] down must take gate's outputs back to x's features");
  if (!mx::issubdtype(indices.dtype(), mx::integer))
    throw std::invalid_argument("[shoal_moe_mlp] indices must be integers");
  mx::Shape lead(x.shape().begin(), x.shape().end() - 1);
  if (indices.ndim() != x.ndim() || scores.shape() != indices.shape() ||
      mx::Shape(indices.shape().begin(), indices.shape().end() - 1) != lead)
    throw std::invalid_argument("[shoal_moe_mlp] indices and scores must be [..., k] with x's leading shape");
  std::vector<mx::array> inputs{mx::contiguous(mx::astype(x, mx::float32, s), false, s),
                                mx::contiguous(mx::astype(indices, mx::uint32, s), false, s),
                                mx::contiguous(mx::astype(scores, mx::float32, s), false, s)};
  push_experts(gate, inputs, s), push_experts(up, inputs, s), push_experts(down, inputs, s);
  auto primitive = std::make_shared<MoeMlp>(mx::to_stream(s), std::nullopt, g, u, d, act, alpha, limit);
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}

mx::array moe_routed(const mx::array& x, const Projection& router, const ExpertProjection& gate,
                     const ExpertProjection& up, const ExpertProjection& down, int top_k, const std::string& routing,
                     bool norm_topk_prob, const std::string& activation, float alpha, float limit,
                     mx::StreamOrDevice s) {
  if (x.ndim() < 1) throw std::invalid_argument("[shoal_moe_mlp] x must be [..., D]");
  const ProjectionDesc r = describe(router, x.shape(-1), "router");
  if (routing != "softmax_topk" && routing != "topk_softmax")
    throw std::invalid_argument("[shoal_moe_mlp] routing must be 'softmax_topk' or 'topk_softmax'");
  if (top_k < 1 || top_k > r.spec.N)
    throw std::invalid_argument("[shoal_moe_mlp] top_k must be in [1, experts]");
  // The expert checks are moe_mlp's, on a stand-in for the indices and scores it would get.
  mx::Shape lead(x.shape().begin(), x.shape().end() - 1);
  lead.push_back(top_k);
  const mx::array stand_in = mx::zeros(lead, mx::uint32, s);
  const mx::array checked = moe_mlp(x, stand_in, mx::zeros(lead, mx::float32, s), gate, up, down, activation, alpha,
                                    limit, s);
  auto base = std::static_pointer_cast<MoeMlp>(checked.primitive_ptr());
  std::vector<mx::array> inputs{checked.inputs()[0]};
  push(router, inputs, s);
  for (size_t i = 3; i < checked.inputs().size(); i++) inputs.push_back(checked.inputs()[i]);
  const RouterDesc desc{r, top_k, routing == "softmax_topk" ? Routing::SoftmaxTopK : Routing::TopKSoftmax,
                        norm_topk_prob};
  auto primitive = std::make_shared<MoeMlp>(mx::to_stream(s), desc, base->gate_desc(), base->up_desc(),
                                            base->down_desc(), base->activation(), alpha, limit);
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}

void MoeMlp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  size_t at = router_ ? 1 : 3;
  std::optional<Bound> router;
  if (router_) router = bound_at(router_->router, inputs, at);
  const BoundExperts gate = bind_experts(gate_, inputs, at), up = bind_experts(up_, inputs, at),
                     down = bind_experts(down_, inputs, at);
  const int D = x.shape(-1), k = router_ ? router_->top_k : inputs[1].shape(-1);
  const int T = static_cast<int>(x.size() / std::max(D, 1));
  const uint32_t* given_indices = router_ ? nullptr : inputs[1].data<uint32_t>();
  const float* given_scores = router_ ? nullptr : inputs[2].data<float>();
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([gate, up, down, router, routing = router_, act = activation_, alpha = alpha_, limit = limit_,
                    x = mx::array::unsafe_weak_copy(x), given_indices, given_scores, y = out.data<float>(), T, D,
                    k]() {
    thread_local Scratch scratch;
    thread_local std::vector<float> logits, chosen_scores;
    thread_local std::vector<uint32_t> chosen;
    const float* xs = x.data<float>();
    const uint32_t* indices = given_indices;
    const float* scores = given_scores;
    if (router && T > 0) {  // logits = x @ W.T + bias, then each token's experts
      const int E = router->weights.N;
      logits.resize(static_cast<size_t>(T) * E);
      product(router->weights, xs, T, logits.data());
      if (router->bias)
        for (int t = 0; t < T; t++)
          for (int e = 0; e < E; e++) logits[static_cast<size_t>(t) * E + e] += router->bias[e];
      chosen.resize(static_cast<size_t>(T) * k), chosen_scores.resize(chosen.size());
      route(logits.data(), T, E, *routing, chosen.data(), chosen_scores.data());
      indices = chosen.data(), scores = chosen_scores.data();
    }
    if (T > kMaxRows) return moe_prefill(gate, up, down, act, alpha, limit, xs, indices, scores, T, k, y);
    for (int t0 = 0; t0 < T; t0 += kMaxRows) {
      const int n = std::min(kMaxRows, T - t0);
      moe_block(gate, up, down, act, alpha, limit, xs + static_cast<long>(t0) * D, indices + static_cast<long>(t0) * k,
                scores + static_cast<long>(t0) * k, n, k, y + static_cast<long>(t0) * D, scratch);
    }
  });
}

void MoeMlp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[shoal_moe_mlp] has no GPU implementation: on a GPU MLX's own kernels are used");
}

bool MoeMlp::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const MoeMlp&>(other);
  if (router_.has_value() != o.router_.has_value()) return false;
  if (router_) {
    const RouterDesc &a = *router_, &b = *o.router_;
    const WeightSpec &sa = a.router.spec, &sb = b.router.spec;
    if (a.top_k != b.top_k || a.routing != b.routing || a.norm != b.norm || sa.format != sb.format ||
        sa.group_size != sb.group_size || sa.N != sb.N || sa.K != sb.K || a.router.biases != b.router.biases ||
        a.router.bias != b.router.bias)
      return false;
  }
  return same(gate_, o.gate_) && same(up_, o.up_) && same(down_, o.down_) && activation_ == o.activation_ &&
         alpha_ == o.alpha_ && limit_ == o.limit_;
}

}  // namespace shoal
