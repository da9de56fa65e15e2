// Kernel sets chosen per layout and row class (choice.h), and the timing calibration runs.
#include "choice.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <random>
#include <stdexcept>

namespace shoal {

namespace {

constexpr std::array<const char*, 6> kFormatNames{"affine4", "affine8", "mxfp4", "f16", "bf16", "f32"};
constexpr int kRowClasses = 2;  // one row (decode), and 2..kMaxRows

// The chosen set per format and row class; nullptr: active_kernels().
std::array<std::array<std::atomic<const Kernels*>, kRowClasses>, kFormatNames.size()> chosen{};

int row_class(int M) { return M <= 1 ? 0 : 1; }

int format_index(const std::string& name) {
  for (size_t i = 0; i < kFormatNames.size(); i++)
    if (name == kFormatNames[i]) return static_cast<int>(i);
  throw std::invalid_argument("[shoal kernels] unknown format '" + name +
                              "': affine4, affine8, mxfp4, f16, bf16 or f32");
}

const Kernels* candidate(const std::string& name) {
  for (const Kernels* k : rows_candidates())
    if (name == k->name) return k;
  std::string names;
  for (const Kernels* k : rows_candidates()) names += std::string(names.empty() ? "" : ", ") + k->name;
  throw std::invalid_argument("[shoal kernels] '" + name + "' is not a kernel set this CPU runs: " + names);
}

}  // namespace

std::vector<const Kernels*> supported_kernels(bool int8) {
  const char* cap = std::getenv("SHOAL_KERNEL_ISA");
  const std::string isa = cap ? cap : "";
  std::vector<const Kernels*> sets;
#if defined(__x86_64__)
  const bool avx2 = avx2_kernels() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && avx512_kernels(int8) && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512vnni");
  const bool vbmi = avx512 && avx512vbmi_kernels(int8) && __builtin_cpu_supports("avx512vbmi");
  if (vbmi && isa != "portable" && isa != "avx2" && isa != "avx512") sets.push_back(avx512vbmi_kernels(int8));
  if (avx512 && isa != "portable" && isa != "avx2") sets.push_back(avx512_kernels(int8));
  if (avx2 && isa != "portable") sets.push_back(avx2_kernels());
#endif
  sets.push_back(&portable_kernels());
  return sets;
}

std::vector<const Kernels*> rows_candidates() {
  const Kernels& active = active_kernels();
  std::vector<const Kernels*> sets;
  for (const Kernels* k : supported_kernels(active.int8))  // portable: only where it is all there is
    if (k->int8 == active.int8 && (k == &active || k != &portable_kernels())) sets.push_back(k);
  return sets;
}

const Kernels& rows_kernels(Format format, int M) {
  const Kernels* k = chosen[static_cast<int>(format)][row_class(M)].load(std::memory_order_relaxed);
  return k ? *k : active_kernels();
}

void choose_rows_kernels(const std::string& format, int rows, const std::string& name) {
  chosen[format_index(format)][row_class(rows)].store(name.empty() ? nullptr : candidate(name));
}

std::string rows_choice(const std::string& format, int rows) {
  const Kernels* k = chosen[format_index(format)][row_class(rows)].load();
  return k ? k->name : "";
}

double time_rows(const std::vector<Projection>& weights, int M, const std::string& name, int repeats) {
  if (M < 1 || M > kMaxRows) throw std::invalid_argument("[shoal kernels] time_rows takes 1 to 8 rows");
  const Kernels* k = candidate(name);
  std::vector<Weights> ws;
  std::vector<std::vector<float>> xs, ys;
  std::mt19937 random(7);
  std::normal_distribution<float> normal;
  for (const Projection& p : weights) {
    const auto& [w, scales, biases, bias, group_size, bits] = p;
    mx::eval({w});
    if (scales) mx::eval({*scales});
    if (biases) mx::eval({*biases});
    const WeightSpec spec = weight_spec(w, scales, biases, group_size, bits);
    ws.push_back(weights_of(spec, w, scales ? &*scales : nullptr, biases ? &*biases : nullptr));
    xs.emplace_back(static_cast<size_t>(M) * spec.K);
    for (float& v : xs.back()) v = normal(random);
    ys.emplace_back(static_cast<size_t>(M) * spec.N);
  }
  PreparedActs prepared;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; r++) {
    for (size_t i = 0; i < ws.size(); i++) {
      const Acts a = prepared.prepare(ws[i], xs[i].data(), M, k);
      const RowsJob job{&ws[i], &a, ys[i].data()};
      run_rows(&job, 1);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace shoal
