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
}  // namespace

void portable_silu(const float* x, long n, float* out) {
  for (long i = 0; i < n; i++) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

mx::array silu(const mx::array& x, mx::StreamOrDevice s) {
  auto in = mx::contiguous(mx::astype(x, mx::float32, s), false, s);
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedSiLU>(mx::to_stream(s)), {in});
}

void FusedSiLU::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), y = out.data<float>(), n = static_cast<long>(x.size())]() {
    silu_into(x.data<float>(), n, y);
  });
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
  auto shape = x.shape();
  if (keepdims) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  return mx::array(shape, mx::float32, std::make_shared<FusedLogSumExp>(mx::to_stream(s), keepdims), {in});
}

std::vector<mx::Shape> FusedLogSumExp::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  if (keepdims_) {
    shape.back() = 1;
  } else {
    shape.pop_back();
  }
  return {shape};
}

void FusedLogSumExp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  const long n = x.shape(-1), rows = static_cast<long>(x.size()) / n;
  encoder.dispatch([x = mx::array::unsafe_weak_copy(x), y = out.data<float>(), n, rows]() {
    const FusedKernels& k = active_fused();
    Pool& pool = Pool::instance();
    const long most = static_cast<long>(pool.threads()) * kTasksPerThread;
    const int tasks = rows * n < kParallelMin ? 1 : static_cast<int>(std::min(rows, most));
    const long per = (rows + tasks - 1) / tasks;
    pool.run(tasks, [&](int t) {
      for (long r = t * per; r < std::min(rows, (t + 1) * per); r++) y[r] = k.logsumexp(x.data<float>() + r * n, n);
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
