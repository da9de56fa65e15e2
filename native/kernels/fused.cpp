// The fused operations and their CPU evaluation. Each reads its inputs with their strides (mlx-lm
// hands rope a transposed view and sdpa slices of a preallocated KV cache), writes a row-major
// float32 output, and splits rows over the pool only when there is enough work to pay for it.
#include "fused.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <vector>

#include "matmul.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal {

namespace {

constexpr long kParallelMinWork = 1l << 17;  // multiply-adds: below ~30 us one thread beats waking more
constexpr int kMaxChunkRows = 32;             // query rows per sdpa task: scores stay 32 x S floats

// Element offset of row `row` (a flat index over every axis but the last) of a strided array.
long row_offset(const mx::array& a, long row) {
  long at = 0;
  for (int d = static_cast<int>(a.ndim()) - 2; d >= 0; d--) {
    at += (row % a.shape(d)) * static_cast<long>(a.strides()[d]);
    row /= a.shape(d);
  }
  return at;
}

// Row `row` of `a` as D contiguous floats: in place when the last axis is dense, else gathered.
const float* row_of(const mx::array& a, long row, std::vector<float>& buffer) {
  const float* p = a.data<float>() + row_offset(a, row);
  const long step = a.ndim() ? a.strides().back() : 1;
  const int D = a.ndim() ? a.shape(-1) : 1;
  if (step == 1 || D == 1) return p;
  buffer.resize(D);
  for (int j = 0; j < D; j++) buffer[j] = p[j * step];
  return buffer.data();
}

// k or v with a dense last axis: itself, or a row-major copy (rare: a transposed cache).
const float* dense_rows(const mx::array& a, std::vector<float>& copy, long st[3]) {
  if (a.strides()[3] == 1 || a.shape(3) == 1) {
    for (int d = 0; d < 3; d++) st[d] = a.strides()[d];
    return a.data<float>();
  }
  copy.resize(a.size());
  const long rows = static_cast<long>(a.size() / a.shape(3));
  std::vector<float> buffer;
  for (long r = 0; r < rows; r++) std::memcpy(copy.data() + r * a.shape(3), row_of(a, r, buffer), 4 * a.shape(3));
  st[2] = a.shape(3), st[1] = st[2] * a.shape(2), st[0] = st[1] * a.shape(1);
  return copy.data();
}

// Run body(r0, r1) over [0, rows) on the pool when the work is worth it, else on this thread.
template <typename Body>
void split_rows(long rows, long work_per_row, const Body& body) {
  Pool& pool = Pool::instance();
  if (pool.threads() == 1 || rows < 2 || rows * work_per_row < kParallelMinWork) {
    body(0, rows);
    return;
  }
  const long tasks = std::min<long>(rows, 4l * pool.threads());
  const long per = (rows + tasks - 1) / tasks;
  pool.run(static_cast<int>((rows + per - 1) / per),
           [&](int t) { body(t * per, std::min(rows, (t + 1) * per)); });
}

void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out,
              std::function<void()> fn) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch(std::move(fn));
}

std::vector<mx::array> weak(const std::vector<mx::array>& inputs) {
  std::vector<mx::array> copies;
  for (const auto& in : inputs) copies.push_back(mx::array::unsafe_weak_copy(in));
  return copies;
}

// Portable loops: eight partial sums so that -O3 vectorizes without reassociating.
float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
  float t = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; i++) t += a[i] * b[i];
  return t;
}

void portable_qk(const float* q, int R, const float* k, long ks, int S, int D, float scale, float* scores) {
  for (int s = 0; s < S; s++)
    for (int r = 0; r < R; r++) scores[static_cast<long>(r) * S + s] = scale * dot(q + r * D, k + s * ks, D);
}

void portable_pv(const float* p, int R, const float* v, long vs, int S, int Dv, float* out) {
  std::fill(out, out + static_cast<long>(R) * Dv, 0.0f);
  for (int s = 0; s < S; s++) {
    const float* vr = v + s * vs;
    for (int r = 0; r < R; r++) {
      const float w = p[static_cast<long>(r) * S + s];
      if (w == 0.0f) continue;  // masked keys (causal prefill) cost nothing
      float* o = out + static_cast<long>(r) * Dv;
      for (int d = 0; d < Dv; d++) o[d] += w * vr[d];
    }
  }
}

float portable_sumsq(const float* x, int n) { return dot(x, x, n); }

