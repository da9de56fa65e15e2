// What the AVX2 and AVX-512 kernels share: scales as stored, a weight row's prologue (row_scales),
// the 32-byte products of a row's tail, the rows loop and `prepare`. Included only by files
// compiled with at least -mavx2 -mfma -mf16c.
// Everything here is in an anonymous namespace on purpose: each file gets its own copy compiled
// with its own instruction-set flags, so the linker can never hand the AVX-512 build of a helper
// to the AVX2 path (which runs on CPUs without AVX-512).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace shoal {
namespace {  // NOLINT(google-build-namespaces): see above

// Bytes ahead of the weight stream (-DSHOAL_PREFETCH=... to tune). Measured 2026-12-05 (Xeon, 480 MB
// L3, weights on huge pages, 800 MB of 1B MLP matrices, M = 1, 2 threads; GB/s 4-bit / 8-bit):
// 1024: 22.5 / 27.3, 2048: 23.7 / 27.1, 4096: 23.3 / 24.7; 1B decode (tok/s, Q4_0 / Q8_0)
// 36.9-37.2 / 23.1-23.5 at 2048 against 33.6-35.1 / 21.3-21.8 at 4096. The AMD EPYC (Zen 4)
// measured no difference from 1024 to 16384.
#ifndef SHOAL_PREFETCH
#define SHOAL_PREFETCH 2048
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
  if (t == ScaleType::E8M0) {  // 2^(e - 128): the float 2^(e - 127) halved; e = 0 (no such float) at the floor
    const __m128i e = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i));
    const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(e), 23));
    return _mm256_max_ps(_mm256_mul_ps(f, _mm256_set1_ps(0.5f)), _mm256_set1_ps(0x1p-128f));
  }
  if (t == ScaleType::F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const uint16_t* h = static_cast<const uint16_t*>(p) + i;
  return t == ScaleType::F16 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))) : load_bf16x8(h);
}

inline float scale1(const void* p, ScaleType t, long i) {
  if (t == ScaleType::E8M0) return e8m0_scale(static_cast<const uint8_t*>(p)[i]);
  if (t == ScaleType::F32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return t == ScaleType::F16 ? _cvtsh_ss(h) : bf16_scalar(h);
}

// Biases i .. i + 7 given scales s: stored, or b = -2^(bits-1) s for symmetric weights.
inline __m256 biases8(const Weights& w, long i, __m256 s, float z) {
  return w.biases ? scales8(w.biases, w.scale_type, i) : _mm256_mul_ps(s, _mm256_set1_ps(z));
}

// Lane indices that repeat each of 8 values 2 (groups of 64) or 4 times (groups of 128).
alignas(32) constexpr int kRepeat2[2][8] = {{0, 0, 1, 1, 2, 2, 3, 3}, {4, 4, 5, 5, 6, 6, 7, 7}};
alignas(32) constexpr int kRepeat4[4][8] = {
    {0, 0, 0, 0, 1, 1, 1, 1}, {2, 2, 2, 2, 3, 3, 3, 3}, {4, 4, 4, 4, 5, 5, 5, 5}, {6, 6, 6, 6, 7, 7, 7, 7}};

// MXFP4: nibble j of every 16-bit lane of v as kE2M1x2's signed value, in q[j] (affine 4-bit
// takes nibble j as it is). A byte shuffle of each byte's low and high nibble, then each lane's two
// bytes sign-extended.
inline void fp4_nibbles(__m128i v, __m128i* q) {
  const __m128i mask = _mm_set1_epi8(0x0f), lut = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2));
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, mask));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), mask));
  q[0] = _mm_srai_epi16(_mm_slli_epi16(lo, 8), 8), q[1] = _mm_srai_epi16(_mm_slli_epi16(hi, 8), 8);
  q[2] = _mm_srai_epi16(lo, 8), q[3] = _mm_srai_epi16(hi, 8);
}
inline void fp4_nibbles(__m256i v, __m256i* q) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
  const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask));
  const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
  q[0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8), q[1] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
  q[2] = _mm256_srai_epi16(lo, 8), q[3] = _mm256_srai_epi16(hi, 8);
}

