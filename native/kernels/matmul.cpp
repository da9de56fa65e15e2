// The MLX operation and its CPU evaluation: choose the layout, prepare the activations once, and
// split the product over the pool.
//
// - x with up to kMaxRows rows (decode, small batches): the `rows` kernel, output rows split over
//   the threads; every weight byte is read once per product.
// - more rows (prefill): tiles of weight rows dequantized to float32 in a per-thread buffer, each
//   multiplied by a single-threaded OpenBLAS sgemm. Dequantizing costs K floats per weight row,
//   the sgemm 2 * M * K flops, so for M > 8 the tile is nearly free and the speed is sgemm's.
//   Without a BLAS library the rows kernel runs over x in blocks of kMaxRows rows instead.
//   Kernels with a `gemm` of their own (AVX-512 VNNI) run it for affine and MXFP4 weights instead: x
//   rounded to int16 once, then one task per panel of kGemmRows weight rows.
#include "matmul.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "choice.h"
#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal {

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
SgemmFn sgemm = nullptr;

// A dequantized tile, at most 8 MB (and 512 rows) per thread: each tile's sgemm call packs all of x
// again, so more rows per tile mean fewer repacks. 512-token prefill products of a 1B shape took
// 0.85-0.96x the time they took with 2 MB tiles (0.85: the MLP's down product, K = 8192, 64 -> 256
// rows); 32 MB gained nothing more (bench/kernel_ab.py --rows 512).
constexpr long kTileBytes = 8l << 20;
constexpr long kParallelMinBytes = 64l << 10;  // below 64 KB of weights one thread beats waking more
constexpr int kTasksPerThread = 4;  // small enough that a preempted thread delays little

Format format_of(mx::Dtype dtype, int bits) {
  if (dtype == mx::uint32 && bits == 4) return Format::Affine4;
  if (dtype == mx::uint32 && bits == 8) return Format::Affine8;
  if (dtype == mx::float16) return Format::F16;
  if (dtype == mx::bfloat16) return Format::BF16;
  if (dtype == mx::float32) return Format::F32;
  throw std::invalid_argument("[shoal_matmul] weights must be uint32 (4 or 8 bits), float16, bfloat16 or float32");
}

ScaleType scale_type_of(mx::Dtype dtype) {
  if (dtype == mx::float32) return ScaleType::F32;
  if (dtype == mx::float16) return ScaleType::F16;
  if (dtype == mx::bfloat16) return ScaleType::BF16;
  if (dtype == mx::uint8) return ScaleType::E8M0;
  throw std::invalid_argument("[shoal_matmul] scales and biases must be float32, float16 or bfloat16 (uint8: MXFP4)");
}

int bits_of(Format f) { return is_grouped(f) ? quant_bits(f) : f == Format::F32 ? 32 : 16; }

// Rows of output per task: a multiple of 8 (a cache line of y per row of x), at least 16.
int task_rows(int N, int threads) {
  int per = (N + threads * kTasksPerThread - 1) / (threads * kTasksPerThread);
  per = std::max(16, (per + 7) / 8 * 8);
  return per;
}

// Products of one x with weights of one layout (format, K, group size): x is prepared once per
// block of kMaxRows rows, and every output's rows are cut into tasks of one pool job, so a decode
// step's q/k/v (or gate/up) wait on one barrier, not three, and the small ones run on every thread.
void small_products(const Output* outs, size_t count, const float* x, int M) {
  const Weights& w = *outs[0].w;
  thread_local PreparedActs prepared;
  thread_local std::vector<RowsJob> jobs;
  jobs.resize(count);
  for (int m0 = 0; m0 < M; m0 += kMaxRows) {
    const int block = std::min(kMaxRows, M - m0);
    const Acts a = prepared.prepare(w, x + static_cast<long>(m0) * w.K, block);
    for (size_t i = 0; i < count; i++) jobs[i] = {outs[i].w, &a, outs[i].y + static_cast<long>(m0) * outs[i].w->N};
    run_rows(jobs.data(), count);
  }
}