void portable_softmax(float* x, int n, float sink) {
  float top = sink;
  for (int j = 0; j < n; j++) top = std::max(top, x[j]);
  float sum = std::exp(sink - top);
  for (int j = 0; j < n; j++) sum += (x[j] = std::exp(x[j] - top));
  const float norm = 1.0f / sum;
  for (int j = 0; j < n; j++) x[j] *= norm;
}

}  // namespace

const FusedKernels& portable_fused() {
  static const FusedKernels kernels{"portable", portable_qk, portable_pv, portable_sumsq, portable_softmax,
                                    portable_silu};
  return kernels;
}

const FusedKernels& active_fused() {
  static const FusedKernels* chosen =
      std::strcmp(active_kernels().name, "avx2") == 0 && avx2_fused() ? avx2_fused() : &portable_fused();
  return *chosen;
}

// ---- rms_norm ----

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1) throw std::invalid_argument("[shoal rms_norm] x must have at least one dimension");
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s)};
  if (weight) {
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1))
      throw std::invalid_argument("[shoal rms_norm] weight must be 1-D with x's last dimension");
    inputs.push_back(mx::astype(*weight, mx::float32, s));
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedRMSNorm>(mx::to_stream(s), eps), std::move(inputs));
}

void FusedRMSNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  dispatch(stream(), inputs, out, [in = weak(inputs), y = out.data<float>(), eps = eps_]() {
    const mx::array& x = in[0];
    const int D = x.shape(-1);
    if (D == 0) return;
    const long rows = static_cast<long>(x.size() / D);
    std::vector<float> w;
    if (in.size() > 1) {
      w.resize(D);
      for (int j = 0; j < D; j++) w[j] = in[1].data<float>()[j * in[1].strides()[0]];
    }
    const FusedKernels& k = active_fused();
    split_rows(rows, D, [&](long r0, long r1) {
      std::vector<float> buffer;
      for (long r = r0; r < r1; r++) {
        const float* xr = row_of(x, r, buffer);
        float* yr = y + r * D;
        // As MLX: x * rsqrt(mean(x^2) + eps), then times the weight.
        const float inv = 1.0f / std::sqrt(k.sumsq(xr, D) / static_cast<float>(D) + eps);
        if (w.empty()) {
          for (int j = 0; j < D; j++) yr[j] = xr[j] * inv;
        } else {
          for (int j = 0; j < D; j++) yr[j] = (xr[j] * inv) * w[j];
        }
      }
    });
  });
}

bool FusedRMSNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const FusedRMSNorm&>(other).eps_;
}

std::vector<mx::Shape> FusedRMSNorm::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

// ---- rope ----

mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
               const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s) {
  if (x.ndim() < 3) throw std::invalid_argument("[shoal rope] x must have at least 3 dimensions");
  if (dims <= 0 || dims % 2 || dims > x.shape(-1))
    throw std::invalid_argument("[shoal rope] dims must be even and at most x's last dimension");
  if (freqs.has_value() == base.has_value())
    throw std::invalid_argument("[shoal rope] exactly one of base and freqs must be given");
  mx::array off = std::holds_alternative<int>(offset) ? mx::array(std::get<int>(offset), mx::int32)
                                                       : mx::astype(std::get<mx::array>(offset), mx::int32, s);
  if (off.ndim() > 1 || (off.size() != 1 && off.size() != static_cast<size_t>(x.shape(0))))
    throw std::invalid_argument("[shoal rope] offset must be a scalar or one per x.shape(0)");
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s), off};
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      throw std::invalid_argument("[shoal rope] freqs must be 1-D with dims / 2 values");
    inputs.push_back(mx::astype(*freqs, mx::float32, s));
  }
  auto primitive = std::make_shared<FusedRoPE>(mx::to_stream(s), dims, traditional, base.value_or(0.0f), scale);
  return mx::array(x.shape(), mx::float32, primitive, std::move(inputs));
}