// The int32 products of one 32-weight chunk with one row of xq, in its affine_position order:
// 8-bit, 8 lanes; 4-bit (a chunk without a pair; FP4: MXFP4), 4 lanes in the low half.
template <int BITS, bool FP4 = false>
inline __m256i chunk_product(const uint8_t* bytes, const int16_t* xq) {
  const __m256i* x = reinterpret_cast<const __m256i*>(xq);
  if constexpr (BITS == 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)), mask = _mm_set1_epi16(0x0f);
    __m128i q[4] = {_mm_and_si128(v, mask), _mm_and_si128(_mm_srli_epi16(v, 4), mask),
                    _mm_and_si128(_mm_srli_epi16(v, 8), mask), _mm_srli_epi16(v, 12)};
    if constexpr (FP4) fp4_nibbles(v, q);
    const __m128i* x4 = reinterpret_cast<const __m128i*>(xq);
    __m128i sum = _mm_madd_epi16(q[0], _mm_loadu_si128(x4));
    for (int j = 1; j < 4; j++) sum = _mm_add_epi32(sum, _mm_madd_epi16(q[j], _mm_loadu_si128(x4 + j)));
    return _mm256_zextsi128_si256(sum);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0xff)), _mm256_loadu_si256(x)),
                            _mm256_madd_epi16(_mm256_srli_epi16(v, 8), _mm256_loadu_si256(x + 1)));
  }
}

// A 4-bit pair of chunks' 32 bytes as 16 lanes of 4 nibbles (nibble j of every lane in q[j]).
template <bool FP4>
inline void pair_values(__m256i v, __m256i* q) {
  const __m256i mask = _mm256_set1_epi16(0x0f);
  q[0] = _mm256_and_si256(v, mask), q[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  q[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), mask), q[3] = _mm256_srli_epi16(v, 12);
  if constexpr (FP4) fp4_nibbles(v, q);
}

// The int32 sums of a 4-bit pair's values q against one row of int16 x from the pair's first
// value: lanes 0-3 chunk c, 4-7 chunk c + 1.
inline __m256i pair_sums(const __m256i* q, const int16_t* xq) {
  const __m256i* x = reinterpret_cast<const __m256i*>(xq);
  const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(q[0], _mm256_loadu_si256(x)),
                                      _mm256_madd_epi16(q[1], _mm256_loadu_si256(x + 1)));
  const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(q[2], _mm256_loadu_si256(x + 2)),
                                      _mm256_madd_epi16(q[3], _mm256_loadu_si256(x + 3)));
  return _mm256_add_epi32(p0, p1);
}

