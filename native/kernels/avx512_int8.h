// What avx512.cpp's register_body needs beyond its int16 form, and the int8 `prepare`s: included
// by avx512.cpp and gemm_avx512.cpp (built with AVX-512 VNNI flags), in the anonymous namespace as
// avx2_util.h is.
//
// On int8 activations (kernels.h, Acts) a 64-byte step of a weight row is multiplied by `vpdpbusd`
// (unsigned weight byte x signed int8 x, 4 products summed a lane, 64 an instruction): 4-bit rows
// as their low nibbles against a span's even x and their high ones against its odd x (4 chunks a
// step, lanes 4i .. 4i + 3 chunk i), 8-bit rows byte for byte against x in its own order (2 chunks
// a step, lanes 8i .. 8i + 7 chunk i): the same lanes as the int16 steps', so the same scales.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "avx2_util.h"
#include "kernels.h"

namespace shoal {
namespace {  // NOLINT(google-build-namespaces): see avx2_util.h

// The bytes of a 4-bit span's low and high nibbles (FP4: MXFP4 codes as kE2M1x2 + kFp4Offset).
template <bool FP4, typename V>
inline void int8_nibbles(V v, V* lo, V* hi) {
  alignas(16) static constexpr int8_t kOffset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  static_assert(kOffset[7] == kE2M1x2[7] + kFp4Offset && kOffset[15] == kE2M1x2[15] + kFp4Offset);
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kOffset));
  if constexpr (sizeof(V) == 64) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(v, mask), *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    if constexpr (FP4) {
      const __m512i lut = _mm512_broadcast_i32x4(table);
      *lo = _mm512_shuffle_epi8(lut, *lo), *hi = _mm512_shuffle_epi8(lut, *hi);
    }
  } else if constexpr (sizeof(V) == 32) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, mask), *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    if constexpr (FP4) {
      const __m256i lut = _mm256_broadcastsi128_si256(table);
      *lo = _mm256_shuffle_epi8(lut, *lo), *hi = _mm256_shuffle_epi8(lut, *hi);
    }
  } else {
    const __m128i mask = _mm_set1_epi8(0x0f);
    *lo = _mm_and_si128(v, mask), *hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    if constexpr (FP4) *lo = _mm_shuffle_epi8(table, *lo), *hi = _mm_shuffle_epi8(table, *hi);
  }
}

// The int32 sums a product of chunk c on starts from: MXFP4, the x's offset sums; else zero.
template <bool FP4, typename V>
inline V int8_start(const int8_t* x, int K, int c) {
  if constexpr (!FP4) return V{};
  const void* at = reinterpret_cast<const int32_t*>(x + K) + c * 4;
  if constexpr (sizeof(V) == 64) return _mm512_loadu_si512(at);
  if constexpr (sizeof(V) == 32) return _mm256_loadu_si256(static_cast<const __m256i*>(at));
  if constexpr (sizeof(V) == 16) return _mm_loadu_si128(static_cast<const __m128i*>(at));
}

// The products of a span of weight bytes (V: 64, 32 or 16 of them) from chunk c with one row of x.
template <int BITS, bool FP4, typename V>
inline V int8_span(V v, const int8_t* xm, int K, int c) {
  const int8_t* x = xm + c * 32;
  const V start = int8_start<FP4, V>(xm, K, c);
  if constexpr (sizeof(V) == 64) {
    if constexpr (BITS == 8) return _mm512_dpbusd_epi32(start, v, _mm512_loadu_si512(x));
    V lo, hi;
    int8_nibbles<FP4>(v, &lo, &hi);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, _mm512_loadu_si512(x)), hi, _mm512_loadu_si512(x + 64));
  } else if constexpr (sizeof(V) == 32) {
    const __m256i* x8 = reinterpret_cast<const __m256i*>(x);
    if constexpr (BITS == 8) return _mm256_dpbusd_epi32(start, v, _mm256_loadu_si256(x8));
    V lo, hi;
    int8_nibbles<FP4>(v, &lo, &hi);
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(start, lo, _mm256_loadu_si256(x8)), hi, _mm256_loadu_si256(x8 + 1));
  } else {
    const __m128i* x8 = reinterpret_cast<const __m128i*>(x);
    V lo, hi;
    int8_nibbles<FP4>(v, &lo, &hi);
    return _mm_dpbusd_epi32(_mm_dpbusd_epi32(start, lo, _mm_loadu_si128(x8)), hi, _mm_loadu_si128(x8 + 1));
  }
}

