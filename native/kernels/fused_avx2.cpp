// AVX2 + FMA inner loops of the fused operations (fused.cpp and attention.cpp hold the rest). Compiled with
// -mavx2 -mfma like avx2.cpp; used only when the matmul kernels chose AVX2 at run time.
#include "fused.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace shoal {

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Eight keys' (values') floats from a float32 or float16 cache (F16C: exact), and one.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return _cvtsh_ss(*p); }

template <typename T>
inline float dot(const float* a, const T* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
  }
  if (i + 8 <= n) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    i += 8;
  }
  float t = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; i++) t = std::fma(a[i], load1(b + i), t);  // explicit: the same bits for either type
  return t;
}

constexpr int kKeyBlock = 64;
// Keys (or values) taken a block at a time by every query row of a KV head: a block (64 rows of
// 64 floats = 16 KB) stays in L1 while the G rows of a grouped-query head read it, so a deep cache
// comes from memory once per head instead of once per query row. Each row's arithmetic, and so its
// result, is the same as row by row.

// Eight keys at a time per query row: q is loaded once per eight FMAs, one reduction per eight dots.
template <typename T>
void qk_rows(const float* q, int R, const T* k, long ks, int S, int D, float scale, float* scores) {
  const int Dv8 = D / 8 * 8;
  for (int s0 = 0; s0 < S; s0 += kKeyBlock) {
    const int s1 = std::min(S, s0 + kKeyBlock);
    for (int r = 0; r < R; r++) {
      const float* qr = q + static_cast<long>(r) * D;
      float* sc = scores + static_cast<long>(r) * S;
      int s = s0;
      for (; s + 8 <= s1; s += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < Dv8; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qr + d);
          for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, load8(k + (s + j) * ks + d), acc[j]);
        }
        // Lane j of the two hadd trees is the dot of key s + j.
        const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
        const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
        const __m256 lo = _mm256_permute2f128_ps(h0, h1, 0x20), hi = _mm256_permute2f128_ps(h0, h1, 0x31);
        alignas(32) float dots[8];
        _mm256_store_ps(dots, _mm256_add_ps(lo, hi));
        for (int j = 0; j < 8; j++) {
          float t = dots[j];
          for (int d = Dv8; d < D; d++) t = std::fma(qr[d], load1(k + (s + j) * ks + d), t);
          sc[s + j] = scale * t;
        }
      }
      for (; s < s1; s++) sc[s] = scale * dot(qr, k + s * ks, D);
    }
  }
}

void qk(const float* q, int R, const void* k, KvType kt, long ks, int S, int D, float scale, float* scores) {
  if (kt == KvType::F16) return qk_rows(q, R, static_cast<const uint16_t*>(k), ks, S, D, scale, scores);
  qk_rows(q, R, static_cast<const float*>(k), ks, S, D, scale, scores);
}

// Row by row within each block of values, 32 output columns held in registers over the block's
// keys (carried in `out` from one block to the next: the same sums in the same order).
template <typename T>
void pv_rows(const float* p, int R, const T* v, long vs, int S, int Dv, float* out) {
  for (int s0 = 0; s0 < S; s0 += kKeyBlock) {
    const int s1 = std::min(S, s0 + kKeyBlock);
    for (int r = 0; r < R; r++) {
      const float* pr = p + static_cast<long>(r) * S;
      float* o = out + static_cast<long>(r) * Dv;
      int d0 = 0;
      for (; d0 + 32 <= Dv; d0 += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        if (s0 > 0) {
          a0 = _mm256_loadu_ps(o + d0), a1 = _mm256_loadu_ps(o + d0 + 8);
          a2 = _mm256_loadu_ps(o + d0 + 16), a3 = _mm256_loadu_ps(o + d0 + 24);
        }
        for (int s = s0; s < s1; s++) {
          if (pr[s] == 0.0f) continue;  // masked keys cost nothing
          const __m256 w = _mm256_set1_ps(pr[s]);
          const T* vr = v + s * vs + d0;
          a0 = _mm256_fmadd_ps(w, load8(vr), a0);
          a1 = _mm256_fmadd_ps(w, load8(vr + 8), a1);
          a2 = _mm256_fmadd_ps(w, load8(vr + 16), a2);
          a3 = _mm256_fmadd_ps(w, load8(vr + 24), a3);
        }
        _mm256_storeu_ps(o + d0, a0), _mm256_storeu_ps(o + d0 + 8, a1);
        _mm256_storeu_ps(o + d0 + 16, a2), _mm256_storeu_ps(o + d0 + 24, a3);
      }
      for (; d0 < Dv; d0++) {
        float t = s0 > 0 ? o[d0] : 0.0f;
        for (int s = s0; s < s1; s++) t = std::fma(pr[s], load1(v + s * vs + d0), t);
        o[d0] = t;
      }
    }
  }
  if (S == 0) std::fill(out, out + static_cast<long>(R) * Dv, 0.0f);
}

