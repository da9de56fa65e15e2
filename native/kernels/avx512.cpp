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
#include "avx512_int8.h"

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
  static const Kernels bytes{SHOAL_AVX512_NAME,     vector_rows<true>,      avx2->dequant, int8_prepare,
                             avx512_gemm8_kernel(), avx512_gemm8_prepare(), true};
  return int8 ? &bytes : &wide;
}

}  // namespace shoal

#else

namespace shoal {
const Kernels* SHOAL_AVX512_KERNELS(bool) { return nullptr; }
}  // namespace shoal

#endif