// 16 scales (or biases) from element i as floats, 0 in the lanes `mask` leaves out.
inline __m512 scales16(const void* p, ScaleType t, long i, __mmask16 mask) {
  switch (t) {
    case ScaleType::F32:
      return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
    case ScaleType::F16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
    case ScaleType::BF16: {
      const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case ScaleType::E8M0: {  // as scales8: 2^(e - 128), e = 0 at the floor
      const __m128i e = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(p) + i);
      const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(e), 23));
      return _mm512_maskz_max_ps(mask, _mm512_mul_ps(f, _mm512_set1_ps(0.5f)), _mm512_set1_ps(0x1p-128f));
    }
  }
  return _mm512_setzero_ps();
}

// Lane l of step j of a run of 16 groups of 2^g chunks each: the group its chunk is in, for steps
// of 4 chunks (4-bit: chunk 4j + l / 4 of the run) and of 2 (8-bit: 2j + l / 8).
struct StepGroups {
  alignas(64) int32_t at[2][3][32][16];
  constexpr StepGroups() : at{} {
    for (int b = 0; b < 2; b++)
      for (int g = 0; g < 3; g++)
        for (int j = 0; j < 32; j++)
          for (int l = 0; l < 16; l++) at[b][g][j][l] = ((b ? 2 * j + l / 8 : 4 * j + l / 4) >> g) & 15;
  }
};
constexpr StepGroups kStepGroups;

// One group of gs values of x rounded to int8 (amax / 127 a step) into out, lane i of every 16
// from lane order[i]: its step, and the sum of the rounded values times it.
inline void int8_group(const float* xg, int gs, __m512i order, int8_t* out, float* scale, float* sum) {
  __m512 vmax = _mm512_setzero_ps();
  for (int i = 0; i < gs; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m512i total = _mm512_setzero_si512();
  for (int i = 0; i < gs; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
    total = _mm512_add_epi32(total, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, q)));
  }
  *scale = amax / 127.0f;
  *sum = static_cast<float>(_mm512_reduce_add_epi32(total)) * (amax / 127.0f);
}

inline __m512i lanes_in_order() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// `prepare` for int8 bodies: x rounded to int8 per group (int8_group), xsum the sum of the
// rounded values; 8-bit weights' x in its own order, 4-bit weights' in spans' evens and odds
// (kernels.h, Acts), MXFP4's followed by the sums that cancel kFp4Offset.
inline void int8_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  const int K = w.K, gs = w.group_size, groups = K / gs, chunks = K / 32;
  const bool spans = quant_bits(w.format) == 4;
  thread_local std::vector<int8_t> natural;
  natural.resize(static_cast<size_t>(K));
  for (int m = 0; m < M; m++) {
    int8_t* qr = reinterpret_cast<int8_t*>(xq + static_cast<long>(m) * K);
    int8_t* to_natural = spans ? natural.data() : qr;
    for (int g = 0; g < groups; g++)
      int8_group(x + static_cast<long>(m) * K + g * gs, gs, lanes_in_order(), to_natural + g * gs,
                 xscale + m * groups + g, xsum + m * groups + g);
    if (!spans) continue;
    int32_t* offsets = reinterpret_cast<int32_t*>(qr + K);  // MXFP4: per lane of 8 values
    int c = 0;  // spans of 4 chunks, then of 2, then 1
    for (int size = 4; size >= 1; size /= 2) {
      for (; c + size <= chunks; c += size) {
        const int8_t* from = natural.data() + c * 32;
        int8_t* to = qr + c * 32;
        for (int e = 0; e < 32 * size; e++) to[(e & 1) * 16 * size + (e >> 1)] = from[e];
        if (w.format != Format::Mxfp4) continue;
        for (int i = 0; i < 4 * size; i++) {
          int sum = 0;
          for (int j = 0; j < 4; j++) sum += to[4 * i + j] + to[16 * size + 4 * i + j];
          offsets[c * 4 + i] = -kFp4Offset * sum;
        }
      }
    }
  }
}

// The int8 gemm's `prepare` (gemm_avx512.cpp's byte panels): as int8_prepare's rounding, each
// row's K bytes at the start of its place, 4-bit weights' x per 8 as evens, then odds.
inline void gemm8_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  const int K = w.K, gs = w.group_size, groups = K / gs;
  const __m512i order = quant_bits(w.format) == 4
                            ? _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0)
                            : lanes_in_order();
  for (int m = 0; m < M; m++) {
    int8_t* qr = reinterpret_cast<int8_t*>(xq + static_cast<long>(m) * K);
    for (int g = 0; g < groups; g++)
      int8_group(x + static_cast<long>(m) * K + g * gs, gs, order, qr + g * gs, xscale + m * groups + g,
                 xsum + m * groups + g);
  }
}

}  // namespace
}  // namespace shoal