void tiled_product(const Weights& w, const float* x, int M, float* y) {
  const Kernels& k = active_kernels();
  Pool& pool = Pool::instance();
  int tile = static_cast<int>(std::clamp<long>(kTileBytes / (4l * w.K), 16, 512)) / 16 * 16;
  const int spread = (w.N + 2 * pool.threads() - 1) / (2 * pool.threads());  // >= 2 tiles a thread
  tile = std::max(16, std::min(tile, (spread + 15) / 16 * 16));
  const int tasks = (w.N + tile - 1) / tile;
  pool.run(tasks, [&](int t) {
    thread_local std::vector<float> buffer;
    const int n0 = t * tile, n1 = std::min(w.N, n0 + tile);
    const float* tile_w = reinterpret_cast<const float*>(w.data + static_cast<long>(n0) * w.row_bytes);
    if (w.format != Format::F32) {  // float32 rows go to sgemm as they are
      buffer.resize(static_cast<size_t>(n1 - n0) * w.K);
      k.dequant(w, n0, n1, buffer.data());
      tile_w = buffer.data();
    }
    sgemm(kRowMajor, kNoTrans, kTrans, M, n1 - n0, w.K, 1.0f, x, w.K, tile_w, w.K, 0.0f, y + n0, w.N);
  });
}

// Prefill through the kernels' own `gemm`: x rounded per group once (split over the pool by rows),
// then one task per panel of weight rows.
void gemm_product(const Kernels& k, const Weights& w, const float* x, int M, float* y) {
  constexpr int kPrepareRows = 16;
  Pool& pool = Pool::instance();
  const int K = w.K, groups = K / w.group_size;
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> xscale, xsum;
  xq.resize(static_cast<size_t>(M) * K);
  xscale.resize(static_cast<size_t>(M) * groups);
  xsum.resize(static_cast<size_t>(M) * groups);
  // The buffers are this thread's: tasks on other threads reach them through these pointers.
  int16_t* q = xq.data();
  float *scale = xscale.data(), *sum = xsum.data();
  pool.run((M + kPrepareRows - 1) / kPrepareRows, [&](int t) {
    const long m0 = static_cast<long>(t) * kPrepareRows;
    k.gemm_prepare(w, x + m0 * K, std::min<int>(kPrepareRows, M - m0), q + m0 * K, scale + m0 * groups,
                   sum + m0 * groups);
  });
  const Acts a{M, K, groups, x, q, scale, sum};
  pool.run((w.N + kGemmRows - 1) / kGemmRows,
           [&](int t) { k.gemm(w, a, y, w.N, t * kGemmRows, std::min(w.N, (t + 1) * kGemmRows)); });
}

}  // namespace

Acts PreparedActs::prepare(const Weights& w, const float* x, int M, const Kernels* kernels) {
  const int groups = is_grouped(w.format) ? w.K / w.group_size : 0;
  const Kernels& k = kernels ? *kernels : rows_kernels(w.format, M);
  Acts a{M, w.K, groups, x, nullptr, nullptr, nullptr, &k};
  if (groups) {
    xq.resize(static_cast<size_t>(M) * w.K);
    xscale.resize(static_cast<size_t>(M) * groups);
    xsum.resize(static_cast<size_t>(M) * groups);
    k.prepare(w, x, M, xq.data(), xscale.data(), xsum.data());
    a.xq = xq.data(), a.xscale = xscale.data(), a.xsum = xsum.data();
  }
  return a;
}

void run_rows(const RowsJob* jobs, size_t count) {
  Pool& pool = Pool::instance();
  long bytes = 0, rows = 0;
  for (size_t i = 0; i < count; i++) {
    bytes += static_cast<long>(jobs[i].w->N) * jobs[i].w->row_bytes;
    rows += jobs[i].w->N;
  }
  const bool parallel = bytes >= kParallelMinBytes && pool.threads() > 1;
  const int per = parallel ? task_rows(static_cast<int>(rows), pool.threads()) : static_cast<int>(rows);
  auto tasks_of = [per](const RowsJob& j) { return (j.w->N + per - 1) / per; };
  int tasks = 0;
  for (size_t i = 0; i < count; i++) tasks += tasks_of(jobs[i]);
  auto task = [&](int t) {
    size_t i = 0;  // the job task t falls in (a few jobs: a scan)
    for (int n; t >= (n = tasks_of(jobs[i])); i++) t -= n;
    const Weights& wi = *jobs[i].w;
    const Acts& a = *jobs[i].a;
    (a.kernels ? a.kernels : &active_kernels())->rows(wi, a, jobs[i].y, wi.N, t * per, std::min(wi.N, (t + 1) * per));
  };
  if (parallel) {
    pool.run(tasks, task);
  } else {  // one task per job, on this thread
    for (int t = 0; t < tasks; t++) task(t);
  }
}

