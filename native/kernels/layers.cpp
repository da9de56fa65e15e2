// The decoder-layer primitives (layers.h): each evaluates its whole chain in one task on MLX's CPU
// stream, the products split over the pool as `weight_matmul` splits them.
#include "layers.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "fused.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal {

namespace {
constexpr long kParallelMinWork = 1l << 17;  // values: below this one thread beats waking the pool
}  // namespace

ProjectionDesc describe(const Projection& p, int K, const char* what) {
  const auto& [w, scales, biases, bias, group_size, bits] = p;
  ProjectionDesc d{weight_spec(w, scales, biases, group_size, bits), scales.has_value(), biases.has_value(),
                   bias.has_value()};
  if (d.spec.K != K)
    throw std::invalid_argument(std::string("[shoal decoder] ") + what + " takes " + std::to_string(d.spec.K) +
                                " features, its input has " + std::to_string(K));
  if (bias && (bias->ndim() != 1 || bias->shape(0) != d.spec.N))
    throw std::invalid_argument(std::string("[shoal decoder] ") + what + "'s bias must be [N]");
  return d;
}

void push(const Projection& p, std::vector<mx::array>& inputs, mx::StreamOrDevice s) {
  const auto& [w, scales, biases, bias, group_size, bits] = p;
  inputs.push_back(w);
  if (scales) inputs.push_back(*scales);
  if (biases) inputs.push_back(*biases);
  if (bias) inputs.push_back(mx::astype(*bias, mx::float32, s));
}

Bound bound_at(const ProjectionDesc& d, const std::vector<mx::array>& inputs, size_t& at) {
  const mx::array& w = inputs[at++];
  const mx::array* scales = d.scales ? &inputs[at++] : nullptr;
  const mx::array* biases = d.biases ? &inputs[at++] : nullptr;
  const float* bias = d.bias ? inputs[at++].data<float>() : nullptr;
  return {weights_of(d.spec, w, scales, biases), bias};
}

// y = (x * rsqrt(mean(x^2) + eps)) * w per row, exactly as FusedRMSNorm computes it.
void rms_rows(const float* x, long rows, int D, const float* w, float eps, float* y) {
  const FusedKernels& k = active_fused();
  auto body = [&](long r0, long r1) {
    for (long r = r0; r < r1; r++) {
      const float* xr = x + r * D;
      float* yr = y + r * D;
      const float inv = 1.0f / std::sqrt(k.sumsq(xr, D) / static_cast<float>(D) + eps);
      for (int j = 0; j < D; j++) yr[j] = (xr[j] * inv) * w[j];
    }
  };
  Pool& pool = Pool::instance();
  if (pool.threads() == 1 || rows < 2 || rows * D < kParallelMinWork) {
    body(0, rows);
    return;
  }
  const long tasks = std::min<long>(rows, 4l * pool.threads()), per = (rows + tasks - 1) / tasks;
  pool.run(static_cast<int>((rows + per - 1) / per), [&](int t) { body(t * per, std::min(rows, (t + 1) * per)); });
}

namespace {

void add_into(float* y, const float* a, const float* b, long n) {  // y = a + b, as MLX's add
  for (long i = 0; i < n; i++) y[i] = a[i] + b[i];
}

// A layer's intermediates: each element is written before it is read, so growing one skips
// std::vector's zero fill (a 500-token chunk of a 1B model filled ~27 MB a layer for nothing).
template <class T>
struct Uninitialized : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <class U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
};
using Scratch = std::vector<float, Uninitialized<float>>;

float* buffer(Scratch& v, long n) {
  v.resize(static_cast<size_t>(n));
  return v.data();
}

// A prefill chunk's intermediates are tens of MB: kept between calls they would stay resident for
// good (the unfused layers freed theirs after each operation). A decode step's few KB are kept.
constexpr size_t kKeptFloats = 1 << 18;
template <class... V>
void release_large(V&... buffers) {
  ((buffers.capacity() > kKeptFloats ? V().swap(buffers) : void()), ...);
}

