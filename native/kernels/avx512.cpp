// AVX-512 (F, BW, VL) + VNNI kernels. This file alone is compiled with those flags; the library
// prefers them to the AVX2 ones only when the CPU has them all (__builtin_cpu_supports at run time).
//
// avx2.cpp's scheme at twice the width: a step reads one 64-byte line of a weight row (4-bit: 4
// chunks of 32 weights; 8-bit: 2) as 32 lanes of 16 bits, takes its values apart with shifts and
// masks, and multiplies them with the int16 activations by `vpdpwssd`, which multiplies, adds
// pairs and accumulates in one instruction (32 products). A row's tail (fewer chunks than a step),
// its prologue and the rows loop are avx2.cpp's (avx2_util.h); so is the dequantization of
// 16-bit weights for sgemm in prefill (quantized ones go to gemm_avx512.cpp). As there, each
// output element is computed the same way whatever the number of rows, so a sequence gives the
// same bits alone or in a batch.
//
// This file is built twice: as the "avx512" kernels, and with VBMI as "avx512vbmi", whose 4-bit
// steps take the nibbles apart with `vpmultishiftqb` (port 5 on Intel) instead of three shifts
// (port 0, which the VNNI products need too): a 1B shape's products at M = 1 in 0.90-0.96x the
// time, at M = 4 0.83-0.95x (bench/kernel_ab.py), with the same values, so the same bits.
#include "kernels.h"

#if defined(SHOAL_AVX512_VBMI)
#define SHOAL_AVX512_KERNELS avx512vbmi_kernels
#define SHOAL_AVX512_NAME "avx512vbmi"
#else
#define SHOAL_AVX512_KERNELS avx512_kernels
#define SHOAL_AVX512_NAME "avx512"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)

#include "avx2_util.h"

namespace shoal {
namespace {

constexpr int kStep = 64;  // bytes of a weight row per step: one cache line

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

// Nibble j of every 16-bit lane of v, as the lane's value (j = 1, 2, 3; nibble 0 is v & 0x0f).
template <int J>
inline __m512i nibble(__m512i v, __m512i mask) {
#if defined(__AVX512VBMI__)
  // Byte 2i of each qword's lane i takes bits 16i + 4J .. 16i + 4J + 7 (then masked); byte 2i + 1
  // anything, as the mask clears it.
  constexpr long long kAt = 0x0101010101010101ll * (4 * J) + 0x3030202010100000ll;
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(kAt), v), mask);
#else
  return J == 3 ? _mm512_srli_epi16(v, 12) : _mm512_and_si512(_mm512_srli_epi16(v, 4 * J), mask);
#endif
}

// avx2_util.h's fp4_nibbles at this width.
inline void fp4_nibbles(__m512i v, __m512i* q) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
  const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, mask));
  const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  q[0] = _mm512_srai_epi16(_mm512_slli_epi16(lo, 8), 8), q[1] = _mm512_srai_epi16(_mm512_slli_epi16(hi, 8), 8);
  q[2] = _mm512_srai_epi16(lo, 8), q[3] = _mm512_srai_epi16(hi, 8);
}

// Scales of the chunks of one step as the lanes of its int32 sums: 4-bit, chunk c + i in lanes
// 4i .. 4i + 3; 8-bit, chunk c + i in lanes 8i .. 8i + 7.
template <int BITS>
inline __m512 step_scales(const float* sx) {
  if constexpr (BITS == 4) {
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_loadu_ps(sx)));
  } else {
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128 two = _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sx)));
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(two));
  }
}

// The step from chunk c of one weight row against MB rows of xq (row stride K), added to `into`.
template <int BITS, int MB, bool FP4>
__attribute__((always_inline)) inline void step_into(const uint8_t* row, const int16_t* xq, int K, const float* sxc,
                                                     int chunks, int c, __m512* into) {
  const __m512i v = load512(row + c * BITS * 4), zero = _mm512_setzero_si512();
  // 4-bit: 32 lanes of 4 nibbles, nibble j of every lane against block j of x, the four products
  // in one chain (exact integer sums, so in any order; two chains and an add cost a uop more: a
  // 1B shape's products at M = 4 took 0.85-0.93x the time with one chain, at M = 1 0.95-1.0x).
  if constexpr (BITS == 4) {
    const __m512i mask = _mm512_set1_epi16(0x0f);
    __m512i q[4];
    if constexpr (FP4) {
      fp4_nibbles(v, q);
    } else {
      q[0] = _mm512_and_si512(v, mask), q[1] = nibble<1>(v, mask), q[2] = nibble<2>(v, mask), q[3] = nibble<3>(v, mask);
    }
    const __m512i q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
    for (int m = 0; m < MB; m++) {
      const int16_t* x = xq + static_cast<long>(m) * K + c * 32;
      __m512i p = _mm512_dpwssd_epi32(zero, q0, load512(x));
      p = _mm512_dpwssd_epi32(p, q1, load512(x + 32));
      p = _mm512_dpwssd_epi32(p, q2, load512(x + 64));
      p = _mm512_dpwssd_epi32(p, q3, load512(x + 96));
      const __m512 f = _mm512_cvtepi32_ps(p);
      into[m] = _mm512_fmadd_ps(f, step_scales<4>(sxc + m * chunks + c), into[m]);
    }
  } else {  // 32 lanes of 2 bytes: the evens against the first 32 of x, the odds against the rest
    const __m512i even = _mm512_and_si512(v, _mm512_set1_epi16(0xff)), odd = _mm512_srli_epi16(v, 8);
    for (int m = 0; m < MB; m++) {
      const int16_t* x = xq + static_cast<long>(m) * K + c * 32;
      const __m512i p = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, even, load512(x)), odd, load512(x + 32));
      into[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), step_scales<8>(sxc + m * chunks + c), into[m]);
    }
  }
}

