// Prefill products of affine and MXFP4 weights on AVX-512 VNNI, without sgemm: int16 activations
// (rounded per group, as decode's) times the 4-bit or 8-bit weight values (MXFP4: its codes as
// kE2M1x2's signed values, through a 16-lane table) by `vpdpwssd`, whose 32 products an
// instruction at the FMA's rate are twice sgemm's 16, and which reads weights at 2 bytes each
// instead of a dequantized tile's 4.
//
// A task is a panel of kGemmRows (32) weight rows: unpacked once into int16 pairs, row-interleaved
// ([pair of k][row][2]), with its scales and biases as floats; then for each block of kTokens
// rows of x a micro-kernel keeps 2 x kTokens int32 sums of one group (16 rows of the panel per
// vector, a broadcast pair of x per row of x), scales them into 2 x kTokens float sums at the
// group's end, and stores 32 outputs per row of x. The arithmetic of an output never depends on
// the block it falls in, so a row of x gets the same bits whatever M.
//
// Measured 2026-12-03 (Xeon, 2 threads, bench/kernel_ab.py --rows 512): 0.75-0.83x the time of
// dequantized tiles + OpenBLAS sgemm; 1B prefill through the API 107 -> 138 tok/s (Q4_0). The
// loop runs ~1.25 vpdpwssd a cycle where a register-only loop runs 2; what bounds it is not
// found yet (not L2: blocking K to keep the panel in L1 was slower; not the x stream).
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)

#include <cmath>
#include <cstring>

#include "avx2_util.h"

namespace shoal {
namespace {

// sum += a * b in place: GCC 12's intrinsic copied each accumulator out and back in every step
// (24 register moves per 12 products, half the loop's instructions).
inline __m512i dpwssd(__m512i sum, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "v"(b));
  return sum;
}

constexpr int kTokens = 6;  // rows of x per micro-kernel: 24 of the 32 vector registers hold sums

struct Panel {
  std::vector<int32_t> q;   // K / 2 x kGemmRows: the pair (k, k + 1) of a row as two int16
  std::vector<float> s, b;  // groups x kGemmRows
};

// Rows [n0, n0 + kGemmRows) of w into p (rows past N as zeros). Each dword of 16 rows is gathered
// at once and split into its pairs: 4 (4-bit) or 2 (8-bit) vectors, one pair of 16 rows each.
void pack_panel(const Weights& w, int n0, Panel& p) {
  const int K = w.K, groups = K / w.group_size, rows = std::min(kGemmRows, w.N - n0);
  p.q.resize(static_cast<size_t>(K / 2) * kGemmRows);  // every lane is written below
  p.s.assign(static_cast<size_t>(groups) * kGemmRows, 0.0f);
  p.b.assign(p.s.size(), 0.0f);
  const float z = symmetric_bias(w, 1.0f);
  for (int r = 0; r < rows; r++) {
    const long at = static_cast<long>(n0 + r) * groups;
    for (int g = 0; g < groups; g++) {
      const float s = scale1(w.scales, w.scale_type, at + g);
      p.s[g * kGemmRows + r] = s;
      p.b[g * kGemmRows + r] = w.biases ? scale1(w.biases, w.scale_type, at + g) : z * s;
    }
  }
  const __m512i lo4 = _mm512_set1_epi32(0x0f), lo8 = _mm512_set1_epi32(0xff), lo16 = _mm512_set1_epi32(0xffff);
  // MXFP4: each nibble's kE2M1x2 value, sign-extended to 32 bits, is lane `nibble` of this table.
  const __m512i fp4 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
  const bool four = quant_bits(w.format) == 4, mx4 = w.format == Format::Mxfp4;
  for (int r0 = 0; r0 < kGemmRows; r0 += 16) {  // rows past N: a masked gather reads nothing, gives 0
    const __mmask16 live = static_cast<__mmask16>((1u << std::clamp(rows - r0, 0, 16)) - 1);
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(w.row_bytes)));
    const uint8_t* base = w.data + static_cast<long>(n0 + r0) * w.row_bytes;
    int32_t* out = p.q.data() + r0;
    const int per_dword = four ? 8 : 4;  // weights
    for (int k = 0; k < K; k += per_dword) {
      const int byte = four ? k / 2 : k;
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + byte, 1);
      if (four) {
        for (int j = 0; j < 4; j++) {  // pair j: nibbles 2j (low half) and 2j + 1 (high half)
          __m512i a = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), lo4);
          __m512i b = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j + 4), lo4);
          if (mx4) a = _mm512_and_si512(_mm512_permutexvar_epi32(a, fp4), lo16), b = _mm512_permutexvar_epi32(b, fp4);
          const __m512i pair = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
          _mm512_storeu_si512(out + static_cast<long>(k / 2 + j) * kGemmRows, pair);
        }
      } else {
        for (int j = 0; j < 2; j++) {  // pair j: bytes 2j and 2j + 1
          const __m512i a = _mm512_and_si512(_mm512_srli_epi32(v, 16 * j), lo8);
          const __m512i b = _mm512_and_si512(_mm512_srli_epi32(v, 16 * j + 8), lo8);
          const __m512i pair = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
          _mm512_storeu_si512(out + static_cast<long>(k / 2 + j) * kGemmRows, pair);
        }
      }
    }
  }
}

