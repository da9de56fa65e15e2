// What the fused operations share (fused.cpp, attention.cpp): reading strided rows, splitting rows
// over the pool, handing a task to MLX's CPU stream, and rope's tables, so the decode-step attention
// ropes exactly as FusedRoPE does.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "fused.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal::fused_detail {

constexpr long kParallelMinWork = 1l << 17;  // multiply-adds: below ~30 us one thread beats waking more

// Element offset of row `row` (a flat index over every axis but the last) of a strided array.
inline long row_offset(const mx::array& a, long row) {
  long at = 0;
  for (int d = static_cast<int>(a.ndim()) - 2; d >= 0; d--) {
    at += (row % a.shape(d)) * static_cast<long>(a.strides()[d]);
    row /= a.shape(d);
  }
  return at;
}

// Row `row` of `a` as D contiguous floats: in place when the last axis is dense, else gathered.
inline const float* row_of(const mx::array& a, long row, std::vector<float>& buffer) {
  const float* p = a.data<float>() + row_offset(a, row);
  const long step = a.ndim() ? a.strides().back() : 1;
  const int D = a.ndim() ? a.shape(-1) : 1;
  if (step == 1 || D == 1) return p;
  buffer.resize(D);
  for (int j = 0; j < D; j++) buffer[j] = p[j * step];
  return buffer.data();
}

// Every row of `a` (float32, or T, any strides) as one row-major block: itself when it already is one.
template <typename T = float>
const T* dense(const mx::array& a, std::vector<T>& copy) {
  if (a.flags().row_contiguous) return a.data<T>();
  const int D = a.ndim() ? a.shape(-1) : 1;
  const long rows = D ? static_cast<long>(a.size() / D) : 0;
  const long step = a.ndim() ? a.strides().back() : 1;
  copy.resize(a.size());
  for (long r = 0; r < rows; r++) {
    const T* p = a.data<T>() + row_offset(a, r);
    for (int j = 0; j < D; j++) copy[r * D + j] = p[j * step];
  }
  return copy.data();
}

// A KV cache's type, and n values of a row of it as float32 (exact: float16 widens without rounding).
inline KvType kv_type(const mx::array& a) { return a.dtype() == mx::float16 ? KvType::F16 : KvType::F32; }
inline const float* as_floats(const float* x, int, float*) { return x; }
inline const float* as_floats(const mx::float16_t* x, int n, float* out) {
  for (int i = 0; i < n; i++) out[i] = static_cast<float>(x[i]);
  return out;
}
// n float32 values into a row of a KV cache of type t (float16: rounded to nearest even, as MLX's astype).
inline void store_kv(const float* x, int n, void* out, KvType t) {
  if (t == KvType::F32) {
    std::memcpy(out, x, sizeof(float) * n);
    return;
  }
  auto* h = static_cast<mx::float16_t*>(out);
  for (int i = 0; i < n; i++) h[i] = mx::float16_t(x[i]);
}
inline size_t kv_bytes(KvType t) { return t == KvType::F16 ? 2 : 4; }

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
  pool.run(static_cast<int>((rows + per - 1) / per), [&](int t) { body(t * per, std::min(rows, (t + 1) * per)); });
}

inline void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array> outputs,
                     std::function<void()> fn) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& in : inputs) encoder.set_input_array(in);
  for (auto& out : outputs) encoder.set_output_array(out);
  encoder.dispatch(std::move(fn));
}

inline std::vector<mx::array> weak(const std::vector<mx::array>& inputs) {
  std::vector<mx::array> copies;
  for (const auto& in : inputs) copies.push_back(mx::array::unsafe_weak_copy(in));
  return copies;
}

// Rope's inverse frequencies as MLX's fallback computes them, in float32: from `base`, or
// 1 / freqs (freqs: dims / 2 values `stride` apart) when freqs is given.
inline std::vector<float> rope_inverse_frequencies(int dims, float base, const float* freqs, long stride) {
  const int half = dims / 2;
  std::vector<float> inv(half);
  const float step = static_cast<float>(std::log(base) / half);
  for (int i = 0; i < half; i++) inv[i] = freqs ? 1.0f / freqs[i * stride] : std::exp(static_cast<float>(-i) * step);
  return inv;
}