void check_norm(const mx::array& x, const mx::array& weight) {
  if (x.ndim() != 3) throw std::invalid_argument("[shoal decoder] x must be [B, L, E]");
  if (weight.ndim() != 1 || weight.shape(0) != x.shape(2))
    throw std::invalid_argument("[shoal decoder] the norm weight must be [E]");
}

}  // namespace

const float* weight_row(const mx::array& w, std::vector<float>& copy) {
  copy.resize(w.shape(0));
  for (int j = 0; j < w.shape(0); j++) copy[j] = w.data<float>()[j * w.strides()[0]];
  return copy.data();
}

void head_rows(const float* x, long M, int E, const float* norm_w, float eps, const std::vector<Bound>& bound,
               const std::vector<float*>& ys) {
  thread_local Scratch normed;
  float* xn = buffer(normed, M * E);
  rms_rows(x, M, E, norm_w, eps, xn);
  std::vector<Output> outs;
  for (size_t i = 0; i < bound.size(); i++) outs.push_back({&bound[i].weights, ys[i]});
  products(outs, xn, static_cast<int>(M));
  for (size_t i = 0; i < bound.size(); i++) {
    const int N = bound[i].weights.N;
    if (bound[i].bias)
      for (long r = 0; r < M; r++) add_into(ys[i] + r * N, ys[i] + r * N, bound[i].bias, N);
  }
  release_large(normed);
}

namespace {

// Rows at which a tensor-parallel tail overlaps its sums with its products (a prefill chunk's); it
// cuts them in parts of about kPartRows (at least 2, at most kMaxParts). Measured on the 3B shape
// at 1 Gbit/s (Intel Xeon, 9 prefills each): a 477-row chunk in 4 parts prefilled 58.7 tok/s on
// average, in 2 parts 53.6, in 8 parts 53.6 (smaller products cost more than the shorter wait
// saves); with the last of 4 parts half as long, 59.6 against 58.0.
constexpr long kOverlapRows = 16, kPartRows = 112;
constexpr int kMaxParts = 8;

// norm, gate/up, silu * up and down of M rows of h [M, E] into d [M, E].
void mlp_rows(const float* h, long M, int E, const float* norm_w, float eps, const Bound& gate, const Bound& up,
              const Bound& down, float* d) {
  thread_local Scratch nbuf, gbuf, ubuf;
  const int I = gate.weights.N;
  float* n = buffer(nbuf, M * E);
  rms_rows(h, M, E, norm_w, eps, n);
  float* g = buffer(gbuf, M * I);
  float* u = buffer(ubuf, M * I);
  products({{&gate.weights, g}, {&up.weights, u}}, n, static_cast<int>(M));
  silu_into(g, M * I, g);  // in place: each value is read before it is written
  for (long i = 0; i < M * I; i++) g[i] = g[i] * u[i];  // swiglu: silu(gate) * up
  product(down.weights, g, static_cast<int>(M), d);
  release_large(nbuf, gbuf, ubuf);
}

// tail_rows with a link on a prefill chunk: the rows in parts, each part's sums queued on the link
// as soon as its products are done, so that the wire carries one part while the next computes and
// only the last part's down sum waits on it (`bench/tensor_parallel.py`'s prefill).
void tail_overlapped(const float* att, const float* x, long M, int E, const float* norm_w, float eps, const Bound& o,
                     const Bound& gate, const Bound& up, const Bound& down, float* y, TensorLink& link) {
  thread_local Scratch hbuf, dbuf;
  const int A = o.weights.K, P = static_cast<int>(std::clamp<long>(M / kPartRows, 2, kMaxParts));
  std::vector<long> at(P + 1), summed_o(P), summed_d(P);
  for (int p = 0; p < P; p++) at[p] = static_cast<long>(static_cast<double>(M) * p / (P - 0.5));
  at[P] = M;  // the last part half as long as the others: its down sum is the one left waiting
  auto rows = [&](int p) { return at[p + 1] - at[p]; };
  float* h = buffer(hbuf, M * E);
  float* d = buffer(dbuf, M * E);
  for (int p = 0; p < P; p++) {
    product(o.weights, att + at[p] * A, static_cast<int>(rows(p)), h + at[p] * E);
    summed_o[p] = link.start_sum(h + at[p] * E, rows(p) * E);
  }
  for (int p = 0; p < P; p++) {
    link.wait(summed_o[p]);
    add_into(h + at[p] * E, x + at[p] * E, h + at[p] * E, rows(p) * E);  // h = x + o(attention)
    mlp_rows(h + at[p] * E, rows(p), E, norm_w, eps, gate, up, down, d + at[p] * E);
    summed_d[p] = link.start_sum(d + at[p] * E, rows(p) * E);
  }
  for (int p = 0; p < P; p++) {
    link.wait(summed_d[p]);
    add_into(y + at[p] * E, h + at[p] * E, d + at[p] * E, rows(p) * E);  // out = h + down(...)
  }
  release_large(hbuf, dbuf);
}

}  // namespace