// x as a row-major float buffer: its own data when it already is, else a strided copy.
const float* row_major(const mx::array& x, std::vector<float>& copy) {
  if (x.flags().row_contiguous) return x.data<float>();
  copy.resize(x.size());
  const float* src = x.data<float>();
  const auto& shape = x.shape();
  const auto& strides = x.strides();
  std::vector<int> index(shape.size(), 0);
  for (size_t i = 0; i < x.size(); i++) {
    long at = 0;
    for (size_t d = 0; d < shape.size(); d++) at += static_cast<long>(index[d]) * strides[d];
    copy[i] = src[at];
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0 && ++index[d] == shape[d]; d--) index[d] = 0;
  }
  return copy.data();
}

void product(const Weights& w, const float* x, int M, float* y) {
  const Kernels& k = active_kernels();
  if (M > kMaxRows && k.gemm && is_grouped(w.format)) {
    gemm_product(k, w, x, M, y);
  } else if (M > kMaxRows && sgemm) {
    tiled_product(w, x, M, y);
  } else {
    const Output out{&w, y};
    small_products(&out, 1, x, M);
  }
}

void products(const std::vector<Output>& outs, const float* x, int M) {
  const auto same_layout = [&](const Output& o) {
    const Weights &a = *o.w, &b = *outs[0].w;
    return a.format == b.format && a.K == b.K && a.group_size == b.group_size;
  };
  if (M <= kMaxRows && !outs.empty() && std::all_of(outs.begin(), outs.end(), same_layout)) {
    small_products(outs.data(), outs.size(), x, M);
  } else {
    for (const Output& o : outs) product(*o.w, x, M, o.y);
  }
}

WeightSpec weight_spec(const mx::array& w, const std::optional<mx::array>& scales,
                       const std::optional<mx::array>& biases, int group_size, int bits) {
  Format format = format_of(w.dtype(), bits);
  if (w.ndim() != 2) throw std::invalid_argument("[shoal_matmul] w must be 2-D");
  const int N = w.shape(0);
  const int K = is_grouped(format) ? w.shape(1) * 32 / bits : w.shape(1);
  if (is_grouped(format)) {
    if (!scales) throw std::invalid_argument("[shoal_matmul] affine weights need scales");
    if (group_size != 32 && group_size != 64 && group_size != 128)
      throw std::invalid_argument("[shoal_matmul] group size must be 32, 64 or 128");
    const int groups = K / group_size;
    if (scales->shape() != mx::Shape{N, groups} ||
        (biases && (biases->shape() != scales->shape() || biases->dtype() != scales->dtype())))
      throw std::invalid_argument("[shoal_matmul] scales and biases must both be [N, K / group_size], one dtype");
    if (scale_type_of(scales->dtype()) == ScaleType::E8M0) {  // MXFP4: E8M0 scales, 32 a group, no biases
      if (format != Format::Affine4 || group_size != 32 || biases)
        throw std::invalid_argument("[shoal_matmul] uint8 (E8M0) scales are MXFP4's: 4 bits, group size 32, no biases");
      format = Format::Mxfp4;
    }
  } else if (K % 8 != 0) {
    throw std::invalid_argument("[shoal_matmul] dense weights need K to be a multiple of 8");
  }
  return {format, is_grouped(format) ? group_size : 0, N, K};
}

Weights weights_of(const WeightSpec& spec, const mx::array& w, const mx::array* scales, const mx::array* biases) {
  for (const mx::array* a : {&w, scales, biases})
    if (a && !a->flags().row_contiguous)
      throw std::invalid_argument("[shoal_matmul] weights, scales and biases must be row-contiguous");
  Weights weights{spec.format, w.data<uint8_t>(), static_cast<long>(spec.K) * bits_of(spec.format) / 8,
                  nullptr, nullptr, ScaleType::F32, spec.group_size, spec.N, spec.K};
  if (is_grouped(spec.format)) {
    weights.scales = scales->data<void>();
    weights.biases = biases ? biases->data<void>() : nullptr;
    weights.scale_type = scale_type_of(scales->dtype());
  }
  return weights;
}

