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
#include "avx512_int8.h"

namespace shoal {
namespace {

// sum += a * b in place: GCC 12's intrinsic copied each accumulator out and back in every step
// (24 register moves per 12 products, half the loop's instructions).
inline __m512i dpwssd(__m512i sum, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(sum) : "v"(a), "v"(b));
  return sum;
}

inline __m512i dpbusd(__m512i sum, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(a), "v"(b));
  return sum;
}

constexpr int kTokens = 6;  // rows of x per micro-kernel: 24 of the 32 vector registers hold sums

struct Panel {
  std::vector<int32_t> q;   // K / 2 x kGemmRows pairs of int16 (pack_panel), or K / 4 of bytes (pack_panel8)
  std::vector<float> s, b;  // groups x kGemmRows
};

// The panel's scales and biases as floats, [group][row] (rows past `rows` as zeros).
void panel_scales(const Weights& w, int n0, int rows, Panel& p) {
  const int groups = w.K / w.group_size;
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
}

// fn(k, v, out) for each dword of weights [k, k + per_dword) of 16 panel rows at a time, gathered
// at once (v; rows past `rows`: a masked gather reads nothing, gives 0), out those rows' lanes.
template <typename Fn>
void gather_dwords(const Weights& w, int n0, int rows, int per_dword, Panel& p, Fn fn) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i offsets = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(w.row_bytes)));
  const int bytes = per_dword == 8 ? 2 : 1;  // weights a byte
  for (int r0 = 0; r0 < kGemmRows; r0 += 16) {
    const __mmask16 live = static_cast<__mmask16>((1u << std::clamp(rows - r0, 0, 16)) - 1);
    const uint8_t* base = w.data + static_cast<long>(n0 + r0) * w.row_bytes;
    for (int k = 0; k < w.K; k += per_dword)
      fn(k, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offsets, base + k / bytes, 1), p.q.data() + r0);
  }
}

// Rows [n0, n0 + kGemmRows) of w into p (rows past N as zeros). Each dword of 16 rows is gathered
// at once and split into its pairs: 4 (4-bit) or 2 (8-bit) vectors, one pair of 16 rows each.
void pack_panel(const Weights& w, int n0, Panel& p) {
  const int K = w.K, rows = std::min(kGemmRows, w.N - n0);
  p.q.resize(static_cast<size_t>(K / 2) * kGemmRows);  // every lane is written below
  panel_scales(w, n0, rows, p);
  const __m512i lo4 = _mm512_set1_epi32(0x0f), lo8 = _mm512_set1_epi32(0xff), lo16 = _mm512_set1_epi32(0xffff);
  // MXFP4: each nibble's kE2M1x2 value, sign-extended to 32 bits, is lane `nibble` of this table.
  const __m512i fp4 = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1x2)));
  const bool four = quant_bits(w.format) == 4, mx4 = w.format == Format::Mxfp4;
  gather_dwords(w, n0, rows, four ? 8 : 4, p, [&](int k, __m512i v, int32_t* out) {
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
  });
}

// The byte panel for int8 activations (kernels.h, Acts; micro<MT, true>): each row's weights as
// unsigned bytes, 4 a dword ([quad of k][row][4]): 8-bit weights as stored, 4 at a time; 4-bit
// weights per 8 as the quad of their evens, then of their odds (a dword's low and high nibbles: no
// shuffle), MXFP4's codes as kE2M1x2 + kFp4Offset. x comes in that order (avx512_int8.h,
// gemm8_prepare); MXFP4's offset comes off each group's int32 sums exactly (kFp4Offset x the
// group's sum of x, an integer).
void pack_panel8(const Weights& w, int n0, Panel& p) {
  const int K = w.K, rows = std::min(kGemmRows, w.N - n0);
  p.q.resize(static_cast<size_t>(K / 4) * kGemmRows);
  panel_scales(w, n0, rows, p);
  const bool four = quant_bits(w.format) == 4, mx4 = w.format == Format::Mxfp4;
  gather_dwords(w, n0, rows, four ? 8 : 4, p, [&](int k, __m512i v, int32_t* out) {
    if (!four) {
      _mm512_storeu_si512(out + static_cast<long>(k / 4) * kGemmRows, v);
      return;
    }
    __m512i even, odd;
    if (mx4) {
      int8_nibbles<true>(v, &even, &odd);
    } else {
      int8_nibbles<false>(v, &even, &odd);
    }
    _mm512_storeu_si512(out + static_cast<long>(k / 4) * kGemmRows, even);
    _mm512_storeu_si512(out + static_cast<long>(k / 4 + 1) * kGemmRows, odd);
  });
}