// MT rows of x (from m0) against a packed panel: y[m, n0 .. n0 + rows).
template <int MT>
void micro(const Panel& p, const Acts& a, int gs, int m0, float* y, long ldy, int n0, int rows) {
  const int K = a.K, groups = a.groups, pairs = gs / 2;
  __m512 acc[MT][2];
  for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int16_t* x = a.xq + static_cast<long>(m0) * K;
  for (int g = 0; g < groups; g++) {
    __m512i sum[MT][2];
    for (int m = 0; m < MT; m++) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    const int32_t* wq = p.q.data() + static_cast<long>(g) * pairs * kGemmRows;
    for (int j = 0; j < pairs; j++) {
      const __m512i w0 = _mm512_loadu_si512(wq + j * kGemmRows), w1 = _mm512_loadu_si512(wq + j * kGemmRows + 16);
      for (int m = 0; m < MT; m++) {
        int32_t pair;
        std::memcpy(&pair, x + static_cast<long>(m) * K + g * gs + 2 * j, 4);
        const __m512i xb = _mm512_set1_epi32(pair);
        sum[m][0] = dpwssd(sum[m][0], w0, xb);
        sum[m][1] = dpwssd(sum[m][1], w1, xb);
      }
    }
    const float *ps = p.s.data() + g * kGemmRows, *pb = p.b.data() + g * kGemmRows;
    const __m512 s0 = _mm512_loadu_ps(ps), s1 = _mm512_loadu_ps(ps + 16);
    const __m512 b0 = _mm512_loadu_ps(pb), b1 = _mm512_loadu_ps(pb + 16);
    for (int m = 0; m < MT; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g;
      const __m512 xs = _mm512_set1_ps(a.xscale[r]), xm = _mm512_set1_ps(a.xsum[r]);
      // acc + b * xsum + sum * (s * xscale), in this order for every output
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][0]), _mm512_mul_ps(s0, xs),
                                  _mm512_fmadd_ps(b0, xm, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][1]), _mm512_mul_ps(s1, xs),
                                  _mm512_fmadd_ps(b1, xm, acc[m][1]));
    }
  }
  const __mmask16 first = static_cast<__mmask16>((1u << std::min(16, rows)) - 1);
  const __mmask16 second = static_cast<__mmask16>(rows > 16 ? (1u << (rows - 16)) - 1 : 0);
  for (int m = 0; m < MT; m++) {
    float* out = y + static_cast<long>(m0 + m) * ldy + n0;
    _mm512_mask_storeu_ps(out, first, acc[m][0]);
    _mm512_mask_storeu_ps(out + 16, second, acc[m][1]);
  }
}

using MicroFn = void (*)(const Panel&, const Acts&, int, int, float*, long, int, int);
constexpr MicroFn kMicro[kTokens] = {micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>};

void avx512_gemm(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  thread_local Panel panel;
  for (int n = n0; n < n1; n += kGemmRows) {
    const int rows = std::min(kGemmRows, n1 - n);
    pack_panel(w, n, panel);
    for (int m0 = 0; m0 < a.M; m0 += kTokens)
      kMicro[std::min(kTokens, a.M - m0) - 1](panel, a, w.group_size, m0, y, ldy, n, rows);
  }
}