namespace {

// SHOAL_KERNEL_ACTS: "int8" or "int16" for every quantized product; unset, int8 for experts only.
std::string acts_setting() {
  const char* acts = std::getenv("SHOAL_KERNEL_ACTS");
  return acts ? acts : "";
}

}  // namespace

const Kernels& active_kernels() {
  // int16 unless SHOAL_KERNEL_ACTS=int8: int8 (kernels.h, Acts) is faster but turns near-ties, and
  // a dense model has them where it matters: the built-in SmolLM2-135M answers "What is the capital
  // of France?" with "L'Étoile, ..." on int8, as llama.cpp (Q8 activations) does on the same file,
  // where int16 and float32 say Paris (a 0.08 logit margin of a 34 range).
  static const Kernels* chosen = supported_kernels(acts_setting() == "int8").front();
  return *chosen;
}

const Kernels& expert_kernels() {
  // int8 unless SHOAL_KERNEL_ACTS=int16: experts are most of a MoE model's bytes a token, the rows
  // kernel is bound by its multiply-adds there, and a token's output sums k experts' (llama.cpp
  // rounds them to int8 as well). Dense layers, attention, routers and the head stay int16.
  static const Kernels* chosen = supported_kernels(acts_setting() != "int16").front();
  return *chosen;
}

bool has_blas() { return sgemm != nullptr; }

int pool_threads() { return Pool::instance().threads(); }

std::string set_blas_library(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) return std::string("cannot open ") + path + ": " + dlerror();
  auto fn = reinterpret_cast<SgemmFn>(dlsym(lib, "scipy_cblas_sgemm"));
  if (!fn) fn = reinterpret_cast<SgemmFn>(dlsym(lib, "cblas_sgemm"));
  if (!fn) return path + " has no cblas_sgemm";
  // Our pool does the threading; each sgemm call runs on the thread that makes it.
  using SetThreads = void (*)(int);
  for (const char* name : {"scipy_openblas_set_num_threads", "openblas_set_num_threads"}) {
    if (auto set = reinterpret_cast<SetThreads>(dlsym(lib, name))) {
      set(1);
      break;
    }
  }
  sgemm = fn;
  return "";
}

mx::array weight_matmul(const mx::array& x, const mx::array& w, const std::optional<mx::array>& scales,
                        const std::optional<mx::array>& biases, int group_size, int bits, mx::StreamOrDevice s) {
  const WeightSpec spec = weight_spec(w, scales, biases, group_size, bits);
  if (x.ndim() < 1) throw std::invalid_argument("[shoal_matmul] x must have at least one dimension");
  if (x.shape(-1) != spec.K)
    throw std::invalid_argument("[shoal_matmul] x has " + std::to_string(x.shape(-1)) + " features, w " +
                                std::to_string(spec.K));
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s), w};
  if (is_grouped(spec.format)) {
    inputs.push_back(*scales);
    if (biases) inputs.push_back(*biases);  // none: symmetric, b = -2^(bits-1) s
  }
  mx::Shape out_shape = x.shape();
  out_shape.back() = spec.N;
  auto primitive = std::make_shared<WeightMatmul>(mx::to_stream(s), spec.format, spec.group_size);
  return mx::array(out_shape, mx::float32, primitive, std::move(inputs));
}

void WeightMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int N = w.shape(0), K = x.shape(-1), M = static_cast<int>(x.size() / K);
  const bool grouped = is_grouped(format_);
  const Weights weights = weights_of({format_, group_size_, N, K}, w, grouped ? &inputs[2] : nullptr,
                                     grouped && inputs.size() > 3 ? &inputs[3] : nullptr);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([weights, x = mx::array::unsafe_weak_copy(x), y = out.data<float>(), M]() {
    thread_local std::vector<float> copy;
    product(weights, row_major(x, copy), M, y);
  });
}

void WeightMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[shoal_matmul] has no GPU implementation: on a GPU MLX's own kernels are used");
}

bool WeightMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const WeightMatmul&>(other);
  return format_ == o.format_ && group_size_ == o.group_size_;
}

std::vector<mx::Shape> WeightMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

}  // namespace shoal