// cos and sin of one position's angles, [cos x half, sin x half] into t.
inline void rope_angles(const std::vector<float>& inv, float pos, float* t) {
  const int half = static_cast<int>(inv.size());
  for (int i = 0; i < half; i++) t[i] = std::cos(pos * inv[i]), t[half + i] = std::sin(pos * inv[i]);
}

// y = x rotated by the angles t (rope_angles) over its first `dims` features; the rest copied.
inline void rope_row(const float* x, int D, int dims, bool traditional, const float* t, float* y) {
  const int half = dims / 2, partner = traditional ? 1 : half, stride = traditional ? 2 : 1;
  const float* sn = t + half;
  for (int i = 0; i < half; i++) {
    const float a = x[i * stride], e = x[i * stride + partner];
    y[i * stride] = a * t[i] - e * sn[i];
    y[i * stride + partner] = a * sn[i] + e * t[i];
  }
  std::memcpy(y + dims, x + dims, sizeof(float) * (D - dims));
}

// Attention of q [B, Hq, L, D] (row-major) over S keys and values into y [B, Hq, L, Dv]. k and v
// (float32 or float16) rows are dense, `ks`/`vs` their batch, head and position strides. An array mask is read at
// mask[b * ms[0] + h * ms[1] + l * ms[2] + s * ms[3]] (broadcast axes have stride 0); sinks [Hq]
// are `sink_stride` apart. Rows are split over the pool as FusedSDPA always split them.
struct Attention {
  const float* q;
  int B, Hq, L, D;
  const void* k;  // of type kv, as v
  long ks[3];
  const void* v;
  long vs[3];
  int Hkv, S, Dv;
  KvType kv;
  float scale;
  MaskKind kind;
  const void* mask;
  long ms[4];
  const float* sinks;
  long sink_stride;
  float* y;
};
void attend(const Attention& a);

// One decode step's attention on a KV cache (DecodeAttention's arithmetic, and the layer stack's):
// q [B, Hq, D], k [B, Hkv, D], v [B, Hkv, Dv] dense and not yet roped; k (roped) and v are
// written at position p.index of the caches kc / vc (batch, head, position strides kst / vst),
// then attention over positions 0 .. p.index into out [B, Hq * Dv]. `angles` are decode_angles';
// the mask is read when p.mask is an array kind.
struct DecodeStep {
  DecodeAttention::Params p;
  int B, Hq, Hkv, D, Dv;
  const float *q, *k, *v;
  const float* angles;
  void* kc;  // of type kv, as vc
  long kst[3];
  void* vc;
  long vst[3];
  KvType kv;
  const mx::array* mask;
  float* out;
};
// Rope's cos and sin for each sequence's position (rope_angles, [B, p.dims]), as FusedRoPE takes
// them: position offsets[b * offset_stride] (stride 0: one for all), freqs when p.freqs. The same
// for every layer of a step, so the stack computes them once.
std::vector<float> decode_angles(const DecodeAttention::Params& p, int B, const int32_t* offsets, long offset_stride,
                                 const float* freqs, long freq_stride);
// A decode step's rope offset, freqs and mask checked and appended to `inputs` in that order, for
// queries [B, Hq, 1, D] over index + 1 keys; the step's Params. Errors name `op`.
DecodeAttention::Params decode_inputs(const char* op, int B, int Hq, int D, int index, int dims, bool traditional,
                                      std::optional<float> base, float rope_scale,
                                      const std::variant<int, mx::array>& offset, float scale,
                                      const std::optional<mx::array>& freqs, const std::optional<mx::array>& mask,
                                      std::vector<mx::array>& inputs, mx::StreamOrDevice s);
void decode_step(const DecodeStep& s);

}  // namespace shoal::fused_detail
