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

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shoal {
namespace {

#ifndef SHOAL_PREFETCH  // bytes ahead of the weight stream (-DSHOAL_PREFETCH=... to tune)
#define SHOAL_PREFETCH 4096
#endif
constexpr int kPrefetchBytes = SHOAL_PREFETCH;

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline float bf16_scalar(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scale (or bias) values i .. i + 7, and value i, as floats: read where they are stored, in the
// product's prologue, so no pass converts them into a buffer first (that pass waited on DRAM).
inline __m256 scales8(const void* p, ScaleType t, long i) {
  if (t == ScaleType::F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const uint16_t* h = static_cast<const uint16_t*>(p) + i;
  return t == ScaleType::F16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))) : load_bf16x8(h);
}

inline float scale1(const void* p, ScaleType t, long i) {
  if (t == ScaleType::F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == ScaleType::F16 ? _cvtsh_ss(h) : bf16_scalar(h);
}

// Biases i .. i + 7 given scales s: stored, or b = -2^(bits-1) s for symmetric weights.
inline __m256 biases8(const Weights& w, long i, __m256 s, float z) {
  return w.biases ? scales8(w.biases, w.scale_type, i) : _mm256_mul_ps(s, _mm256_set1_ps(z));
}

// The int32 products of one 32-weight chunk with one row of xq, in its affine_position order:
// 8-bit, 8 lanes; 4-bit (a chunk without a pair), 4 lanes in the low half.
template <int BITS>
inline __m256i chunk_product(const uint8_t* bytes, const int16_t* xq) {
  const __m256i* x = reinterpret_cast<const __m256i*>(xq);
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), mask = _mm_set1_epi16(0x0f);
    const __m128i* x4 = reinterpret_cast<const __m128i*>(xq);
    __m128i sum = _mm_madd_epi16(_mm_and_si128(v, mask), _mm_loadu_si128(x4));
    sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_loadu_si128(x4 + 1)));
    sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_and_si128(_mm_srli_epi16(v, 8), mask), _mm_loadu_si128(x4 + 2)));
    sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_srli_epi16(v, 12), _mm_loadu_si128(x4 + 3)));
    return _mm256_zextsi128_si256(sum);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0xff)), _mm256_loadu_si256(x)),
                            _mm256_madd_epi16(_mm256_srli_epi16(v, 8), _mm256_loadu_si256(x + 1)));
  }
}

// Lane indices that repeat each of 8 values 2 (groups of 64) or 4 times (groups of 128).
alignas(32) constexpr int kRepeat2[2][8] = {{0, 0, 1, 1, 2, 2, 3, 3}, {4, 4, 5, 5, 6, 6, 7, 7}};
alignas(32) constexpr int kRepeat4[4][8] = {
    {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};

// Chunks c and c + 1 of one weight row against MB rows of xq (row stride K), added to `into`.
template <int BITS, int MB>
__attribute__((always_inline)) inline void pair_into(const uint8_t* row, const int16_t* xq, int K, const float* sxc,
                                                     int chunks, int c, __m256* into) {
  constexpr int chunk_bytes = 32 * BITS / 8;
  if constexpr (BITS == 4) {  // both chunks' 32 bytes as 16 lanes of 4 nibbles
    const __m256i mask = _mm256_set1_epi16(0x0f);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * chunk_bytes));
    const __m256i q0 = _mm256_and_si256(v, mask), q1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), mask), q3 = _mm256_srli_epi16(v, 12);
    for (int m = 0; m < MB; m++) {
      const __m256i* x = reinterpret_cast<const __m256i*>(xq + static_cast<long>(m) * K + c * 32);
      const float* sx = sxc + m * chunks + c;
      __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(x)),
                                    _mm256_madd_epi16(q1, _mm256_loadu_si256(x + 1)));
      __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(q2, _mm256_loadu_si256(x + 2)),
                                    _mm256_madd_epi16(q3, _mm256_loadu_si256(x + 3)));
      __m256 f = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1));  // lanes 0-3 chunk c, 4-7 chunk c + 1
      __m256 scale = _mm256_set_m128(_mm_broadcast_ss(sx + 1), _mm_broadcast_ss(sx));
      into[m] = _mm256_fmadd_ps(f, scale, into[m]);
    }
  } else {  // each chunk's 32 bytes as 16 lanes of 2 bytes
    const __m256i mask = _mm256_set1_epi16(0xff);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * chunk_bytes));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (c + 1) * chunk_bytes));
    const __m256i e0 = _mm256_and_si256(v0, mask), o0 = _mm256_srli_epi16(v0, 8);
    const __m256i e1 = _mm256_and_si256(v1, mask), o1 = _mm256_srli_epi16(v1, 8);
    for (int m = 0; m < MB; m++) {
      const __m256i* x = reinterpret_cast<const __m256i*>(xq + static_cast<long>(m) * K + c * 32);
      const float* sx = sxc + m * chunks + c;
      __m256 f0 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(e0, _mm256_loadu_si256(x)),
                                                      _mm256_madd_epi16(o0, _mm256_loadu_si256(x + 1))));
      __m256 f1 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(e1, _mm256_loadu_si256(x + 2)),
                                                      _mm256_madd_epi16(o1, _mm256_loadu_si256(x + 3))));
      into[m] = _mm256_fmadd_ps(f1, _mm256_broadcast_ss(sx + 1), _mm256_fmadd_ps(f0, _mm256_broadcast_ss(sx), into[m]));
    }
  }
}

