// `shoal_matmul`: x @ W.T for weights kept as stored (MLX affine 4/8-bit, MXFP4, float16, bfloat16), as a
// real MLX operation (a Primitive evaluated on the CPU stream, lazy like any other op).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace shoal {

namespace mx = mlx::core;

class WeightMatmul : public mx::Primitive {
 public:
  WeightMatmul(mx::Stream stream, Format format, int group_size)
      : mx::Primitive(stream), format_(format), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShoalWeightMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  Format format_;
  int group_size_;
};

// y = x @ dequantize(w, scales, biases).T (affine; biases absent: symmetric, b = -2^(bits-1) s) or
// x @ w.T (16-bit w, scales/biases absent).
// x: float32 [..., K]; w: uint32 [N, K * bits / 32] or float16/bfloat16 [N, K]. Returns float32.
mx::array weight_matmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                        const std::optional<mx::array>& biases, int group_size, int bits,
                        mx::StreamOrDevice s = {});

// One stored weight's layout, checked (std::invalid_argument names what is wrong).
struct WeightSpec {
  Format format;
  int group_size;  // 0 for 16-bit weights
  int N, K;
};
WeightSpec weight_spec(const mx::array& w, const std::optional<mx::array>& scales,
                       const std::optional<mx::array>& biases, int group_size, int bits);
// The kernels' view of evaluated arrays (scales null for 16-bit weights, biases null when symmetric).
Weights weights_of(const WeightSpec& spec, const mx::array& w, const mx::array* scales, const mx::array* biases);
// y[M, N] = x[M, K] @ W.T on the pool: the rows kernel up to kMaxRows rows, else sgemm tiles.
void product(const Weights& w, const float* x, int M, float* y);
// One product of x with each weight: y = x @ w.T into its y. Up to kMaxRows rows, weights of one
// layout share one pool job (each output's bits are those of its own `product`).
struct Output {
  const Weights* w;
  float* y;
};
void products(const std::vector<Output>& outs, const float* x, int M);
// Activations prepared for the `rows` kernel of one layout, in buffers this object owns (reused).
struct PreparedActs {
  std::vector<int16_t> xq;
  std::vector<float> xscale, xsum;
  // M <= kMaxRows; kernels: the set whose `rows` will read them (nullptr: rows_kernels(), choice.h).
  Acts prepare(const Weights& w, const float* x, int M, const Kernels* kernels = nullptr);
};
// One `rows` product: y (row stride w->N) = a's rows @ w.T.
struct RowsJob {
  const Weights* w;
  const Acts* a;
  float* y;
};
// Jobs whose output rows are cut into tasks of one pool job (on this thread when they are small).
void run_rows(const RowsJob* jobs, size_t count);
// x as a row-major float buffer: its own data when it already is, else a strided copy into `copy`.
const float* row_major(const mx::array& x, std::vector<float>& copy);

// Load the sgemm the prefill path uses (an OpenBLAS: `scipy_cblas_sgemm` or `cblas_sgemm`).
// Returns an empty string on success, else why not (the prefill path then uses `rows`).
std::string set_blas_library(const std::string& path);

// The kernel set in use ("avx512vbmi", "avx512", "avx2" or "portable"); SHOAL_KERNEL_ISA caps it.
const Kernels& active_kernels();
// The same instruction set for experts' products (moe_mlp, moe_routed, gather_matmul): with int8
// activations where it has them, unless SHOAL_KERNEL_ACTS=int16.
const Kernels& expert_kernels();
bool has_blas();
int pool_threads();

}  // namespace shoal