// MT rows of x (from m0) against a packed panel: y[m, n0 .. n0 + rows). I8: int8 x and a byte
// panel (4 values a dword, `vpdpbusd`; FP4: MXFP4's offset comes off the sums); else int16 x and
// a pair panel (2 a dword, `vpdpwssd`).
template <int MT, bool I8>
void micro(const Panel& p, const Acts& a, int gs, bool fp4, int m0, float* y, long ldy, int n0, int rows) {
  constexpr int per = I8 ? 4 : 2;  // values of x per dword
  const int K = a.K, groups = a.groups, dwords = gs / per;
  __m512 acc[MT][2];
  for (int m = 0; m < MT; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int16_t* x = a.xq + static_cast<long>(m0) * K;  // row m's place: x + m * K (int8: its bytes)
  for (int g = 0; g < groups; g++) {
    __m512i sum[MT][2];
    for (int m = 0; m < MT; m++) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    const int32_t* wq = p.q.data() + static_cast<long>(g) * dwords * kGemmRows;
    for (int j = 0; j < dwords; j++) {
      const __m512i w0 = _mm512_loadu_si512(wq + j * kGemmRows), w1 = _mm512_loadu_si512(wq + j * kGemmRows + 16);
      for (int m = 0; m < MT; m++) {
        const int16_t* xm = x + static_cast<long>(m) * K;
        int32_t word;
        if constexpr (I8) {
          std::memcpy(&word, reinterpret_cast<const int8_t*>(xm) + g * gs + 4 * j, 4);
        } else {
          std::memcpy(&word, xm + g * gs + 2 * j, 4);
        }
        const __m512i xb = _mm512_set1_epi32(word);
        sum[m][0] = I8 ? dpbusd(sum[m][0], w0, xb) : dpwssd(sum[m][0], w0, xb);
        sum[m][1] = I8 ? dpbusd(sum[m][1], w1, xb) : dpwssd(sum[m][1], w1, xb);
      }
    }
    const float *ps = p.s.data() + g * kGemmRows, *pb = p.b.data() + g * kGemmRows;
    const __m512 s0 = _mm512_loadu_ps(ps), s1 = _mm512_loadu_ps(ps + 16);
    const __m512 b0 = _mm512_loadu_ps(pb), b1 = _mm512_loadu_ps(pb + 16);
    for (int m = 0; m < MT; m++) {
      const long r = static_cast<long>(m0 + m) * groups + g;
      const float xscale = a.xscale[r];
      if (I8 && fp4 && xscale > 0.0f) {  // the offset's products: kFp4Offset x the group's (integer) sum of x
        const __m512i off = _mm512_set1_epi32(kFp4Offset * static_cast<int>(std::nearbyint(a.xsum[r] / xscale)));
        sum[m][0] = _mm512_sub_epi32(sum[m][0], off), sum[m][1] = _mm512_sub_epi32(sum[m][1], off);
      }
      const __m512 xs = _mm512_set1_ps(xscale), xm = _mm512_set1_ps(a.xsum[r]);
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

// Output rows [n0, n1) a panel at a time (I8: byte panels and int8 x).
template <bool I8>
void avx512_gemm(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1) {
  using MicroFn = void (*)(const Panel&, const Acts&, int, bool, int, float*, long, int, int);
  constexpr MicroFn kMicro[kTokens] = {micro<1, I8>, micro<2, I8>, micro<3, I8>,
                                       micro<4, I8>, micro<5, I8>, micro<6, I8>};
  thread_local Panel panel;
  const bool fp4 = w.format == Format::Mxfp4;
  for (int n = n0; n < n1; n += kGemmRows) {
    const int rows = std::min(kGemmRows, n1 - n);
    if constexpr (I8) {
      pack_panel8(w, n, panel);
    } else {
      pack_panel(w, n, panel);
    }
    for (int m0 = 0; m0 < a.M; m0 += kTokens)
      kMicro[std::min(kTokens, a.M - m0) - 1](panel, a, w.group_size, fp4, m0, y, ldy, n, rows);
  }
}

}  // namespace

RowsFn avx512_gemm_kernel() { return avx512_gemm<false>; }
RowsFn avx512_gemm8_kernel() { return avx512_gemm<true>; }

}  // namespace shoal

#else

namespace shoal {
RowsFn avx512_gemm_kernel() { return nullptr; }
RowsFn avx512_gemm8_kernel() { return nullptr; }
}  // namespace shoal

#endif
