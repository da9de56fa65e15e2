// AVX-512 (F, BW, VL) + VNNI kernels. This file alone is compiled with those flags; the library
// prefers them to the AVX2 ones only when the CPU has them all (__builtin_cpu_supports at run time).
//
// avx2.cpp's scheme at twice the width: a step reads one 64-byte line of a weight row (4-bit: 4
// chunks of 32 weights; 8-bit: 2) as 32 lanes of 16 bits, takes its values apart with shifts and
// masks, and multiplies them with the int16 activations by `vpdpwssd`, which multiplies, adds
// pairs and accumulates in one instruction (32 products); with int8 activations, by `vpdpbusd`
// (avx512_int8.h). The scales come with no per-row prologue (register_body). A row's tail (fewer
// chunks than a step) and the rows loop are avx2.cpp's (avx2_util.h); so is the dequantization
// of 16-bit weights for sgemm in prefill (quantized ones go to gemm_avx512.cpp). As there, each
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

// The int32 sums of one 64-byte step of a weight row (4-bit: 4 chunks, lanes 4i .. 4i + 3 chunk
// i; 8-bit: 2 chunks, lanes 8i .. 8i + 7) against one row of int16 x from the step's first value.
// 4-bit: 32 lanes of 4 nibbles, nibble j of every lane against block j of x, the four products in
// one chain (exact integer sums, so in any order; two chains and an add cost a uop more: a 1B
// shape's products at M = 4 took 0.85-0.93x the time with one chain, at M = 1 0.95-1.0x).
template <int BITS>
__attribute__((always_inline)) inline __m512i int16_sums(const __m512i* q, const int16_t* x) {
  const __m512i zero = _mm512_setzero_si512();
  if constexpr (BITS == 4) {
    __m512i p = _mm512_dpwssd_epi32(zero, q[0], load512(x));
    p = _mm512_dpwssd_epi32(p, q[1], load512(x + 32));
    p = _mm512_dpwssd_epi32(p, q[2], load512(x + 64));
    return _mm512_dpwssd_epi32(p, q[3], load512(x + 96));
  } else {  // 32 lanes of 2 bytes: the evens against the first 32 of x, the odds against the rest
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, q[0], load512(x)), q[1], load512(x + 32));
  }
}

// The values of a step's 64 bytes as int16_sums takes them (4-bit: nibble j of every 16-bit lane
// in q[j]; 8-bit: the even and odd bytes).
template <int BITS, bool FP4>
__attribute__((always_inline)) inline void int16_values(__m512i v, __m512i* q) {
  if constexpr (BITS == 4) {
    const __m512i mask = _mm512_set1_epi16(0x0f);
    if constexpr (FP4) {
      fp4_nibbles(v, q);
    } else {
      q[0] = _mm512_and_si512(v, mask), q[1] = nibble<1>(v, mask), q[2] = nibble<2>(v, mask), q[3] = nibble<3>(v, mask);
    }
  } else {
    q[0] = _mm512_and_si512(v, _mm512_set1_epi16(0xff)), q[1] = _mm512_srli_epi16(v, 8);
  }
}

