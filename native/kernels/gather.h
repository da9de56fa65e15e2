// `gather_matmul`: the CPU side of MLX's `gather_qmm` for affine 4/8-bit and MXFP4 experts (transpose=True,
// as mlx-lm's QuantizedSwitchLinear calls it): each batch element's rows of x times the weights of
// the expert its index names, reading only the chosen experts' rows, on the pool.
#pragma once

#include <optional>
#include <vector>

#include "matmul.h"

namespace shoal {

class GatherMatmul : public mx::Primitive {
 public:
  GatherMatmul(mx::Stream stream, Format format, int group_size)
      : mx::Primitive(stream), format_(format), group_size_(group_size) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "ShoalGatherMatmul"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  Format format_;
  int group_size_;
};

// out[b] = x[b] @ dequantize(w[indices[b]]).T, as mx.gather_qmm(x, w, scales, biases,
// rhs_indices=indices, transpose=True) computes it: x float [..., R, K] and indices (integers)
// [...] broadcast over their batch dimensions; w uint32 [E, N, K * bits / 32], scales and biases
// [E, N, K / group_size] (biases absent: symmetric). Returns float32 [batch..., R, N]. An index
// outside [0, E) gives zeros.
mx::array gather_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                        const std::optional<mx::array>& biases, const mx::array& indices, int group_size,
                        int bits, mx::StreamOrDevice s = {});

// The layout of one stack of experts [E, N, ...], checked as the dense product checks one
// (std::invalid_argument, prefixed with `what`).
WeightSpec expert_spec(const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
                       int group_size, int bits, const char* what);

// E experts' weights stored one after another (as MLX stacks them): expert e's rows start
// e * data_stride bytes after expert 0's, its scales and biases e * scale_stride bytes after.
struct Experts {
  Weights first;
  long data_stride, scale_stride;
  int E;
  Weights at(int e) const;
};

// Prefill products of many experts at once on the kernels' `gemm` (AVX-512 VNNI): every
// expert's rows prepared in one pool job, every expert's panels of kGemmRows weight rows in one
// more, instead of two jobs per expert. An expert's ~64 rows of a 512-token prefill are a small
// product: its two barriers and its preparing job cost as much as a fifth of its panels' work.
//
// Activations for `gemm`, rows gathered from anywhere, in buffers this object owns (reused).
struct GemmActs {
  std::vector<int16_t> xq;
  std::vector<float> xscale, xsum;
  int K = 0, groups = 0;
  // Row i from src[i] (K floats), rounded for w's layout; one pool job.
  void prepare(const Kernels& k, const Weights& w, const float* const* src, int M);
  Acts rows(int begin, int end) const;  // a view of rows [begin, end) (no float x)
};
// One expert's product: y (row stride ldy) = a's rows @ w.T.
struct GemmJob {
  Weights w;
  Acts a;
  float* y;
  long ldy;
};
// A pool task: panel [n0, n1) of job `job`.
struct PanelTask {
  int job, n0, n1;
};
// Every job's panels, job after job (an expert's tasks adjacent: its rows stay in cache).
void panel_tasks(const GemmJob* jobs, size_t count, std::vector<PanelTask>& tasks);
// All the jobs' panels as one pool job.
void run_gemms(const Kernels& k, const GemmJob* jobs, size_t count);
// Whether `gemm` takes these weights (the kernels have one, and the format is grouped).
bool gemm_takes(const Kernels& k, const Weights& w);

// The product itself on evaluated buffers: x is P blocks of R rows (row-major, K wide), y P blocks
// of R x N. Blocks of one expert are grouped: up to kMaxRows rows of an expert share one `rows`
// product, and all those experts' rows run as one pool job; more rows (prefill) go to `product`
// (the tiled sgemm path) one expert at a time, or where the kernels have a `gemm`, all of them as
// run_gemms' two pool jobs.
void gather_product(const Experts& experts, const float* x, const uint32_t* indices, int P, int R, float* y);

}  // namespace shoal