// Chunks c and c + 1 of one weight row against MB rows of xq (row stride K), added to `into`.
template <int BITS, int MB, bool FP4 = false>
__attribute__((always_inline)) inline void pair_into(const uint8_t* row, const int16_t* xq, int K, const float* sxc,
                                                     int chunks, int c, __m256* into) {
  constexpr int chunk_bytes = 32 * BITS / 8;
  if constexpr (BITS == 4) {
    __m256i q[4];
    pair_values<FP4>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * chunk_bytes)), q);
    for (int m = 0; m < MB; m++) {
      const float* sx = sxc + m * chunks + c;
      const __m256 f = _mm256_cvtepi32_ps(pair_sums(q, xq + static_cast<long>(m) * K + c * 32));
      const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(sx + 1), _mm_broadcast_ss(sx));
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
// Groups go 8 at a time; a row's last groups % 8 go as its last 8 again, whose repeated lanes
// store the same products and add nothing to the bias sums (one by one, those groups cost SmolLM2's
// K = 576 rows a sixth of their decode time). Fewer than 8 groups in all (K < 256) go one by one.
template <int MB>
inline void row_scales(const Weights& w, const Acts& a, int n, int m0, float* sxc) {
  const int groups = a.groups, chunks = w.K / 32, per_group = w.group_size / 32;
  const long at = static_cast<long>(n) * groups;  // the row's first scale
  const float z = symmetric_bias(w, 1.0f);
  float* bias_sum = sxc + MB * chunks;  // per row of x: the sum over groups of bias x activation sum
  __m256 bsum[MB];
  for (int m = 0; m < MB; m++) bsum[m] = _mm256_setzero_ps();
  // 8 groups' products, each repeated for its chunks; `fresh` masks out the lanes of groups a
  // row's overlapped last 8 already had (all lanes but in that block).
  auto block = [&](int g8, __m256 fresh) {
    const __m256 s = scales8(w.scales, w.scale_type, at + g8);
    const __m256 b = _mm256_and_ps(biases8(w, at + g8, s, z), fresh);
    for (int m = 0; m < MB; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g8;
      bsum[m] = _mm256_fmadd_ps(b, _mm256_loadu_ps(a.xsum + r), bsum[m]);
      const __m256 v = _mm256_mul_ps(s, _mm256_loadu_ps(a.xscale + r));
      float* out = sxc + m * chunks + g8 * per_group;
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
  };
  const __m256 all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int g = 0;
  for (; groups >= 8 && g + 8 <= groups; g += 8) block(g, all);
  if (groups >= 8 && g < groups) {  // the last groups % 8: the row's last 8, the repeated lanes masked
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    block(groups - 8, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(7 - (groups - g)))));
    g = groups;
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

// The row bodies each ISA's file defines for vector_rows: one affine weight row's products after
// its prologue (row_scales), and one 16-bit weight row's, against rows [m0, m0 + MB) of x.
template <int BITS, int MB, bool FP4 = false>
void affine_body(const Weights& w, const Acts& a, const uint8_t* row, const float* sxc, float* y, long ldy, int n,
                 int m0);
// A dense row (F16, BF16, F32) against rows [m0, m0 + MB) of x (float32, read directly).
template <Format F, int MB>
void dense_row(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0);
// Weight j of a dense row as a float (the tail past the vector steps).
template <Format F>
inline float dense_scalar(const uint8_t* row, int j) {
  if constexpr (F == Format::F32) {
    return reinterpret_cast<const float*>(row)[j];
  } else {
    const uint16_t h = reinterpret_cast<const uint16_t*>(row)[j];
    return F == Format::BF16 ? bf16_scalar(h) : _cvtsh_ss(h);
  }
}
// Bytes of one weight of a dense row.
template <Format F>
constexpr int kDenseBytes = F == Format::F32 ? 4 : 2;
// How an ISA's rows kernel takes a quantized row: after a prologue of its scales (AVX2), or with
// its scales in registers (AVX-512: register_body) on int16 or int8 activations (Acts).
enum class Body { Prologue, Int16, Int8 };

// The AVX-512 body of a quantized row (BITS 4 or 8; FP4: MXFP4; I8: int8 activations): avx512.cpp.
template <int BITS, int MB, bool FP4, bool I8>
void register_body(const Weights& w, const Acts& a, const uint8_t* row, float* y, long ldy, int n, int m0);

// A weight row against rows [m0, m0 + MB) of x through the row bodies (quantized ones: Prologue only).
template <int MB, Body B>
void row_block(const Weights& w, const Acts& a, const uint8_t* row, float* sx, float* y, long ldy, int n, int m0) {
  if (w.format == Format::F16) return dense_row<Format::F16, MB>(w, a, row, y, ldy, n, m0);
  if (w.format == Format::BF16) return dense_row<Format::BF16, MB>(w, a, row, y, ldy, n, m0);
  if (w.format == Format::F32) return dense_row<Format::F32, MB>(w, a, row, y, ldy, n, m0);
  if constexpr (B == Body::Prologue) {
    row_scales<MB>(w, a, n, m0, sx);
    const auto body = w.format == Format::Affine4 ? affine_body<4, MB>
                      : w.format == Format::Mxfp4 ? affine_body<4, MB, true>
                                                  : affine_body<8, MB>;
    body(w, a, row, sx, y, ldy, n, m0);
  }
}

// The `rows` kernel of an ISA (through its row bodies). Rows of x go in blocks of at most 4 per
// pass over a weight row (more would spill registers; the row is still in L1 for the second pass).
template <Body B = Body::Prologue>
void vector_rows(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  using BlockFn = void (*)(const Weights&, const Acts&, const uint8_t*, float*, float*, long, int, int);
  constexpr BlockFn blocks[4] = {row_block<1, B>, row_block<2, B>, row_block<3, B>, row_block<4, B>};
  thread_local std::vector<float> sx;  // scale x activation scale of each chunk, for 4 rows of x
  const long per_row = 4l * (w.K / 32) + 8;
  sx.resize(static_cast<size_t>(2 * per_row));
  if constexpr (B != Body::Prologue) {
    if (is_grouped(w.format)) {  // the body chosen once: rows of x in blocks of up to 4
      using RowFn = void (*)(const Weights&, const Acts&, const uint8_t*, float*, long, int, int);
      constexpr bool I8 = B == Body::Int8;
      const auto pick = [&](auto mb) -> RowFn {
        constexpr int MB = decltype(mb)::value;
        return w.format == Format::Mxfp4   ? register_body<4, MB, true, I8>
               : w.format == Format::Affine4 ? register_body<4, MB, false, I8>
                                             : register_body<8, MB, false, I8>;
      };
      const RowFn bodies[4] = {pick(std::integral_constant<int, 1>{}), pick(std::integral_constant<int, 2>{}),
                               pick(std::integral_constant<int, 3>{}), pick(std::integral_constant<int, 4>{})};
      for (int n = n0; n < n1; n++) {
        const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
        for (int m0 = 0; m0 < a.M; m0 += 4) bodies[std::min(4, a.M - m0) - 1](w, a, row, y, ldy, n, m0);
      }
      return;
    }
  }
  if constexpr (B == Body::Prologue) {
    if (a.M == 1 && is_grouped(w.format) && n0 < n1) {
      // Decode: the next row's prologue is written before this row's products read theirs, so
      // those reads never wait on the stores just made (their forwarding stalled a short row's loads).
      const auto body = w.format == Format::Affine4 ? affine_body<4, 1>
                        : w.format == Format::Mxfp4 ? affine_body<4, 1, true>
                                                    : affine_body<8, 1>;
      row_scales<1>(w, a, n0, 0, sx.data());
      for (int n = n0; n < n1; n++) {
        if (n + 1 < n1) row_scales<1>(w, a, n + 1, 0, sx.data() + ((n + 1 - n0) & 1) * per_row);
        body(w, a, w.data + static_cast<long>(n) * w.row_bytes, sx.data() + ((n - n0) & 1) * per_row, y, ldy, n, 0);
      }
      return;
    }
  }
  for (int n = n0; n < n1; n++) {
    const uint8_t* row = w.data + static_cast<long>(n) * w.row_bytes;
    for (int m0 = 0; m0 < a.M; m0 += 4) blocks[std::min(4, a.M - m0) - 1](w, a, row, sx.data(), y, ldy, n, m0);
  }
}

// Where each value of a span of 1, 2 or 4 chunks goes (at[log2 span]), for kernels reading
// STEP bytes at a time (affine_position).
template <int STEP>
struct SpanOrders {
  uint8_t at[3][128];
  explicit SpanOrders(Format format) {
    for (int l = 0; l < 3; l++)
      for (int e = 0; e < (32 << l); e++) at[l][e] = static_cast<uint8_t>(affine_position(e, 32 << l, format, STEP));
  }
};

// M rows of x rounded to int16 per group at the group's own scale (as prepare_acts: the same
// values), in natural order: `gemm_prepare` for the prefill kernels, and the first half of
// vector_prepare.
inline void natural_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  const int K = w.K, gs = w.group_size, groups = K / gs;
  const __m256 sign = _mm256_set1_ps(-0.0f);
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
        __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), inv));
        __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i + 8), inv));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qr + g * gs + i), packed);
      }
    }
  }
}

