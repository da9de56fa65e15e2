// The weight layouts the kernels read as stored, and the kernel table chosen at run time.
//
// Layouts (all row-major, one row per output feature, as nn.Linear and MLX store them):
// - Affine4 / Affine8: MLX's affine quantization. A row of K weights packs 32/bits values per
//   little-endian uint32 word, element i at bit (i * bits) % 32 (so for 4 bits byte b holds
//   elements 2b in its low and 2b+1 in its high nibble). Each group of `group_size` (32, 64, 128)
//   consecutive weights has a scale s and a bias b: w = s * q + b. Symmetric files (GGUF Q4_0,
//   Q8_0) have b = -2^(bits-1) s throughout; such weights come without biases (nullptr), which
//   saves their bytes in memory and in every product (2 of Q4_0's 20 bytes per 32 weights). Scales and biases are float32,
//   float16 or bfloat16, N x K / group_size.
// - Mxfp4: OCP MXFP4 as MLX stores it (mode "mxfp4"; gpt-oss, GGUF MXFP4): Affine4's packing of
//   4-bit E2M1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated), one E8M0 scale byte e per
//   32 weights (w = E2M1 * 2^(e - 127)), no biases. The kernels read a code as twice its value, an
//   int8 in [-12, 12] (kE2M1x2), times 2^(e - 128), so it runs Affine4's integer products as stored.
// - F16 / BF16 / F32: plain weights (F32: the float32 layers a quantized file keeps, such as GGUF's
//   expert routers, which would otherwise go to a BLAS call and its own threads at every step).
//
// Products are y[m, n] = sum_k x[m, k] * w[n, k] for M rows of x (float32).
#pragma once

#include <cmath>
#include <cstdint>