void pv(const float* p, int R, const void* v, KvType vt, long vs, int S, int Dv, float* out) {
  if (vt == KvType::F16) return pv_rows(p, R, static_cast<const uint16_t*>(v), vs, S, Dv, out);
  pv_rows(p, R, static_cast<const float*>(v), vs, S, Dv, out);
}

// exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-6 polynomial, ~1 ulp); 0 below -87.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The largest of `from` and x[0 .. n) (a NaN in x may be missed).
float row_max(const float* x, long n, float from) {
  long i = 0;
  __m256 top8 = _mm256_set1_ps(from);
  for (; i + 8 <= n; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = lanes[0];
  for (int j = 1; j < 8; j++) top = std::max(top, lanes[j]);
  for (; i < n; i++) top = std::max(top, x[i]);
  return top;
}

void softmax(float* x, int n, float sink) {
  const float top = row_max(x, n, sink);
  const __m256 t8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), t8));
    _mm256_storeu_ps(x + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8) + std::exp(sink - top);
  for (; i < n; i++) sum += (x[i] = std::exp(x[i] - top));
  const __m256 norm = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), norm));
  for (; i < n; i++) x[i] *= 1.0f / sum;
}

float sumsq(const float* x, int n) { return dot(x, x, n); }

// x * sigmoid(x) with e = exp(-|x|): x / (1 + e) for x >= 0, x * e / (1 + e) below (no overflow).
void silu(const float* x, long n, float* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(v, sign));  // exp(-|x|)
    const __m256 num = _mm256_blendv_ps(v, _mm256_mul_ps(v, e), v);  // sign bit set: x * e
    _mm256_storeu_ps(out + i, _mm256_div_ps(num, _mm256_add_ps(one, e)));
  }
  if (i < n) portable_silu(x + i, n - i, out + i);
}

// The head's normalizer (mlx-lm subtracts it from every decode step's logits; MLX's CPU
// logsumexp is scalar: ~600 us over a 49k vocabulary). Rows with a NaN or an infinite max go to
// the portable loop, which gives MLX's answers for them.
float logsumexp(const float* x, long n) {
  const float top = row_max(x, n, -INFINITY);
  if (!std::isfinite(top)) return portable_logsumexp(x, n);
  const __m256 t8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    sum8 = _mm256_add_ps(sum8, exp_nonpositive(_mm256_sub_ps(v, t8)));
  }
  float sum = hsum(sum8);
  for (; i < n; i++) sum += std::exp(x[i] - top);
  if (!_mm256_testz_ps(nan8, nan8) || std::isnan(sum)) return portable_logsumexp(x, n);
  return top + std::log(sum);
}

}  // namespace

const FusedKernels* avx2_fused() {
  static const FusedKernels kernels{"avx2", qk, pv, sumsq, softmax, silu, logsumexp};
  return &kernels;
}

}  // namespace shoal

#else

namespace shoal {
const FusedKernels* avx2_fused() { return nullptr; }
}  // namespace shoal

#endif
