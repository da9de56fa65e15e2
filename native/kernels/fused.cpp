// The fused rms_norm and rope and their CPU evaluation, and the portable inner loops (attention
// lives in attention.cpp). Each reads its inputs with their strides (mlx-lm hands rope a
// transposed view), writes a row-major float32 output, and splits rows over the pool only when
// there is enough work to pay for it.
#include "fused.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <vector>

#include "fused_util.h"
#include "matmul.h"

namespace shoal {

using namespace fused_detail;

namespace {

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

template <typename T>
void qk_rows(const float* q, int R, const T* k, long ks, int S, int D, float scale, float* scores) {
  std::vector<float> row(D);
  for (int s = 0; s < S; s++) {
    const float* kr = as_floats(k + s * ks, D, row.data());
    for (int r = 0; r < R; r++) scores[static_cast<long>(r) * S + s] = scale * dot(q + r * D, kr, D);
  }
}

void portable_qk(const float* q, int R, const void* k, KvType kt, long ks, int S, int D, float scale,
                 float* scores) {
  if (kt == KvType::F16) return qk_rows(q, R, static_cast<const mx::float16_t*>(k), ks, S, D, scale, scores);
  qk_rows(q, R, static_cast<const float*>(k), ks, S, D, scale, scores);
}

template <typename T>
void pv_rows(const float* p, int R, const T* v, long vs, int S, int Dv, float* out) {
  std::fill(out, out + static_cast<long>(R) * Dv, 0.0f);
  std::vector<float> row(Dv);
  for (int s = 0; s < S; s++) {
    const float* vr = nullptr;
    for (int r = 0; r < R; r++) {
      const float w = p[static_cast<long>(r) * S + s];
      if (w == 0.0f) continue;  // masked keys (causal prefill) cost nothing
      if (!vr) vr = as_floats(v + s * vs, Dv, row.data());
      float* o = out + static_cast<long>(r) * Dv;
      for (int d = 0; d < Dv; d++) o[d] += w * vr[d];
    }
  }
}

void portable_pv(const float* p, int R, const void* v, KvType vt, long vs, int S, int Dv, float* out) {
  if (vt == KvType::F16) return pv_rows(p, R, static_cast<const mx::float16_t*>(v), vs, S, Dv, out);
  pv_rows(p, R, static_cast<const float*>(v), vs, S, Dv, out);
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
                                    portable_silu, portable_logsumexp};
  return kernels;
}

const FusedKernels& active_fused() {
  static const FusedKernels* chosen =
      std::strcmp(active_kernels().name, "portable") != 0 && avx2_fused() ? avx2_fused() : &portable_fused();
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
  dispatch(stream(), inputs, {out}, [in = weak(inputs), y = out.data<float>(), eps = eps_]() {
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
  dispatch(stream(), inputs, {out},
           [in = weak(inputs), y = out.data<float>(), dims = dims_, trad = traditional_, base = base_,
            scale = scale_]() {
             const mx::array& x = in[0];
             const mx::array& off = in[1];
             const int D = x.shape(-1), L = x.shape(-2), half = dims / 2;
             if (x.size() == 0) return;
             const long rows = static_cast<long>(x.size() / D);
             const long per_batch = rows / L / x.shape(0);  // rows of x.shape(0) index b / per_batch
             const std::vector<float> inv = rope_inverse_frequencies(
                 dims, base, in.size() > 2 ? in[2].data<float>() : nullptr, in.size() > 2 ? in[2].strides()[0] : 0);
             // One cos/sin table per distinct offset: every head of a position shares it.
             const int offsets = static_cast<int>(off.size());
             std::vector<float> table(static_cast<size_t>(offsets) * L * half * 2);
             for (int b = 0; b < offsets; b++) {
               const int o = off.data<int32_t>()[off.ndim() ? b * off.strides()[0] : 0];
               for (int l = 0; l < L; l++)
                 rope_angles(inv, (static_cast<float>(l) + static_cast<float>(o)) * scale,
                             table.data() + (static_cast<size_t>(b) * L + l) * half * 2);
             }
             split_rows(rows, D, [&](long r0, long r1) {
               std::vector<float> buffer;
               for (long r = r0; r < r1; r++) {
                 const long b = offsets == 1 ? 0 : r / L / per_batch;
                 rope_row(row_of(x, r, buffer), D, dims, trad,
                          table.data() + (static_cast<size_t>(b) * L + r % L) * half * 2, y + r * D);
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

}  // namespace shoal