// The prologue of weight row n against rows [m0, m0 + MB) of x: each chunk's scale x activation
// scale into sxc (MB x chunks), then per row of x the sum over groups of bias x activation sum.
template <int MB>
inline void row_scales(const Weights& w, const Acts& a, int n, int m0, float* sxc) {
  const int groups = a.groups, chunks = w.K / 32, per_group = w.group_size / 32;
  const long at = static_cast<long>(n) * groups;  // the row's first scale
  const float z = symmetric_bias(w, 1.0f);
  float* bias_sum = sxc + MB * chunks;  // per row of x: the sum over groups of bias x activation sum
  __m256 bsum[MB];
  for (int m = 0; m < MB; m++) bsum[m] = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= groups; g += 8) {  // 8 groups' products, each repeated for its chunks
    const __m256 s = scales8(w.scales, w.scale_type, at + g), b = biases8(w, at + g, s, z);
    for (int m = 0; m < MB; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g;
      bsum[m] = _mm256_fmadd_ps(b, _mm256_loadu_ps(a.xsum + r), bsum[m]);
      const __m256 v = _mm256_mul_ps(s, _mm256_loadu_ps(a.xscale + r));
      float* out = sxc + m * chunks + g * per_group;
      if (per_group == 1) {
        _mm256_storeu_ps(out, v);
        continue;
      }
      const int(*lanes)[8] = per_group == 2 ? kRepeat2 : kRepeat4;
      for (int j = 0; j < per_group; j++) {
        const __m256i index = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes[j]));
        _mm256_storeu_ps(out + j * 8, _mm256_permutevar8x32_ps(v, index));
      }
    }
  }
  for (int m = 0; m < MB; m++) bias_sum[m] = hsum(bsum[m]);
  for (; g < groups; g++) {
    const float s = scale1(w.scales, w.scale_type, at + g);
    const float b = w.biases ? scale1(w.biases, w.scale_type, at + g) : z * s;
    for (int m = 0; m < MB; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g;
      bias_sum[m] += b * a.xsum[r];
      for (int c = 0; c < per_group; c++) sxc[m * chunks + g * per_group + c] = s * a.xscale[r];
    }
  }
}