// One weight row (BITS 4 or 8; FP4: MXFP4) against rows [m0, m0 + MB) of the activations, int8
// (I8, avx512_int8.h) or int16 (Acts). Steps alternate between two accumulators per row of x, so
// no FMA waits on its predecessor. The scales need no prologue: a run of 16 groups at a time has
// its scales x activation scales in one register per row of x (a step's lanes pick theirs with one
// permute) and adds its biases x activation sums into the sums at once, so nothing is stored and
// read back per row (the per-row prologue took ~1/5 of a 4-bit product at one row).
template <int BITS, int MB, bool FP4, bool I8>
void register_body(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0) {
  constexpr int per_step = kStep * 8 / (32 * BITS);  // chunks
  const int K = w.K, chunks = K / 32, groups = a.groups, per_group = w.group_size / 32;
  const int32_t(*lanes)[16] = kStepGroups.at[BITS == 8][per_group == 1 ? 0 : per_group == 2 ? 1 : 2];
  const long first = static_cast<long>(n) * groups;  // the row's first scale
  const int row_bytes = chunks * BITS * 4, steps = chunks / per_step;
  const float z = symmetric_bias(w, 1.0f);
  __m512 acc0[MB], acc1[MB], scales[MB];
  __m256 tail[MB];
  for (int m = 0; m < MB; m++) {
    acc0[m] = acc1[m] = _mm512_setzero_ps();
    tail[m] = _mm256_setzero_ps();
  }
  const int16_t* xq = a.xq + static_cast<long>(m0) * K;  // row m's place: xq + m * K
  const auto step = [&](int c, __m512i at, __m512* into) __attribute__((always_inline)) {
    const __m512i v = load512(row + c * BITS * 4);
    __m512i q[4];
    if constexpr (!I8) int16_values<BITS, FP4>(v, q);
    for (int m = 0; m < MB; m++) {
      const int16_t* xm = xq + static_cast<long>(m) * K;
      __m512i p;
      if constexpr (I8) {
        p = int8_span<BITS, FP4>(v, reinterpret_cast<const int8_t*>(xm), K, c);
      } else {
        p = int16_sums<BITS>(q, xm + c * 32);
      }
      into[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(at, scales[m]), into[m]);
    }
  };
  auto prefetch = [&](int c) __attribute__((always_inline)) { _mm_prefetch(reinterpret_cast<const char*>(row + c * BITS * 4 + kPrefetchBytes), _MM_HINT_T0); };
  // A run of 16 groups: their scales x activation scales in one register per row of x, their
  // biases x activation sums added at once.
  const auto start_run = [&](int g0, __mmask16 mask) __attribute__((always_inline)) {
    const __m512 scale = scales16(w.scales, w.scale_type, first + g0, mask);
    const __m512 bias = w.biases ? scales16(w.biases, w.scale_type, first + g0, mask) : _mm512_mul_ps(scale, _mm512_set1_ps(z));
    for (int m = 0; m < MB; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g0;
      scales[m] = _mm512_mul_ps(scale, _mm512_maskz_loadu_ps(mask, a.xscale + r));
      acc1[m] = _mm512_fmadd_ps(bias, _mm512_maskz_loadu_ps(mask, a.xsum + r), acc1[m]);
    }
  };
  int s = 0, g0 = 0;  // steps and groups done
  // Whole runs (16 groups of 1, 2 or 4 chunks: R = 4 to 32 whole steps) with their steps unrolled:
  // a loop over a run's few steps paid its setup per run (4-bit g32: 4 steps). Unrolled (the
  // lambdas forced inline, which GCC stopped doing), L2-resident 1B-shaped products at M = 1 ran at
  // 21.5 GB/s a thread instead of 16.5-17.8 (4-bit), 31.8 instead of 26 (8-bit) (Xeon, 2026-12-06).
  const auto whole_runs = [&](auto steps_per_run) {
    constexpr int R = decltype(steps_per_run)::value;
    for (; g0 + 16 <= groups; g0 += 16, s += R) {
      start_run(g0, 0xffff);
#pragma GCC unroll 32
      for (int j = 0; j < R; j += 2) {
        prefetch((s + j) * per_step), prefetch((s + j + 1) * per_step);
        step((s + j) * per_step, _mm512_load_si512(lanes[j]), acc0);
        step((s + j + 1) * per_step, _mm512_load_si512(lanes[j + 1]), acc1);
      }
    }
  };
  switch (16 * per_group / per_step) {
    case 4: whole_runs(std::integral_constant<int, 4>{}); break;
    case 8: whole_runs(std::integral_constant<int, 8>{}); break;
    case 16: whole_runs(std::integral_constant<int, 16>{}); break;
    default: whole_runs(std::integral_constant<int, 32>{}); break;
  }
  if (g0 < groups) {  // the last run, of fewer groups: its whole steps, then a tail (below)
    const int count = groups - g0;
    start_run(g0, static_cast<__mmask16>((1u << count) - 1));
    const int run_first = s;
    for (; s + 2 <= steps; s += 2) {
      prefetch(s * per_step), prefetch((s + 1) * per_step);
      step(s * per_step, _mm512_load_si512(lanes[s - run_first]), acc0);
      step((s + 1) * per_step, _mm512_load_si512(lanes[s + 1 - run_first]), acc1);
    }
    if (s < steps) {
      prefetch(s * per_step);
      step(s * per_step, _mm512_load_si512(lanes[s - run_first]), acc0);
      s++;
    }
  }
  _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes - 1 + kPrefetchBytes), _MM_HINT_T0);
  int c = steps * per_step;
  if (c < chunks) {  // the row's last chunks (fewer than a step), scaled from the last run's registers
    alignas(64) float last[MB][16];
    for (int m = 0; m < MB; m++) _mm512_store_ps(last[m], scales[m]);
    const int base = (groups - 1) / 16 * 16 * per_group;  // the last run's first chunk
    const auto scale_of = [&](int m, int chunk) { return _mm_set1_ps(last[m][(chunk - base) / per_group]); };
    if (BITS == 4 && c + 2 <= chunks) {  // a span of 2: lanes 0-3 chunk c, 4-7 chunk c + 1
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 16));
      __m256i q[4];
      if constexpr (!I8) pair_values<FP4>(v, q);
      for (int m = 0; m < MB; m++) {
        const int16_t* xm = xq + static_cast<long>(m) * K;
        __m256i p;
        if constexpr (I8) {
          p = int8_span<BITS, FP4>(v, reinterpret_cast<const int8_t*>(xm), K, c);
        } else {
          p = pair_sums(q, xm + c * 32);
        }
        tail[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(scale_of(m, c + 1), scale_of(m, c)), tail[m]);
      }
      c += 2;
    }
    if (c < chunks) {  // a lone chunk: 8-bit, 8 lanes; 4-bit, 4 (the high half zero)
      const uint8_t* bytes = row + c * BITS * 4;
      const __m256i v8 = BITS == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)) : __m256i{};
      const __m128i v4 = BITS == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)) : __m128i{};
      for (int m = 0; m < MB; m++) {
        const int16_t* xm = xq + static_cast<long>(m) * K;
        __m256i p;
        if constexpr (I8) {
          const int8_t* x8 = reinterpret_cast<const int8_t*>(xm);
          p = BITS == 8 ? int8_span<BITS, FP4>(v8, x8, K, c) : _mm256_zextsi128_si256(int8_span<BITS, FP4>(v4, x8, K, c));
        } else {
          p = chunk_product<BITS, FP4>(row + c * BITS * 4, xm + c * 32);
        }
        tail[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set_m128(scale_of(m, c), scale_of(m, c)), tail[m]);
      }
    }
  }
  for (int m = 0; m < MB; m++)
    y[(m0 + m) * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) + hsum(tail[m]);
}

