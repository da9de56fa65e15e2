// The portable kernels: plain C++ for every CPU (aarch64, x86 without AVX2), and the helpers the
// vector kernels share. They compute in float32 straight from x, so they double as a readable
// statement of what each layout means.
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace shoal {

namespace {

float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float scale_at(const void* p, ScaleType t, long i) {
  switch (t) {
    case ScaleType::F32:
      return static_cast<const float*>(p)[i];
    case ScaleType::F16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::BF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::E8M0:
      return e8m0_scale(static_cast<const uint8_t*>(p)[i]);
  }
  return 0.0f;
}

// Weight k of row n as a float.
inline float weight_at(const Weights& w, const uint8_t* row, const float* s, const float* b, int k) {
  switch (w.format) {
    case Format::Affine4: {
      int q = (row[k / 2] >> ((k & 1) * 4)) & 0x0f;
      return s[k / w.group_size] * q + b[k / w.group_size];
    }
    case Format::Affine8:
      return s[k / w.group_size] * row[k] + b[k / w.group_size];
    case Format::Mxfp4:
      return s[k / 32] * kE2M1x2[(row[k / 2] >> ((k & 1) * 4)) & 0x0f];
    case Format::F16:
      return half_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
    case Format::BF16:
      return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
    case Format::F32:
      return reinterpret_cast<const float*>(row)[k];
  }
  return 0.0f;
}


void portable_rows(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  int groups = is_grouped(w.format) ? w.K / w.group_size : 0;
  std::vector<float> s(groups), b(groups);
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    if (groups) row_scales(w, n, s.data(), b.data());
    for (int m = 0; m < a.M; m++) {
      const float* x = a.x + static_cast<long>(m) * w.K;
      float sum = 0.0f;
      for (int k = 0; k < w.K; k++) sum += x[k] * weight_at(w, row, s.data(), b.data(), k);
      y[m * ldy + n] = sum;
    }
  }
}

void portable_dequant(const Weights& w, int n0, int n1, float* out) {
  int groups = is_grouped(w.format) ? w.K / w.group_size : 0;
  std::vector<float> s(groups), b(groups);
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    if (groups) row_scales(w, n, s.data(), b.data());
    float* o = out + static_cast<long>(n - n0) * w.K;
    for (int k = 0; k < w.K; k++) o[k] = weight_at(w, row, s.data(), b.data(), k);
  }
}

}  // namespace

int affine_position(int k, int K, Format format, int step_bytes) {
  const int bits = quant_bits(format), span = step_bytes * 8 / (32 * bits), chunks = K / 32;
  const int chunk = k / 32, full = chunks / span * span;
  int first = chunk / span * span, size = span;  // the span holding k: its first chunk and size
  if (chunk >= full) {  // the rest (fewer than a span) as spans of half a span, a quarter, ..., 1
    first = full;
    for (size = span / 2; size > 1; size /= 2) {
      if (chunks - first < size) continue;  // no such span in the rest
      if (chunk < first + size) break;
      first += size;
    }
  }
  const int e = k - first * 32;
  if (bits == 4) return first * 32 + (e & 3) * 8 * size + (e >> 2);
  return first * 32 + (e & 1) * 16 * size + (e >> 1);
}

void row_scales(const Weights& w, int n, float* scales, float* biases) {
  int groups = w.K / w.group_size;
  long at = static_cast<long>(n) * groups;
  for (int g = 0; g < groups; g++) {
    scales[g] = scale_at(w.scales, w.scale_type, at + g);
    biases[g] = w.biases ? scale_at(w.biases, w.scale_type, at + g) : symmetric_bias(w, scales[g]);
  }
}

void prepare_acts(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  const int K = w.K, gs = w.group_size, groups = K / gs;
  std::vector<int> position(K);
  for (int k = 0; k < K; k++) position[k] = affine_position(k, K, w.format, 32);
  for (int m = 0; m < M; m++) {
    const float* xr = x + static_cast<long>(m) * K;
    int16_t* qr = xq + static_cast<long>(m) * K;
    for (int g = 0; g < groups; g++) {
      const float* xg = xr + g * gs;
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < gs; i++) {
        amax = std::fmax(amax, std::fabs(xg[i]));
        sum += xg[i];
      }
      const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      xscale[m * groups + g] = amax / 32767.0f;
      xsum[m * groups + g] = sum;
      for (int i = 0; i < gs; i++) qr[position[g * gs + i]] = static_cast<int16_t>(std::nearbyint(xg[i] * inv));
    }
  }
}

const Kernels& portable_kernels() {
  static const Kernels kernels{"portable", portable_rows, portable_dequant, prepare_acts};
  return kernels;
}

}  // namespace shoal