// One weight row (affine, BITS 4 or 8) against rows [m0, m0 + MB) of the activations, its
// prologue (row_scales) already in sxc. Works a step of two 32-weight chunks at a time: their
// int32 sums are scaled by each chunk's scale x activation scale and added to one of two float
// accumulators per row of x, alternating, so that no FMA waits on its predecessor. The same order
// for any MB.
template <int BITS, int MB>
inline void affine_body(const Weights& w, const Acts& a, const uint8_t* row, const float* sxc, float* y, long ldy,
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
    pair_into<BITS, MB>(row, xq, K, sx, chunks, c, acc0);
    pair_into<BITS, MB>(row, xq, K, sx, chunks, c + 2, acc1);
  }
  // The lines the steps above did not reach: the rest of the row ahead, up to its last byte (a row
  // is rarely a whole number of lines, so its last line would otherwise wait on memory every time).
  const int row_bytes = chunks * BITS * 4;
  for (int off = c * BITS * 4; off < row_bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + off + kPrefetchBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + row_bytes - 1 + kPrefetchBytes), _MM_HINT_T0);
  if (c + 2 <= chunks) {
    pair_into<BITS, MB>(row, xq, K, sx, chunks, c, acc0);
    c += 2;
  }
  if (c < chunks) {  // an odd number of chunks: the last one alone
    __m256* into = (c >> 1) & 1 ? acc1 : acc0;
    for (int m = 0; m < MB; m++) {
      __m256 f = _mm256_cvtepi32_ps(chunk_product<BITS>(row + c * BITS * 4, xq + static_cast<long>(m) * K + c * 32));
      into[m] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(sx + m * chunks + c), into[m]);
    }
  }
  for (int m = 0; m < MB; m++) y[(m0 + m) * ldy + n] = hsum(_mm256_add_ps(acc0[m], acc1[m])) + bias_sum[m];
}

template <int BITS, int MB>
inline void affine_row(const Weights& w, const Acts& a, const uint8_t* row, float* sxc, float* y, long ldy, int n,
                       int m0) {
  row_scales<MB>(w, a, n, m0, sxc);
  affine_body<BITS, MB>(w, a, row, sxc, y, ldy, n, m0);
}

// One 16-bit weight row against rows [m0, m0 + MB) of x (float32, read directly).
template <bool BF, int MB>
inline void half_row(const Weights& w, const Acts& a, const uint16_t* row, float* y, long ldy, int n, int m0) {
  const int K = w.K;
  __m256 acc0[MB], acc1[MB];
  for (int m = 0; m < MB; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
  auto load = [&](int k) {
    return BF ? load_bf16x8(row + k) : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)));
  };
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    if (!(k & 16)) _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);  // a line
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
    for (int j = k; j < K; j++) sum += x[j] * (BF ? bf16_scalar(row[j]) : _cvtsh_ss(row[j]));
    y[(m0 + m) * ldy + n] = sum;
  }
}

// Rows of x in blocks of at most 4 per pass over a weight row (more would spill registers; the
// row is still in L1 for the second pass).
template <int MB>
void row_block(const Weights& w, const Acts& a, const uint8_t* row, float* sx, float* y, long ldy, int n, int m0) {
  switch (w.format) {
    case Format::Affine4:
      affine_row<4, MB>(w, a, row, sx, y, ldy, n, m0);
      break;
    case Format::Affine8:
      affine_row<8, MB>(w, a, row, sx, y, ldy, n, m0);
      break;
    case Format::F16:
      half_row<false, MB>(w, a, reinterpret_cast<const uint16_t*>(row), y, ldy, n, m0);
      break;
    case Format::BF16:
      half_row<true, MB>(w, a, reinterpret_cast<const uint16_t*>(row), y, ldy, n, m0);
      break;
  }
}

using BlockFn = void (*)(const Weights&, const Acts&, const uint8_t*, float*, float*, long, int, int);
constexpr BlockFn kBlocks[4] = {row_block<1>, row_block<2>, row_block<3>, row_block<4>};