// One weight row (affine, BITS 4 or 8) against rows [m0, m0 + MB) of the activations, its
// prologue (row_scales) in sxc. Steps alternate between two accumulators per row of x, so no FMA
// waits on its predecessor; the tail goes to a third, in avx2.cpp's 32-byte form.
template <int BITS, int MB, bool FP4>
void affine_body(const Weights& w, const Acts& a, const uint8_t* row, const float* sxc, float* y, long ldy,
                 int n, int m0) {
  constexpr int per_step = kStep * 8 / (32 * BITS);  // chunks
  const int K = w.K, chunks = K / 32, steps = chunks / per_step, row_bytes = chunks * BITS * 4;
  const float* bias_sum = sxc + MB * chunks;
  __m512 acc0[MB], acc1[MB];
  __m256 tail[MB];
  for (int m = 0; m < MB; m++) {
    acc0[m] = acc1[m] = _mm512_setzero_ps();
    tail[m] = _mm256_setzero_ps();
  }
  const int16_t* xq = a.xq + static_cast<long>(m0) * K;
  int s = 0;
  for (; s + 2 <= steps; s += 2) {
    const uint8_t* at = row + s * kStep;
    _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(at + kStep + kPrefetchBytes), _MM_HINT_T0);
    step_into<BITS, MB, FP4>(row, xq, K, sxc, chunks, s * per_step, acc0);
    step_into<BITS, MB, FP4>(row, xq, K, sxc, chunks, (s + 1) * per_step, acc1);
  }
  // The lines the steps above did not reach, up to the row's last byte (as avx2.cpp).
  for (int off = s * kStep; off < row_bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + off + kPrefetchBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes - 1 + kPrefetchBytes), _MM_HINT_T0);
  if (s < steps) step_into<BITS, MB, FP4>(row, xq, K, sxc, chunks, s++ * per_step, acc0);
  int c = steps * per_step;
  if constexpr (BITS == 4) {
    if (c + 2 <= chunks) {
      pair_into<4, MB, FP4>(row, xq, K, sxc, chunks, c, tail);
      c += 2;
    }
  }
  if (c < chunks) {
    for (int m = 0; m < MB; m++) {
      const int16_t* x = xq + static_cast<long>(m) * K + c * 32;
      __m256 f = _mm256_cvtepi32_ps(chunk_product<BITS, FP4>(row + c * BITS * 4, x));
      tail[m] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(sxc + m * chunks + c), tail[m]);
    }
  }
  for (int m = 0; m < MB; m++)
    y[(m0 + m) * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) + hsum(tail[m]) + bias_sum[m];
}

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

// A step of 4 chunks (64 bytes) from chunk c against MB rows of int8 x (Acts: row stride 2K bytes):
// each int32 lane sums 4 byte products, lanes 4i .. 4i + 3 chunk c + i, scaled by the lanes `at`
// picks of each row's 16 group scales (scale x activation scale).
template <int MB, bool FP4>
__attribute__((always_inline)) inline void int8_step(const uint8_t* row, const int8_t* xq, int K, int c, __m512i at,
                                                     const __m512* scales, __m512* into) {
  __m512i lo, hi;
  int8_nibbles<FP4>(load512(row + c * 16), &lo, &hi);
  for (int m = 0; m < MB; m++) {
    const int8_t* xm = xq + static_cast<long>(m) * 2 * K;
    const int8_t* x = xm + c * 32;
    const __m512i start = int8_start<FP4, __m512i>(xm, K, c);
    const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, load512(x)), hi, load512(x + 64));
    into[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(at, scales[m]), into[m]);
  }
}