void FusedRoPE::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  dispatch(stream(), inputs, out,
           [in = weak(inputs), y = out.data<float>(), dims = dims_, trad = traditional_, base = base_,
            scale = scale_]() {
             const mx::array& x = in[0];
             const mx::array& off = in[1];
             const int D = x.shape(-1), L = x.shape(-2), half = dims / 2;
             if (x.size() == 0) return;
             const long rows = static_cast<long>(x.size() / D);
             const long per_batch = rows / L / x.shape(0);  // rows of x.shape(0) index b / per_batch
             // Inverse frequencies and positions as MLX's fallback computes them, in float32.
             std::vector<float> inv(half);
             const float step = static_cast<float>(std::log(base) / half);
             for (int i = 0; i < half; i++)
               inv[i] = in.size() > 2 ? 1.0f / in[2].data<float>()[i * in[2].strides()[0]]
                                      : std::exp(static_cast<float>(-i) * step);
             // One cos/sin table per distinct offset: every head of a position shares it.
             const int offsets = static_cast<int>(off.size());
             std::vector<float> table(static_cast<size_t>(offsets) * L * half * 2);
             for (int b = 0; b < offsets; b++) {
               const int o = off.data<int32_t>()[off.ndim() ? b * off.strides()[0] : 0];
               for (int l = 0; l < L; l++) {
                 const float pos = (static_cast<float>(l) + static_cast<float>(o)) * scale;
                 float* t = table.data() + (static_cast<size_t>(b) * L + l) * half * 2;
                 for (int i = 0; i < half; i++) t[i] = std::cos(pos * inv[i]), t[half + i] = std::sin(pos * inv[i]);
               }
             }
             split_rows(rows, D, [&](long r0, long r1) {
               std::vector<float> buffer;
               for (long r = r0; r < r1; r++) {
                 const float* xr = row_of(x, r, buffer);
                 float* yr = y + r * D;
                 const long b = offsets == 1 ? 0 : r / L / per_batch;
                 const float* c = table.data() + (static_cast<size_t>(b) * L + r % L) * half * 2;
                 const float* sn = c + half;
                 const int i1 = trad ? 1 : half, stride = trad ? 2 : 1;  // partner of feature i
                 for (int i = 0; i < half; i++) {
                   const float a = xr[i * stride], e = xr[i * stride + i1];
                   yr[i * stride] = a * c[i] - e * sn[i];
                   yr[i * stride + i1] = a * sn[i] + e * c[i];
                 }
                 std::memcpy(yr + dims, xr + dims, sizeof(float) * (D - dims));
               }
             });
           });
}

bool FusedRoPE::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedRoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
}

std::vector<mx::Shape> FusedRoPE::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

// ---- scaled dot-product attention ----

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
               const std::optional<std::variant<std::string, mx::array>>& mask,
               const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("[shoal sdpa] q, k and v must be 4-D");
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Hkv = k.shape(1), S = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S || k.shape(3) != q.shape(3) ||
      Hkv == 0 || Hq % Hkv)
    throw std::invalid_argument("[shoal sdpa] q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], Hkv | Hq");
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s), mx::astype(k, mx::float32, s),
                                mx::astype(v, mx::float32, s)};
  MaskKind kind = MaskKind::None;
  if (mask && std::holds_alternative<std::string>(*mask)) {
    if (std::get<std::string>(*mask) != "causal") throw std::invalid_argument("[shoal sdpa] mask must be 'causal'");
    kind = MaskKind::Causal;
  } else if (mask) {
    const mx::array& m = std::get<mx::array>(*mask);
    if (m.ndim() > 4) throw std::invalid_argument("[shoal sdpa] an array mask has at most 4 dimensions");
    kind = m.dtype() == mx::bool_ ? MaskKind::Boolean : MaskKind::Additive;
    mx::array typed = kind == MaskKind::Boolean ? m : mx::astype(m, mx::float32, s);
    inputs.push_back(mx::broadcast_to(typed, {B, Hq, L, S}, s));
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != Hq) throw std::invalid_argument("[shoal sdpa] sinks must be [Hq]");
    inputs.push_back(mx::astype(*sinks, mx::float32, s));
  }
  auto primitive = std::make_shared<FusedSDPA>(mx::to_stream(s), scale, kind, sinks.has_value());
  return mx::array({B, Hq, L, v.shape(3)}, mx::float32, primitive, std::move(inputs));
}