// One dense weight row against rows [m0, m0 + MB) of x (float32, read directly), 32 a step.
template <Format F, int MB>
void dense_row(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0) {
  const int K = w.K;
  __m512 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
  auto load = [&](int k) {
    if constexpr (F == Format::F32) return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + k);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + k));
    if constexpr (F == Format::BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  };
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    const char* at = reinterpret_cast<const char*>(row) + k * kDenseBytes<F> + kPrefetchBytes;
    _mm_prefetch(at, _MM_HINT_T0);  // a line a step (16-bit), two (F32)
    if constexpr (F == Format::F32) _mm_prefetch(at + 64, _MM_HINT_T0);
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
    for (int j = k; j < K; j++) sum += x[j] * dense_scalar<F>(row, j);
    y[(m0 + m) * ldy + n] = sum;
  }
}

}  // namespace

const Kernels* SHOAL_AVX512_KERNELS(bool int8) {
  const Kernels* avx2 = avx2_kernels();
  if (!avx2) return nullptr;
  static const Kernels wide{SHOAL_AVX512_NAME,    vector_rows<Body::Int16>, avx2->dequant, vector_prepare<kStep>,
                            avx512_gemm_kernel(), natural_prepare};
  static const Kernels bytes{SHOAL_AVX512_NAME,     vector_rows<Body::Int8>, avx2->dequant, int8_prepare,
                             avx512_gemm8_kernel(), gemm8_prepare,            true};
  return int8 ? &bytes : &wide;
}

}  // namespace shoal

#else

namespace shoal {
const Kernels* SHOAL_AVX512_KERNELS(bool) { return nullptr; }
}  // namespace shoal

#endif