// The `prepare` of kernels reading STEP bytes of a weight row at a time: natural_prepare's values,
// moved span by span to where the kernel reads them.
template <int STEP>
void vector_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  static const SpanOrders<STEP> order4(Format::Affine4), order8(Format::Affine8);
  const SpanOrders<STEP>& order = quant_bits(w.format) == 4 ? order4 : order8;  // MXFP4 as Affine4
  const int K = w.K, groups = K / w.group_size, chunks = K / 32;
  const int span = STEP * 8 / (32 * quant_bits(w.format));
  thread_local std::vector<int16_t> natural;
  natural.resize(static_cast<size_t>(K));
  for (int m = 0; m < M; m++) {
    natural_prepare(w, x + static_cast<long>(m) * K, 1, natural.data(), xscale + m * groups, xsum + m * groups);
    int16_t* qr = xq + static_cast<long>(m) * K;
    int c = 0;  // whole spans, then the rest in spans of half a span, a quarter, ...
    for (int size = span, l = span == 4 ? 2 : span - 1; size >= 1; size /= 2, l--) {
      for (; c + size <= chunks; c += size) {
        const int16_t* from = natural.data() + c * 32;
        int16_t* to = qr + c * 32;
        for (int e = 0; e < 32 * size; e++) to[order.at[l][e]] = from[e];
      }
    }
  }
}

}  // namespace
}  // namespace shoal