void tail_rows(const float* att, const float* x, long M, int E, const float* norm_w, float eps, const Bound& o,
               const Bound& gate, const Bound& up, const Bound& down, float* y, TensorLink* link) {
  if (link && M >= kOverlapRows) return tail_overlapped(att, x, M, E, norm_w, eps, o, gate, up, down, y, *link);
  thread_local Scratch hbuf, dbuf;
  float* h = buffer(hbuf, M * E);
  product(o.weights, att, static_cast<int>(M), h);
  if (link) link->sum(h, M * E);
  add_into(h, x, h, M * E);  // h = x + o(attention)
  float* d = buffer(dbuf, M * E);
  mlp_rows(h, M, E, norm_w, eps, gate, up, down, d);
  if (link) link->sum(d, M * E);
  add_into(y, h, d, M * E);  // out = h + down(...)
  release_large(hbuf, dbuf);
}

std::vector<mx::array> decoder_head(const mx::array& x, const mx::array& norm_weight, float eps,
                                    const std::vector<Projection>& projections, const std::vector<int>& heads,
                                    mx::StreamOrDevice s) {
  check_norm(x, norm_weight);
  if (projections.empty() || projections.size() != heads.size())
    throw std::invalid_argument("[shoal decoder_head] give one head count per projection");
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s), mx::astype(norm_weight, mx::float32, s)};
  std::vector<ProjectionDesc> descs;
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < projections.size(); i++) {
    descs.push_back(describe(projections[i], x.shape(2), "a projection"));
    if (heads[i] <= 0 || descs.back().spec.N % heads[i])
      throw std::invalid_argument("[shoal decoder_head] a projection's outputs do not split into its heads");
    push(projections[i], inputs, s);
    shapes.push_back({x.shape(0), heads[i], x.shape(1), descs.back().spec.N / heads[i]});
  }
  auto primitive = std::make_shared<DecoderHead>(mx::to_stream(s), eps, std::move(descs), heads);
  return mx::array::make_arrays(std::move(shapes), std::vector<mx::Dtype>(heads.size(), mx::float32), primitive,
                                inputs);
}

void DecoderHead::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  std::vector<mx::array> in, out;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  for (const auto& a : outputs) out.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([in = std::move(in), out = std::move(out), descs = projections_, heads = heads_, eps = eps_]() mutable {
    thread_local std::vector<float> xcopy, wcopy;
    thread_local Scratch tmp;
    const mx::array& x = in[0];
    const int B = x.shape(0), L = x.shape(1), E = x.shape(2), M = B * L;
    size_t at = 2;
    std::vector<Bound> bound;
    long total = 0;  // columns of all projections: with several tokens they go to tmp first
    for (const auto& d : descs) bound.push_back(bound_at(d, in, at)), total += d.spec.N;
    float* staged = L == 1 ? nullptr : buffer(tmp, static_cast<long>(M) * total);
    std::vector<float*> ys;  // one token: [B, N] is [B, H, 1, D], written in place
    for (size_t i = 0; i < descs.size(); i++) {
      ys.push_back(L == 1 ? out[i].data<float>() : staged);
      if (L > 1) staged += static_cast<long>(M) * descs[i].spec.N;
    }
    head_rows(row_major(x, xcopy), M, E, weight_row(in[1], wcopy), eps, bound, ys);
    for (size_t i = 0; L > 1 && i < descs.size(); i++) {
      const int N = descs[i].spec.N, H = heads[i], D = N / H;
      float* y = out[i].data<float>();
      for (int b = 0; b < B; b++)  // [B, L, H, D] -> [B, H, L, D]
        for (int l = 0; l < L; l++)
          for (int h = 0; h < H; h++)
            std::copy_n(ys[i] + ((static_cast<long>(b) * L + l) * N + h * D), D,
                        y + ((static_cast<long>(b) * H + h) * L + l) * D);
    }
    release_large(xcopy, tmp);
  });
}