// --- The same on int8 activations (kernels.h, Acts): `vpdpbusd`, 4 products a lane, twice
// vpdpwssd's a instruction. The panel holds each row's weights as unsigned bytes, 4 a dword
// ([quad of k][row][4]): 8-bit weights as stored, 4 at a time; 4-bit weights per 8 as the quad of
// their evens, then of their odds (a dword's low and high nibbles: no shuffle), MXFP4's codes as
// kE2M1x2 + kFp4Offset; x is prepared in that order. MXFP4's offset comes off each group's int32
// sums exactly (kFp4Offset x the group's sum of x, an integer).

inline __m512i dpbusd(__m512i sum, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(a), "v"(b));
  return sum;
}

void pack_panel8(const Weights& w, int n0, Panel& p) {
  const int K = w.K, groups = K / w.group_size, rows = std::min(kGemmRows, w.N - n0);
  p.q.resize(static_cast<size_t>(K / 4) * kGemmRows);
  p.s.assign(static_cast<size_t>(groups) * kGemmRows, 0.0f);
  p.b.assign(p.s.size(), 0.0f);
  const float z = symmetric_bias(w, 1.0f);
  for (int r = 0; r < rows; r++) {
    const long at = static_cast<long>(n0 + r) * groups;
    for (int g = 0; g < groups; g++) {
      const float s = scale1(w.scales, w.scale_type, at + g);
      p.s[g * kGemmRows + r] = s;
      p.b[g * kGemmRows + r] = w.biases ? scale1(w.biases, w.scale_type, at + g) : z * s;
    }
  }
  alignas(16) static constexpr int8_t kOffset[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kOffset)));
  const __m512i nibbles = _mm512_set1_epi8(0x0f);
  const bool four = quant_bits(w.format) == 4, mx4 = w.format == Format::Mxfp4;
  for (int r0 = 0; r0 < kGemmRows; r0 += 16) {  // rows past N: a masked gather reads nothing, gives 0
    const __mmask16 live = static_cast<__mmask16>((1u << std::clamp(rows - r0, 0, 16)) - 1);
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(w.row_bytes)));
    const uint8_t* base = w.data + static_cast<long>(n0 + r0) * w.row_bytes;
    int32_t* out = p.q.data() + r0;
    for (int k = 0; k < K; k += four ? 8 : 4) {
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + (four ? k / 2 : k), 1);
      if (!four) {
        _mm512_storeu_si512(out + static_cast<long>(k / 4) * kGemmRows, v);
        continue;
      }
      __m512i even = _mm512_and_si512(v, nibbles), odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles);
      if (mx4) even = _mm512_shuffle_epi8(lut, even), odd = _mm512_shuffle_epi8(lut, odd);
      _mm512_storeu_si512(out + static_cast<long>(k / 4) * kGemmRows, even);
      _mm512_storeu_si512(out + static_cast<long>(k / 4 + 1) * kGemmRows, odd);
    }
  }
}

template <int MT>
void micro8(const Panel& p, const Acts& a, int gs, bool fp4, int m0, float* y, long ldy, int n0, int rows) {
  const int K = a.K, groups = a.groups, quads = gs / 4;
  __m512 acc[MT][2];
  for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int16_t* x = a.xq + static_cast<long>(m0) * K;  // each row's K bytes at its place (Acts)
  for (int g = 0; g < groups; g++) {
    __m512i sum[MT][2];
    for (int m = 0; m < MT; m++) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    const int32_t* wq = p.q.data() + static_cast<long>(g) * quads * kGemmRows;
    for (int j = 0; j < quads; j++) {
      const __m512i w0 = _mm512_loadu_si512(wq + j * kGemmRows), w1 = _mm512_loadu_si512(wq + j * kGemmRows + 16);
      for (int m = 0; m < MT; m++) {
        int32_t quad;
        std::memcpy(&quad, reinterpret_cast<const int8_t*>(x + static_cast<long>(m) * K) + g * gs + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        sum[m][0] = dpbusd(sum[m][0], w0, xb);
        sum[m][1] = dpbusd(sum[m][1], w1, xb);
      }
    }
    const float *ps = p.s.data() + g * kGemmRows, *pb = p.b.data() + g * kGemmRows;
    const __m512 s0 = _mm512_loadu_ps(ps), s1 = _mm512_loadu_ps(ps + 16);
    const __m512 b0 = _mm512_loadu_ps(pb), b1 = _mm512_loadu_ps(pb + 16);
    for (int m = 0; m < MT; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g;
      const float xscale = a.xscale[r];
      if (fp4 && xscale > 0.0f) {  // the offset's products: kFp4Offset x the group's (integer) sum of x
        const __m512i off = _mm512_set1_epi32(kFp4Offset * static_cast<int>(std::nearbyint(a.xsum[r] / xscale)));
        sum[m][0] = _mm512_sub_epi32(sum[m][0], off), sum[m][1] = _mm512_sub_epi32(sum[m][1], off);
      }
      const __m512 xs = _mm512_set1_ps(xscale), xm = _mm512_set1_ps(a.xsum[r]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][0]), _mm512_mul_ps(s0, xs),
                                  _mm512_fmadd_ps(b0, xm, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m][1]), _mm512_mul_ps(s1, xs),
                                  _mm512_fmadd_ps(b1, xm, acc[m][1]));
    }
  }
  const __mmask16 first = static_cast<__mmask16>((1u << std::min(16, rows)) - 1);
  const __mmask16 second = static_cast<__mmask16>(rows > 16 ? (1u << (rows - 16)) - 1 : 0);
  for (int m = 0; m < MT; m++) {
    float* out = y + static_cast<long>(m0 + m) * ldy + n0;
    _mm512_mask_storeu_ps(out, first, acc[m][0]);
    _mm512_mask_storeu_ps(out + 16, second, acc[m][1]);
  }
}