// 16 scales (or biases) from element i as floats, 0 in the lanes `mask` leaves out.
inline __m512 scales16(const void* p, ScaleType t, long i, __mmask16 mask) {
  switch (t) {
    case ScaleType::F32:
      return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
    case ScaleType::F16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i));
    case ScaleType::BF16:
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i)), 16));
    case ScaleType::E8M0: {  // as scales8: 2^(e - 128), e = 0 at the floor
      const __m128i e = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(p) + i);
      const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(e), 23));
      return _mm512_maskz_max_ps(mask, _mm512_mul_ps(f, _mm512_set1_ps(0.5f)), _mm512_set1_ps(0x1p-128f));
    }
  }
  return _mm512_setzero_ps();
}

// Lane l of step j of a run of 16 groups of P chunks each (P = 1, 2, 4): the group of its chunk,
// 4j + l / 4 of the run's chunks, so the scale a step's lane takes.
struct StepGroups {
  alignas(64) int32_t at[3][16][16];
  constexpr StepGroups() : at{} {
    for (int l2 = 0; l2 < 3; l2++)
      for (int j = 0; j < 16; j++)
        for (int l = 0; l < 16; l++) at[l2][j][l] = ((4 * j + l / 4) >> l2) & 15;
  }
};
constexpr StepGroups kStepGroups;

// affine_body's scheme on int8 activations (Acts): two VNNI byte products a 64-byte step. The
// scales need no prologue: a run of 16 groups at a time has its scales x activation scales in one
// register per row of x (a step's lanes pick theirs with one permute) and adds its biases x
// activation sums into the sums at once, so nothing is stored and read back per row.
template <int MB, bool FP4>
void int8_body(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0) {
  const int K = w.K, chunks = K / 32, groups = a.groups, per_group = w.group_size / 32;
  const int shift = per_group == 1 ? 0 : per_group == 2 ? 1 : 2, run_chunks = 16 * per_group;
  const long first = static_cast<long>(n) * groups;  // the row's first scale
  const int row_bytes = chunks * 16;
  const float z = symmetric_bias(w, 1.0f);
  __m512 acc0[MB], acc1[MB], scales[MB];
  __m256 tail[MB];
  for (int m = 0; m < MB; m++) {
    acc0[m] = acc1[m] = _mm512_setzero_ps();
    tail[m] = _mm256_setzero_ps();
  }
  const int8_t* xq = reinterpret_cast<const int8_t*>(a.xq + static_cast<long>(m0) * K);
  const int steps = chunks / 4;
  for (int off = 0; off < std::min(row_bytes, 2 * kStep); off += 64)  // the row's first lines, now
    _mm_prefetch(reinterpret_cast<const char*>(row + off + kPrefetchBytes), _MM_HINT_T0);
  int c = 0;
  for (int g0 = 0; g0 < groups; g0 += 16) {
    const int count = std::min(16, groups - g0);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 s = scales16(w.scales, w.scale_type, first + g0, mask);
    const __m512 b = w.biases ? scales16(w.biases, w.scale_type, first + g0, mask) : _mm512_mul_ps(s, _mm512_set1_ps(z));
    for (int m = 0; m < MB; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g0;
      scales[m] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, a.xscale + r));
      acc1[m] = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(mask, a.xsum + r), acc1[m]);
    }
    // This run's whole steps, two at a time (one accumulator each), then one.
    const int end = std::min(steps, (g0 * per_group + run_chunks) / 4);
    const int32_t(*at)[16] = kStepGroups.at[shift];
    int j = 0;  // the step within the run
    for (; c / 4 + 2 <= end; c += 8, j += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(row + c * 16 + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(row + c * 16 + kStep + kPrefetchBytes), _MM_HINT_T0);
      int8_step<MB, FP4>(row, xq, K, c, _mm512_load_si512(at[j]), scales, acc0);
      int8_step<MB, FP4>(row, xq, K, c + 4, _mm512_load_si512(at[j + 1]), scales, acc1);
    }
    if (c / 4 < end) {
      _mm_prefetch(reinterpret_cast<const char*>(row + c * 16 + kPrefetchBytes), _MM_HINT_T0);
      int8_step<MB, FP4>(row, xq, K, c, _mm512_load_si512(at[j]), scales, acc0);
      c += 4;
    }
  }
  if (c < chunks) {  // the row's last 1-3 chunks: spans of 2, then 1, scaled from the last run's registers
    alignas(64) float last[MB][16];
    for (int m = 0; m < MB; m++) _mm512_store_ps(last[m], scales[m]);
    const int base = (groups - 1) / 16 * 16 * per_group;  // the last run's first chunk
    const auto scale_of = [&](int m, int chunk) { return last[m][(chunk - base) / per_group]; };
    if (c + 2 <= chunks) {  // lanes 0-3 chunk c, 4-7 chunk c + 1
      __m256i lo, hi;
      int8_nibbles<FP4>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16)), &lo, &hi);
      for (int m = 0; m < MB; m++) {
        const int8_t* xm = xq + static_cast<long>(m) * 2 * K;
        const int8_t* x = xm + c * 32;
        const __m256i start = int8_start<FP4, __m256i>(xm, K, c);
        const __m256i p = _mm256_dpbusd_epi32(
            _mm256_dpbusd_epi32(start, lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), hi,
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(scale_of(m, c + 1)), _mm_set1_ps(scale_of(m, c)));
        tail[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, tail[m]);
      }
      c += 2;
    }
    if (c < chunks) {  // a last lone chunk
      __m128i lo, hi;
      int8_nibbles<FP4>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c * 16)), &lo, &hi);
      for (int m = 0; m < MB; m++) {
        const int8_t* xm = xq + static_cast<long>(m) * 2 * K;
        const int8_t* x = xm + c * 32;
        const __m128i start = int8_start<FP4, __m128i>(xm, K, c);
        const __m128i p = _mm_dpbusd_epi32(_mm_dpbusd_epi32(start, lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
                                           hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16)));
        tail[m] = _mm256_fmadd_ps(_mm256_zextps128_ps256(_mm_cvtepi32_ps(p)), _mm256_set1_ps(scale_of(m, c)), tail[m]);
      }
    }
  }
  for (int m = 0; m < MB; m++)
    y[(m0 + m) * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) + hsum(tail[m]);
}

