// SiLU as one pass: MLX's CPU sigmoid is scalar (~20 ns an element here), and a prefill MLP's
// silu(gate) over 512 x 8192 values cost as much as its three matrix products' tiles of sgemm.
// logsumexp over the last axis likewise (its exp is scalar too): the decode step's normalizer.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "fused.h"
#include "layers.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal {

namespace {
constexpr long kParallelMin = 1l << 16;  // below 64 K values one thread beats waking another
constexpr int kTasksPerThread = 4;

// One float32 input and output: allocate the output, register both with the stream's encoder
// and queue fn(x, y) on it.
template <typename F>
void dispatch_one(mx::Stream stream, const mx::array& x, mx::array& out, F fn) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), y = out.data<float>(), fn]() { fn(x.data<float>(), y); });
}

// x's shape without its last axis, or with it 1.
mx::Shape reduced(mx::Shape shape, bool keepdims) {
  if (keepdims) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  return shape;
}
}  // namespace

void portable_silu(const float* x, long n, float* out) {
  for (long i = 0; i < n; i++) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

mx::array silu(const mx::array& x, mx::StreamOrDevice s) {
  auto in = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedSiLU>(mx::to_stream(s)), {in});
}

void FusedSiLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const long n = static_cast<long>(inputs[0].size());
  dispatch_one(stream(), inputs[0], outputs[0], [n](const float* x, float* y) { silu_into(x, n, y); });
}

float portable_logsumexp(const float* x, long n) {
  float top = -std::numeric_limits<float>::infinity();
  for (long i = 0; i < n; i++) {
    if (std::isnan(x[i])) return x[i];
    top = std::max(top, x[i]);
  }
  if (std::isinf(top)) return top;  // all -inf: -inf; any +inf: +inf (as MLX)
  float sum = 0.0f;
  for (long i = 0; i < n; i++) sum += std::exp(x[i] - top);
  return top + std::log(sum);
}

mx::array logsumexp(const mx::array& x, bool keepdims, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.shape(-1) == 0) throw std::invalid_argument("logsumexp: x needs a non-empty last axis");
  auto in = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  return mx::array(reduced(x.shape(), keepdims), mx::float32,
                   std::make_shared<FusedLogSumExp>(mx::to_stream(s), keepdims), {in});
}

std::vector<mx::Shape> FusedLogSumExp::output_shapes(const std::vector<mx::array>& inputs) {
  return {reduced(inputs[0].shape(), keepdims_)};
}

void FusedLogSumExp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const long n = inputs[0].shape(-1), rows = static_cast<long>(inputs[0].size()) / n;
  dispatch_one(stream(), inputs[0], outputs[0], [n, rows](const float* x, float* y) {
    const FusedKernels& k = active_fused();
    Pool& pool = Pool::instance();
    const long most = static_cast<long>(pool.threads()) * kTasksPerThread;
    const int tasks = rows * n < kParallelMin ? 1 : static_cast<int>(std::min(rows, most));
    const long per = (rows + tasks - 1) / tasks;
    pool.run(tasks, [&](int t) {
      for (long r = t * per; r < std::min(rows, (t + 1) * per); r++) y[r] = k.logsumexp(x + r * n, n);
    });
  });
}

void silu_into(const float* x, long n, float* y) {
  const FusedKernels& k = active_fused();
  Pool& pool = Pool::instance();
  const int tasks = n < kParallelMin ? 1 : pool.threads() * kTasksPerThread;
  const long per = (n + tasks - 1) / tasks / 8 * 8 + 8;
  pool.run(tasks, [&](int t) {
    const long lo = t * per, hi = std::min(n, lo + per);
    if (lo < hi) k.silu(x + lo, hi - lo, y + lo);
  });
}

}  // namespace shoal