using Micro8Fn = void (*)(const Panel&, const Acts&, int, bool, int, float*, long, int, int);
constexpr Micro8Fn kMicro8[kTokens] = {micro8<1>, micro8<2>, micro8<3>, micro8<4>, micro8<5>, micro8<6>};

void avx512_gemm8(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  thread_local Panel panel;
  const bool fp4 = w.format == Format::Mxfp4;
  for (int n = n0; n < n1; n += kGemmRows) {
    const int rows = std::min(kGemmRows, n1 - n);
    pack_panel8(w, n, panel);
    for (int m0 = 0; m0 < a.M; m0 += kTokens)
      kMicro8[std::min(kTokens, a.M - m0) - 1](panel, a, w.group_size, fp4, m0, y, ldy, n, rows);
  }
}

// gemm8's activations: x rounded to int8 per group (as int8_prepare), each row's K bytes at the
// start of its place, 4-bit weights' in the panel's order (per 8: evens, then odds).
void gemm8_prepare(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum) {
  const int K = w.K, gs = w.group_size, groups = K / gs;
  const bool four = quant_bits(w.format) == 4;
  for (int m = 0; m < M; m++) {
    const float* xr = x + static_cast<long>(m) * K;
    int8_t* qr = reinterpret_cast<int8_t*>(xq + static_cast<long>(m) * K);
    for (int g = 0; g < groups; g++) {
      const float* xg = xr + g * gs;
      __m512 vmax = _mm512_setzero_ps();
      for (int i = 0; i < gs; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xg + i)));
      const float amax = _mm512_reduce_max_ps(vmax);
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      // per 8 values (4-bit): evens then odds, i.e. lanes 0 2 4 6 1 3 5 7 of each 8
      const __m512i order = four ? _mm512_set_epi32(15, 13, 11, 9, 14, 12, 10, 8, 7, 5, 3, 1, 6, 4, 2, 0)
                                 : _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      __m512i total = _mm512_setzero_si512();
      for (int i = 0; i < gs; i += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + i), inv));
        total = _mm512_add_epi32(total, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + g * gs + i), _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(order, q)));
      }
      xscale[m * groups + g] = amax / 127.0f;
      xsum[m * groups + g] = static_cast<float>(_mm512_reduce_add_epi32(total)) * (amax / 127.0f);
    }
  }
}

}  // namespace

RowsFn avx512_gemm_kernel() { return avx512_gemm; }
RowsFn avx512_gemm8_kernel() { return avx512_gemm8; }
PrepareFn avx512_gemm8_prepare() { return gemm8_prepare; }

}  // namespace shoal

#else

namespace shoal {
RowsFn avx512_gemm_kernel() { return nullptr; }
RowsFn avx512_gemm8_kernel() { return nullptr; }
PrepareFn avx512_gemm8_prepare() { return nullptr; }
}  // namespace shoal

#endif