void FusedSDPA::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  dispatch(stream(), inputs, out, [in = weak(inputs), y = out.data<float>(), scale = scale_, kind = mask_,
                                   has_sinks = sinks_]() {
    const mx::array& q = in[0];
    const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
    const int Hkv = in[1].shape(1), S = in[1].shape(2), Dv = in[2].shape(3), G = Hq / Hkv;
    if (static_cast<long>(B) * Hq * L * Dv == 0) return;
    std::vector<float> kcopy, vcopy;
    long ks[3], vs[3];
    const float* kd = dense_rows(in[1], kcopy, ks);
    const float* vd = dense_rows(in[2], vcopy, vs);
    const bool array_mask = kind == MaskKind::Additive || kind == MaskKind::Boolean;
    const mx::array* m = array_mask ? &in[3] : nullptr;
    const float* sinks = has_sinks ? in.back().data<float>() : nullptr;
    const long sink_stride = has_sinks ? in.back().strides()[0] : 0;
    const int q_off = std::max(0, S - L);  // causal: query l sees keys <= q_off + l (lower right)
    // Tasks: (batch, kv head, chunk of its G * L query rows), so each task reads its K/V once.
    Pool& pool = Pool::instance();
    const int per_head = G * L;
    const long work = static_cast<long>(B) * Hq * L * S * (D + Dv);
    const bool parallel = pool.threads() > 1 && work >= kParallelMinWork;
    int chunk = std::min(per_head, kMaxChunkRows);
    if (parallel) {
      const int want = 2 * pool.threads();  // a preempted thread then delays little
      const int splits = std::max(1, (want + B * Hkv - 1) / (B * Hkv));
      chunk = std::max(1, std::min(chunk, (per_head + splits - 1) / splits));
    }
    const int chunks = (per_head + chunk - 1) / chunk;
    const FusedKernels& fk = active_fused();
    auto task = [&](int t) {
      const int b = t / (Hkv * chunks), hk = t / chunks % Hkv, r0 = t % chunks * chunk;
      const int R = std::min(chunk, per_head - r0);
      thread_local std::vector<float> qbuf, scores, obuf, buffer;
      qbuf.resize(static_cast<size_t>(R) * D);
      int limit = kind == MaskKind::Causal ? 0 : S;  // keys past every row's causal limit: never read
      for (int r = 0; r < R; r++) {
        const int g = (r0 + r) / L, l = (r0 + r) % L;
        std::memcpy(qbuf.data() + static_cast<long>(r) * D,
                    row_of(q, (static_cast<long>(b) * Hq + hk * G + g) * L + l, buffer), 4 * D);
        if (kind == MaskKind::Causal) limit = std::max(limit, std::min(S, q_off + l + 1));
      }
      scores.resize(static_cast<size_t>(R) * limit);
      obuf.resize(static_cast<size_t>(R) * Dv);
      fk.qk(qbuf.data(), R, kd + b * ks[0] + hk * ks[1], ks[2], limit, D, scale, scores.data());
      for (int r = 0; r < R; r++) {
        const int h = hk * G + (r0 + r) / L, l = (r0 + r) % L;
        float* sc = scores.data() + static_cast<long>(r) * limit;
        const int last = kind == MaskKind::Causal ? std::min(limit, q_off + l + 1) : limit;
        constexpr float kNegInf = -std::numeric_limits<float>::infinity();
        for (int j = last; j < limit; j++) sc[j] = kNegInf;
        if (m) {
          const long at = b * m->strides()[0] + h * m->strides()[1] + l * m->strides()[2];
          const long step = m->strides()[3];
          if (kind == MaskKind::Boolean) {
            const bool* mb = m->data<bool>() + at;
            for (int j = 0; j < limit; j++) sc[j] = mb[j * step] ? sc[j] : kNegInf;
          } else {
            const float* mf = m->data<float>() + at;
            for (int j = 0; j < limit; j++) sc[j] += mf[j * step];
          }
        }
        // Softmax in float32 with the maximum subtracted; a sink adds a logit to the denominator.
        fk.softmax(sc, limit, sinks ? sinks[h * sink_stride] : kNegInf);
      }
      fk.pv(scores.data(), R, vd + b * vs[0] + hk * vs[1], vs[2], limit, Dv, obuf.data());
      for (int r = 0; r < R; r++) {
        const int h = hk * G + (r0 + r) / L, l = (r0 + r) % L;
        std::memcpy(y + ((static_cast<long>(b) * Hq + h) * L + l) * Dv, obuf.data() + static_cast<long>(r) * Dv,
                    4 * Dv);
      }
    };
    const int tasks = B * Hkv * chunks;
    if (parallel) {
      pool.run(tasks, task);
    } else {
      for (int t = 0; t < tasks; t++) task(t);
    }
  });
}

bool FusedSDPA::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedSDPA&>(other);
  return scale_ == o.scale_ && mask_ == o.mask_ && sinks_ == o.sinks_;
}

std::vector<mx::Shape> FusedSDPA::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), inputs[0].shape(2), inputs[2].shape(3)}};
}

}  // namespace shoal