void avx2_rows(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  thread_local std::vector<float> sx;  // scale x activation scale of each chunk, for 4 rows of x
  const long per_row = 4l * (w.K / 32) + 8;
  sx.resize(static_cast<size_t>(2 * per_row));
  if (a.M == 1 && (w.format == Format::Affine4 || w.format == Format::Affine8) && n0 < n1) {
    // Decode: the next row's prologue is written before this row's products read theirs, so those
    // reads never wait on the stores just made (their forwarding stalled the loads of a short row).
    const auto body = w.format == Format::Affine4 ? affine_body<4, 1> : affine_body<8, 1>;
    row_scales<1>(w, a, n0, 0, sx.data());
    for (int n = n0; n < n1; n++) {
      if (n + 1 < n1) row_scales<1>(w, a, n + 1, 0, sx.data() + ((n + 1 - n0) & 1) * per_row);
      body(w, a, w.data + static_cast<long>(n) * w.row_bytes, sx.data() + ((n - n0) & 1) * per_row, y, ldy, n, 0);
    }
    return;
  }
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    for (int m0 = 0; m0 < a.M; m0 += 4) kBlocks[std::min(4, a.M - m0) - 1](w, a, row, sx.data(), y, ldy, n, m0);
  }
}

void avx2_dequant(const Weights& w, int n0, int n1, float* out) {
  const int K = w.K;
  const bool affine = w.format == Format::Affine4 || w.format == Format::Affine8;
  const int groups = affine ? K / w.group_size : 0;
  const float z = symmetric_bias(w, 1.0f);
  const __m128i mask = _mm_set1_epi8(0x0f);
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    float* o = out + static_cast<long>(n - n0) * K;
    if (!affine) {
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
      if (w.format == Format::Affine4) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
        __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        bytes[0] = _mm_unpacklo_epi8(lo, hi);
        bytes[1] = _mm_unpackhi_epi8(lo, hi);
      } else {
        bytes[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
        bytes[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16));
      }
      for (int half = 0; half < 2; half++) {
        __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes[half]));
        __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes[half], 8)));
        _mm256_storeu_ps(o + k + half * 16, _mm256_fmadd_ps(q0, sv, bv));
        _mm256_storeu_ps(o + k + half * 16 + 8, _mm256_fmadd_ps(q1, sv, bv));
      }
    }
  }
}

// Where each of 64 consecutive values goes (affine_position within a 4-bit pair, or within two
// 8-bit chunks).
struct SpanOrder {
  uint8_t at[64];
  explicit SpanOrder(Format format) {
    for (int j = 0; j < 64; j++) at[j] = static_cast<uint8_t>(affine_position(j, 64, format));
  }
};

void avx2_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  static const SpanOrder order4(Format::Affine4), order8(Format::Affine8);
  const SpanOrder& order = w.format == Format::Affine4 ? order4 : order8;
  const int K = w.K, gs = w.group_size, groups = K / gs, chunks = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  alignas(32) int16_t natural[64];
  for (int m = 0; m < M; m++) {
    const float* xr = x + static_cast<long>(m) * K;
    int16_t* qr = xq + static_cast<long>(m) * K;
    for (int g = 0; g < groups; g++) {
      const float* xg = xr + g * gs;
      __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int i = 0; i < gs; i += 8) {
        __m256 v = _mm256_loadu_ps(xg + i);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
        vsum = _mm256_add_ps(vsum, v);
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
      xscale[m * groups + g] = amax / 32767.0f;
      xsum[m * groups + g] = hsum(vsum);
      for (int i = 0; i < gs; i += 16) {  // 16 values: two vectors rounded, packed, in order
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i + 8), inv));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(natural + ((g * gs + i) & 63)), packed);
        if (((g * gs + i + 16) & 63) == 0) {  // 64 values (two chunks) are done
          int16_t* span = qr + (g * gs + i + 16 - 64);
          for (int j = 0; j < 64; j++) span[order.at[j]] = natural[j];
        }
      }
    }
    if (chunks & 1) {  // the last chunk without a pair
      int16_t* last = qr + (chunks - 1) * 32;
      for (int j = 0; j < 32; j++) last[affine_position(j, 32, w.format)] = natural[j];
    }
  }
}

}  // namespace

const Kernels* avx2_kernels() {
  static const Kernels kernels{"avx2", avx2_rows, avx2_dequant, avx2_prepare};
  return &kernels;
}

}  // namespace shoal

#else

namespace shoal {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace shoal

#endif
