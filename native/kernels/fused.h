// Fused CPU operations for what mx.fast runs as graphs of small ops on the CPU (MLX 0.32 has no
// CPU kernels for rms_norm, rope and scaled_dot_product_attention: each runs its fallback, 10-30
// tiny ops of ~5 us each). Each is one MLX Primitive here, evaluated on the CPU stream in one pass.
// Inputs are cast to float32 in the op; outputs are float32. Any strides are read as they are.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <variant>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace shoal {

namespace mx = mlx::core;

// How a KV cache holds its keys and values: float32, or float16 as llama.cpp's does (half the bytes
// a deep cache reads each decode step; read back exactly, as float32, before any arithmetic).
enum class KvType { F32, F16 };

// The inner loops, one set per instruction set (fused.cpp: portable C++; fused_avx2.cpp: AVX2+FMA).
struct FusedKernels {
  const char* name;
  // scores[r * S + s] = scale * dot(q[r * D ...], k[s * ks ...]) for r < R, s < S; k of type kt.
  void (*qk)(const float* q, int R, const void* k, KvType kt, long ks, int S, int D, float scale, float* scores);
  // out[r * Dv + d] = sum over s of p[r * S + s] * v[s * vs + d]; v of type vt.
  void (*pv)(const float* p, int R, const void* v, KvType vt, long vs, int S, int Dv, float* out);
  // The sum of x[i]^2 for i < n.
  float (*sumsq)(const float* x, int n);
  // x = softmax(x) in place, max subtracted; a sink (-inf: none) adds exp(sink) to the denominator.
  void (*softmax)(float* x, int n, float sink);
  // out[i] = x[i] * sigmoid(x[i]) for i < n (activation.cpp).
  void (*silu)(const float* x, long n, float* out);
  // log(sum of exp(x[i])) for i < n, with its max subtracted first; +-inf or NaN as MLX gives them.
  float (*logsumexp)(const float* x, long n);
};

void portable_silu(const float* x, long n, float* out);
float portable_logsumexp(const float* x, long n);

const FusedKernels& portable_fused();
// The AVX2+FMA loops, or nullptr when this build has none.
const FusedKernels* avx2_fused();
// The set in use: AVX2 exactly when the matmul kernels use AVX2 (SHOAL_KERNEL_ISA applies).
const FusedKernels& active_fused();

[[noreturn]] inline void no_gpu(const char* op) {
  throw std::runtime_error(std::string("[") + op + "] has no GPU implementation: MLX's own op runs there");
}

class FusedRMSNorm : public mx::Primitive {
 public:
  FusedRMSNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalRMSNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
};

class FusedRoPE : public mx::Primitive {
 public:
  FusedRoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalRoPE"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int dims_;
  bool traditional_;
  float base_;  // unused when freqs are given (inputs[2])
  float scale_;
};

// Mask kinds of FusedSDPA (an array mask is inputs[3], broadcast to [B, Hq, L, S]).
enum class MaskKind { None, Causal, Additive, Boolean };

class FusedSDPA : public mx::Primitive {
 public:
  FusedSDPA(mx::Stream stream, float scale, MaskKind mask, bool sinks)
      : mx::Primitive(stream), scale_(scale), mask_(mask), sinks_(sinks) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalSDPA"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  MaskKind mask_;
  bool sinks_;
};

// A decode step's attention (one new position per sequence) on a preallocated KV cache, in one
// operation instead of rope, rope, two cache updates, two slices, attention and a reshape (about 5
// us of scheduling each, 30 layers a token). inputs: q [B, Hq, 1, D], k [B, Hkv, 1, D], v [B, Hkv,
// 1, Dv] (not yet roped), keys [B, Hkv, C, D], values [B, Hkv, C, Dv], rope offsets (int32, 1 or
// B), then freqs and the mask when present. outputs: [B, 1, Hq * Dv], then keys and values with
// position `index` written (their buffers reused when the caches are donated, as MLX's own slice
// update does); attention reads positions 0 .. index.
class DecodeAttention : public mx::Primitive {
 public:
  struct Params {
    int index, dims;
    bool traditional;
    float base, rope_scale, scale;  // base unused when freqs are given
    bool freqs;
    MaskKind mask;
    bool operator==(const Params&) const = default;
  };
  DecodeAttention(mx::Stream stream, Params p) : mx::Primitive(stream), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  Params p_;
};

class FusedSiLU : public mx::Primitive {
 public:
  explicit FusedSiLU(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalSiLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

// nn.silu: x * sigmoid(x), elementwise, float32 out.
mx::array silu(const mx::array& x, mx::StreamOrDevice s = {});

class FusedLogSumExp : public mx::Primitive {
 public:
  FusedLogSumExp(mx::Stream stream, bool keepdims) : mx::Primitive(stream), keepdims_(keepdims) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalLogSumExp"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return keepdims_ == static_cast<const FusedLogSumExp&>(other).keepdims_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  bool keepdims_;
};

// mx.logsumexp(x, axis=-1, keepdims) of float32 x (ndim >= 1, last axis not empty): float32 out.
mx::array logsumexp(const mx::array& x, bool keepdims, mx::StreamOrDevice s = {});

// mx.fast.rms_norm: x * rsqrt(mean(x^2, -1) + eps) * weight, weight [D] or absent.
mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps,
                   mx::StreamOrDevice s = {});

// mx.fast.rope (forward): x [..., L, D] (ndim >= 3), positions offset + l; offset an int, a scalar
// array or one per x.shape(0). Exactly one of base and freqs ([dims / 2]) is given.
mx::array rope(const mx::array& x, int dims, bool traditional, std::optional<float> base, float scale,
               const std::variant<int, mx::array>& offset, const std::optional<mx::array>& freqs,
               mx::StreamOrDevice s = {});

// mx.fast.scaled_dot_product_attention: q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv];
// mask None, "causal" or an array broadcastable to [B, Hq, L, S] (bool: keep; else added);
// sinks [Hq] or absent. Returns [B, Hq, L, Dv].
mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
               const std::optional<std::variant<std::string, mx::array>>& mask,
               const std::optional<mx::array>& sinks, mx::StreamOrDevice s = {});

// The decode step above: returns [attention output [B, 1, Hq * Dv], keys, values].
std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& keys, const mx::array& values, int index, int dims,
                                        bool traditional, std::optional<float> base, float rope_scale,
                                        const std::variant<int, mx::array>& offset, float scale,
                                        const std::optional<mx::array>& freqs,
                                        const std::optional<mx::array>& mask, mx::StreamOrDevice s = {});

}  // namespace shoal