namespace shoal {

enum class Format { Affine4, Affine8, Mxfp4, F16, BF16, F32 };
enum class ScaleType { F32, F16, BF16, E8M0 };

struct Weights {
  Format format;
  const uint8_t* data;
  long row_bytes;
  const void* scales;  // affine only
  const void* biases;  // affine only; nullptr: symmetric, b = -2^(bits-1) s
  ScaleType scale_type;
  int group_size;  // affine only
  int N, K;
};

// Activations as the small-batch affine kernels read them: x quantized to int16 per weight group
// (the int16 x 4/8-bit products run on integer multiply-adds at twice the rate of float FMAs,
// and an int16 grid keeps the relative error near 1e-5, far below the weights' own).
// Kernels with int8 bodies (AVX-512 VNNI, avx512_int8.h; experts' products by default, every
// quantized product with SHOAL_KERNEL_ACTS=int8, none with SHOAL_KERNEL_ACTS=int16: matmul.h) take
// quantized weights' activations as int8 instead, as llama.cpp does (its Q8 activations): a byte
// product does twice the multiply-adds of an int16 one per instruction, on half the unpacking, and
// the rows kernel is bound by those instructions, not by memory. Each x then moves by at most half
// its group's step, amax / 254 (checked against that bound: tests/kernel_error.py): with the
// outliers of real activations, ~0.5-2% of a product's largest output (SmolLM2-135M), enough to
// turn its near-ties, so int16 stays the default outside experts. Their order: 8-bit weights', x's own; 4-bit
// weights', a span of S chunks (as affine_position's: 4 chunks, then 2, then 1) is its 16S evens,
// then its 16S odds (a weight byte's low and high nibbles); for MXFP4, the int32 after the K bytes
// are, per 8 values of a chunk in a product's lanes, -kFp4Offset x their sum (kFp4Offset).
struct Acts {
  int M, K, groups;
  const float* x;       // M x K, row-major
  const int16_t* xq;    // M x K, in the order the kernel unpacks the weights: affine_position
                        // (int8: a row's place holds K bytes, then for MXFP4 K / 8 int32 sums)
  const float* xscale;  // M x groups: x = xq * xscale within a group
  const float* xsum;    // M x groups: the sum of x over the group (int8: of xq * xscale, the x used)
  const struct Kernels* kernels = nullptr;  // the set that prepared xq, whose `rows` reads it
                                            // (nullptr: active_kernels(); dense weights: any)
};

// Rows [n0, n1) of the product into y[m * ldy + n].
using RowsFn = void (*)(const Weights& w, const Acts& a, float* y, long ldy, int n0, int n1);
// Rows [n0, n1) of w as float32, row after row (n1 - n0) x K: the prefill path feeds them to sgemm.
using DequantFn = void (*)(const Weights& w, int n0, int n1, float* out);
// Fill xq / xscale / xsum from M rows of x for this layout (the buffers are the caller's).
using PrepareFn = void (*)(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum);

struct Kernels {
  const char* name;
  RowsFn rows;
  DequantFn dequant;
  PrepareFn prepare;
  // Prefill of affine weights without sgemm (nullptr: dequantized tiles and sgemm): `gemm` for
  // output rows [n0, n1), a multiple of kGemmRows apart, of activations `gemm_prepare` filled.
  RowsFn gemm = nullptr;
  PrepareFn gemm_prepare = nullptr;
  bool int8 = false;  // quantized weights' activations are int8 (Acts), not int16
};

constexpr int kMaxRows = 8;  // x with up to this many rows runs `rows`; more go to sgemm tiles or `gemm`
constexpr int kGemmRows = 32;  // weight rows per `gemm` panel

const Kernels& portable_kernels();
// The AVX2+FMA+F16C kernels, or nullptr when this build has none.
const Kernels* avx2_kernels();
// The AVX-512 (F, BW, VL) + VNNI kernels, or nullptr when this build has none; int8: with int8
// activations for quantized weights (Acts; decode and prefill), else int16 throughout.
const Kernels* avx512_kernels(bool int8);
// The same built with VBMI (avx512.cpp says what for), or nullptr.
const Kernels* avx512vbmi_kernels(bool int8);
// Their `gemm` (gemm_avx512.cpp), or nullptr; and the same on int8 activations (its `prepare`:
// avx512_int8.h).
RowsFn avx512_gemm_kernel();
RowsFn avx512_gemm8_kernel();

// Whether a format is quantized in groups with per-group scales (affine 4/8-bit, MXFP4), not 16-bit.
inline bool is_grouped(Format f) { return f != Format::F16 && f != Format::BF16 && f != Format::F32; }
// Bits per stored weight of a quantized format.
inline int quant_bits(Format f) { return f == Format::Affine8 ? 8 : 4; }
// The bias of a group with scale s when the weights come without biases (symmetric; MXFP4: none).
inline float symmetric_bias(const Weights& w, float s) {
  return w.format == Format::Mxfp4 ? 0.0f : -static_cast<float>(1 << (quant_bits(w.format) - 1)) * s;
}
// MXFP4's E2M1 codes as twice their value, and the scale an E8M0 byte e gives them: 2^(e - 128).
alignas(16) constexpr int8_t kE2M1x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_scale(uint8_t e) { return std::ldexp(1.0f, static_cast<int>(e) - 128); }
// The int8 bodies read MXFP4 codes as unsigned bytes, kE2M1x2 + kFp4Offset (VNNI's byte products
// take one unsigned operand); their sums start from -kFp4Offset x the x they add (Acts), so what
// they hold is the signed codes' own product, exact, never the offset's larger one.
constexpr int kFp4Offset = 12;
// Scales and biases of row n as floats (shared by every kernel).
void row_scales(const Weights& w, int n, float* scales, float* biases);
// Where x[k] goes in a row of Acts::xq, for kernels that read `step_bytes` (32: AVX2, 64: AVX-512)
// of a weight row at a time. They read weights as 16-bit lanes and take their values apart with
// shifts and masks, never shuffles, so each value lands in the lane it was in. A row's chunks of
// 32 weights form spans of one step (4-bit: 2 chunks per 32 bytes; 8-bit: 1), then the rest in
// spans of half a step, a quarter, ... Within a span of S chunks (value e of the span):
// - Affine4: 8S lanes of 4 nibbles, lane i holding values 4i .. 4i + 3; nibble j of every lane
//   makes one vector, so the activations are 4 blocks of 8S, block j = the values 4i + j.
// - Affine8: 16S lanes of 2 bytes; the activations are the 16S evens, then the odds.
int affine_position(int k, int K, Format format, int step_bytes);
// The portable `prepare` (for 32-byte steps): plain C++, one value at a time.
void prepare_acts(const Weights& w, const float* x, int M, int16_t* xq, float* xscale, float* xsum);

}  // namespace shoal