// `prepare` for int8 bodies: 4-bit weights' x rounded to int8 per group (amax / 127 a step) in
// the int8 order (kernels.h, Acts), xsum the sum of the rounded values, and for MXFP4 the sums
// that cancel kFp4Offset; 8-bit weights' as vector_prepare.
void int8_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  if (quant_bits(w.format) != 4) return vector_prepare<kStep>(w, x, M, xq, xscale, xsum);
  const int K = w.K, gs = w.group_size, groups = K / gs, chunks = K / 32;
  thread_local std::vector<int8_t> natural;
  natural.resize(static_cast<size_t>(K));
  for (int m = 0; m < M; m++) {
    const float* xr = x + static_cast<long>(m) * K;
    for (int g = 0; g < groups; g++) {
      const float* xg = xr + g * gs;
      __m512 vmax = _mm512_setzero_ps();
      for (int i = 0; i < gs; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
      const float amax = _mm512_reduce_max_ps(vmax);
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m512i total = _mm512_setzero_si512();
      for (int i = 0; i < gs; i += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
        total = _mm512_add_epi32(total, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(natural.data() + g * gs + i), _mm512_cvtepi32_epi8(q));
      }
      xscale[m * groups + g] = amax / 127.0f;
      xsum[m * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(total)) * (amax / 127.0f);
    }
    int8_t* qr = reinterpret_cast<int8_t*>(xq + static_cast<long>(m) * K);
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

// One 16-bit weight row against rows [m0, m0 + MB) of x (float32, read directly), 32 a step.
template <bool BF, int MB>
void half_row(const Weights& w, const Acts& a, const uint16_t* row, float* y, long ldy, int n, int m0) {
  const int K = w.K;
  __m512 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
  auto load = [&](int k) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    return BF ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
  };
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);  // a line
    const __m512 w0 = load(k), w1 = load(k + 16);
    for (int m = 0; m < MB; m++) {
      const float* x = a.x + static_cast<long>(m0 + m) * K + k;
      acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), acc0[m]);
      acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), acc1[m]);
    }
  }
  for (int m = 0; m < MB; m++) {
    const float* x = a.x + static_cast<long>(m0 + m) * K;
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
    for (int j = k; j < K; j++) sum += x[j] * (BF ? bf16_scalar(row[j]) : _cvtsh_ss(row[j]));
    y[(m0 + m) * ldy + n] = sum;
  }
}

}  // namespace

const Kernels* SHOAL_AVX512_KERNELS(bool int8) {
  const Kernels* avx2 = avx2_kernels();
  if (!avx2) return nullptr;
  static const Kernels wide{SHOAL_AVX512_NAME,    vector_rows<false>, avx2->dequant, vector_prepare<kStep>,
                            avx512_gemm_kernel(), natural_prepare};
  static const Kernels bytes{SHOAL_AVX512_NAME,    vector_rows<true>, avx2->dequant, int8_prepare,
                             avx512_gemm_kernel(), natural_prepare,   true};
  return int8 ? &bytes : &wide;
}

}  // namespace shoal

#else

namespace shoal {
const Kernels* SHOAL_AVX512_KERNELS(bool) { return nullptr; }
}  // namespace shoal

#endif