std::vector<mx::Shape> DecoderHead::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < heads_.size(); i++)
    shapes.push_back({inputs[0].shape(0), heads_[i], inputs[0].shape(1), projections_[i].spec.N / heads_[i]});
  return shapes;
}

mx::array decoder_tail(const mx::array& attention, const mx::array& x, const Projection& o,
                       const mx::array& norm_weight, float eps, const Projection& gate, const Projection& up,
                       const Projection& down, std::shared_ptr<TensorLink> link, mx::StreamOrDevice s) {
  check_norm(x, norm_weight);
  if (attention.ndim() != 3 || attention.shape(0) != x.shape(0) || attention.shape(1) != x.shape(1))
    throw std::invalid_argument("[shoal decoder_tail] attention must be [B, L, A] with x's B and L");
  const int E = x.shape(2);
  std::vector<ProjectionDesc> descs{describe(o, attention.shape(2), "o"), describe(gate, E, "gate"),
                                    describe(up, E, "up")};
  descs.push_back(describe(down, descs[1].spec.N, "down"));
  if (descs[0].spec.N != E || descs[2].spec.N != descs[1].spec.N || descs[3].spec.N != E)
    throw std::invalid_argument("[shoal decoder_tail] o, gate, up and down do not chain");
  for (const auto& d : descs)
    if (d.bias) throw std::invalid_argument("[shoal decoder_tail] projections with a bias are not fused");
  std::vector<mx::array> inputs{mx::astype(attention, mx::float32, s), mx::astype(x, mx::float32, s),
                                mx::astype(norm_weight, mx::float32, s)};
  for (const Projection* p : {&o, &gate, &up, &down}) push(*p, inputs, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<DecoderTail>(mx::to_stream(s), eps, std::move(descs), std::move(link)),
                   std::move(inputs));
}

void DecoderTail::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& result = outputs[0];
  result.set_data(mx::allocator::malloc(result.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(result);
  std::vector<mx::array> in;
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([in = std::move(in), y = result.data<float>(), descs = projections_, eps = eps_, link = link_]() {
    thread_local std::vector<float> acopy, xcopy, wcopy;
    const mx::array& x = in[1];
    size_t at = 3;
    const Bound o = bound_at(descs[0], in, at), gate = bound_at(descs[1], in, at);
    const Bound up = bound_at(descs[2], in, at), down = bound_at(descs[3], in, at);
    tail_rows(row_major(in[0], acopy), row_major(x, xcopy), static_cast<long>(x.shape(0)) * x.shape(1), x.shape(2),
              weight_row(in[2], wcopy), eps, o, gate, up, down, y, link.get());
    release_large(acopy, xcopy);
  });
}

void DecoderHead::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { no_gpu(name()); }
void DecoderTail::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) { no_gpu(name()); }

namespace {
bool same_specs(const std::vector<ProjectionDesc>& a, const std::vector<ProjectionDesc>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++)
    if (a[i].spec.format != b[i].spec.format || a[i].spec.group_size != b[i].spec.group_size ||
        a[i].spec.N != b[i].spec.N || a[i].spec.K != b[i].spec.K || a[i].scales != b[i].scales ||
        a[i].biases != b[i].biases || a[i].bias != b[i].bias)
      return false;
  return true;
}
}  // namespace

bool DecoderHead::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecoderHead&>(other);
  return eps_ == o.eps_ && heads_ == o.heads_ && same_specs(projections_, o.projections_);
}

bool DecoderTail::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecoderTail&>(other);
  return eps_ == o.eps_ && same_specs(projections_, o.projections_) && link_ == o.link_;
}

}  // namespace shoal
