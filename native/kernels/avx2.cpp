// AVX2 + FMA + F16C kernels. This file alone is compiled with -mavx2 -mfma -mf16c; the library
// calls into it only when the CPU says it has all three (__builtin_cpu_supports at run time).
//
// Small-batch affine products: the weights are read as 16-bit lanes and their 4-bit or 8-bit
// values taken apart with shifts and masks (no shuffles: those share two ports with the shifts),
// each multiplied with the int16 activations of every row of x by `vpmaddwd` (16 products a
// step); the int32 sums of a 32-weight chunk are scaled once. Each output element is computed the
// same way whatever the number of rows, so a sequence gives the same bits alone or in a batch.
#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <algorithm>
#include <cstring>
#include <vector>

#include "avx2_util.h"

namespace shoal {
namespace {

// One weight row (affine, BITS 4 or 8) against rows [m0, m0 + MB) of the activations, its
// prologue (row_scales) already in sxc. Works a step of two 32-weight chunks at a time: their
// int32 sums are scaled by each chunk's scale x activation scale and added to one of two float
// accumulators per row of x, alternating, so that no FMA waits on its predecessor. The same order
// for any MB.
template <int BITS, int MB, bool FP4>
void affine_body(const Weights& w, const Acts& a, const uint8_t* row, const float* sxc, float* y, long ldy,
                 int n, int m0) {
  const int K = w.K, chunks = K / 32;
  const float* bias_sum = sxc + MB * chunks;
  // acc0 takes pairs 0, 2, 4, ..., acc1 pairs 1, 3, ...: the loop is unrolled so that both stay in
  // registers (indexing one array by the pair's parity kept them on the stack).
  __m256 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
  const int16_t* xq = a.xq + static_cast<long>(m0) * K;
  const float* sx = sxc;
  int c = 0;
  for (; c + 4 <= chunks; c += 4) {
    for (int line = 0; line < BITS * 16; line += 64)  // 4 chunks: one cache line (4-bit) or two
      _mm_prefetch(reinterpret_cast<const char*>(row + c * BITS * 4 + kPrefetchBytes + line), _MM_HINT_T0);
    pair_into<BITS, MB, FP4>(row, xq, K, sx, chunks, c, acc0);
    pair_into<BITS, MB, FP4>(row, xq, K, sx, chunks, c + 2, acc1);
  }
  // The lines the steps above did not reach: the rest of the row ahead, up to its last byte (a row
  // is rarely a whole number of lines, so its last line would otherwise wait on memory every time).
  const int row_bytes = chunks * BITS * 4;
  for (int off = c * BITS * 4; off < row_bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + off + kPrefetchBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes - 1 + kPrefetchBytes), _MM_HINT_T0);
  if (c + 2 <= chunks) {
    pair_into<BITS, MB, FP4>(row, xq, K, sx, chunks, c, acc0);
    c += 2;
  }
  if (c < chunks) {  // an odd number of chunks: the last one alone
    __m256* into = (c >> 1) & 1 ? acc1 : acc0;
    for (int m = 0; m < MB; m++) {
      const int16_t* x = xq + static_cast<long>(m) * K + c * 32;
      __m256 f = _mm256_cvtepi32_ps(chunk_product<BITS, FP4>(row + c * BITS * 4, x));
      into[m] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(sx + m * chunks + c), into[m]);
    }
  }
  for (int m = 0; m < MB; m++) y[(m0 + m) * ldy + n] = hsum(_mm256_add_ps(acc0[m], acc1[m])) + bias_sum[m];
}

// One dense weight row against rows [m0, m0 + MB) of x (float32, read directly), 16 a step.
template <Format F, int MB>
void dense_row(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0) {
  const int K = w.K;
  __m256 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
  auto load = [&](int k) {
    if constexpr (F == Format::F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + k);
    const auto* h = reinterpret_cast<const uint16_t*>(row) + k;
    if constexpr (F == Format::BF16) return load_bf16x8(h);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  };
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    if ((k * kDenseBytes<F>) % 64 == 0) {  // a line a step (F32), every other step (16-bit)
      _mm_prefetch(reinterpret_cast<const char*>(row) + k * kDenseBytes<F> + kPrefetchBytes, _MM_HINT_T0);
    }
    __m256 w0 = load(k), w1 = load(k + 8);
    for (int m = 0; m < MB; m++) {
      const float* x = a.x + static_cast<long>(m0 + m) * K + k;
      acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc0[m]);
      acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc1[m]);
    }
  }
  for (int m = 0; m < MB; m++) {
    const float* x = a.x + static_cast<long>(m0 + m) * K;
    float sum = hsum(_mm256_add_ps(acc0[m], acc1[m]));
    for (int j = k; j < K; j++) sum += x[j] * dense_scalar<F>(row, j);
    y[(m0 + m) * ldy + n] = sum;
  }
}

void avx2_dequant(const Weights& w, int n0, int n1, float* out) {
  const int K = w.K;
  const bool grouped = is_grouped(w.format);
  const int groups = grouped ? K / w.group_size : 0;
  const float z = symmetric_bias(w, 1.0f);
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    float* o = out + static_cast<long>(n - n0) * K;
    if (w.format == Format::F32) {
      std::memcpy(o, row, static_cast<size_t>(K) * sizeof(float));
      continue;
    }
    if (!grouped) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(row);
      for (int k = 0; k < K; k += 8) {  // K is a multiple of 8 (checked by the caller)
        __m256 v = w.format == Format::BF16 ? load_bf16x8(h + k)
                                            : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + k)));
        _mm256_storeu_ps(o + k, v);
      }
      continue;
    }
    for (int k = 0; k < K; k += 32) {  // 32 weights at a time, in element order
      const long g = static_cast<long>(n) * groups + k / w.group_size;
      const float s = scale1(w.scales, w.scale_type, g);
      const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(w.biases ? scale1(w.biases, w.scale_type, g) : z * s);
      __m128i bytes[2];
      if (w.format != Format::Affine8) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
        __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        bytes[0] = _mm_unpacklo_epi8(lo, hi);
        bytes[1] = _mm_unpackhi_epi8(lo, hi);
        if (w.format == Format::Mxfp4) {  // codes as kE2M1x2's signed values
          for (__m128i& b : bytes) b = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)), b);
        }
      } else {
        bytes[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
        bytes[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
      }
      const auto widen = [&](__m128i b) {
        return _mm256_cvtepi32_ps(w.format == Format::Mxfp4 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
      };
      for (int half = 0; half < 2; half++) {
        __m256 q0 = widen(bytes[half]);
        __m256 q1 = widen(_mm_srli_si128(bytes[half], 8));
        _mm256_storeu_ps(o + k + half * 16, _mm256_fmadd_ps(q0, sv, bv));
        _mm256_storeu_ps(o + k + half * 16 + 8, _mm256_fmadd_ps(q1, sv, bv));
      }
    }
  }
}

}  // namespace

const Kernels* avx2_kernels() {
  static const Kernels kernels{"avx2", vector_rows, avx2_dequant, vector_prepare<32>};
  return &kernels;
}

}  // namespace shoal

#else

namespace shoal {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace shoal

#endif
