// The expert products (gather.h): group the (token, expert) blocks by expert, then run the dense
// kernels on each expert's rows, so a decode step reads each chosen expert's bytes once.
#include "gather.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "pool.h"

namespace shoal {

Weights Experts::at(int e) const {
  Weights w = first;
  w.data += e * data_stride;
  w.scales = static_cast<const uint8_t*>(w.scales) + e * scale_stride;
  if (w.biases) w.biases = static_cast<const uint8_t*>(w.biases) + e * scale_stride;
  return w;
}

bool gemm_takes(const Kernels& k, const Weights& w) { return k.gemm && k.gemm_prepare && is_grouped(w.format); }

void GemmActs::prepare(const Kernels& k, const Weights& w, const float* const* src, int M) {
  constexpr int kPrepareRows = 16;
  K = w.K, groups = w.K / w.group_size;
  xq.resize(static_cast<size_t>(M) * K);
  xscale.resize(static_cast<size_t>(M) * groups);
  xsum.resize(static_cast<size_t>(M) * groups);
  int16_t* q = xq.data();
  float *scale = xscale.data(), *sum = xsum.data();
  const int K_ = K, groups_ = groups;
  Pool::instance().run((M + kPrepareRows - 1) / kPrepareRows, [&](int t) {
    for (int m = t * kPrepareRows; m < std::min(M, (t + 1) * kPrepareRows); m++)
      k.gemm_prepare(w, src[m], 1, q + static_cast<long>(m) * K_, scale + static_cast<long>(m) * groups_,
                     sum + static_cast<long>(m) * groups_);
  });
}

Acts GemmActs::rows(int begin, int end) const {
  return {end - begin, K, groups, nullptr, xq.data() + static_cast<long>(begin) * K,
          xscale.data() + static_cast<long>(begin) * groups, xsum.data() + static_cast<long>(begin) * groups};
}

void panel_tasks(const GemmJob* jobs, size_t count, std::vector<PanelTask>& tasks) {
  tasks.clear();
  for (size_t j = 0; j < count; j++)
    for (int n0 = 0; n0 < jobs[j].w.N; n0 += kGemmRows)
      tasks.push_back({static_cast<int>(j), n0, std::min(jobs[j].w.N, n0 + kGemmRows)});
}

void run_gemms(const Kernels& k, const GemmJob* jobs, size_t count) {
  thread_local std::vector<PanelTask> tasks;
  panel_tasks(jobs, count, tasks);
  const PanelTask* all = tasks.data();
  Pool::instance().run(static_cast<int>(tasks.size()), [&](int t) {
    const GemmJob& j = jobs[all[t].job];
    k.gemm(j.w, j.a, j.y, j.ldy, all[t].n0, all[t].n1);
  });
}

void gather_product(const Experts& experts, const float* x, const uint32_t* indices, int P, int R, float* y) {
  const int K = experts.first.K, N = experts.first.N;
  const long xblock = static_cast<long>(R) * K, yblock = static_cast<long>(R) * N;
  // The blocks in expert order (stable: a token's rows keep their order within an expert).
  std::vector<int> order(P);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return indices[a] < indices[b]; });
  struct Group {
    Weights w;
    int begin, end;  // in `order`
    const float* x;  // the group's rows: x itself for one block, else `gathered`
    float* y;        // where they go: y itself for one block, else `results`
  };
  std::vector<Group> groups;
  long gathered_rows = 0;
  for (int i = 0; i < P;) {
    const uint32_t e = indices[order[i]];
    int j = i;
    while (j < P && indices[order[j]] == e) j++;
    if (e >= static_cast<uint32_t>(experts.E)) {  // no such expert: zeros
      for (int b = i; b < j; b++) std::fill_n(y + order[b] * yblock, yblock, 0.0f);
    } else {
      groups.push_back({experts.at(static_cast<int>(e)), i, j, nullptr, nullptr});
      if (j - i > 1) gathered_rows += static_cast<long>(j - i) * R;
    }
    i = j;
  }
  // Groups of several blocks read and write contiguous copies.
  thread_local std::vector<float> gathered, results;
  gathered.resize(gathered_rows * K);
  results.resize(gathered_rows * N);
  // Large groups on `gemm` are prepared from x where it is: no float copy.
  const Kernels& k = expert_kernels();
  const bool gemm = gemm_takes(k, experts.first);
  auto on_gemm = [&](const Group& g) { return gemm && (g.end - g.begin) * R > kMaxRows; };
  long at = 0;
  for (Group& g : groups) {
    if (g.end - g.begin == 1) {
      g.x = x + order[g.begin] * xblock;
      g.y = y + order[g.begin] * yblock;
      continue;
    }
    g.x = gathered.data() + at * K;
    g.y = results.data() + at * N;
    for (int b = g.begin; b < g.end && !on_gemm(g); b++)
      std::memcpy(gathered.data() + (at + static_cast<long>(b - g.begin) * R) * K, x + order[b] * xblock,
                  xblock * sizeof(float));
    at += static_cast<long>(g.end - g.begin) * R;
  }
  // Small groups: one pool job for all of them; large ones: see below. The
  // prepared activations' buffers are kept across calls (a decode step calls this every MoE layer).
  thread_local std::vector<PreparedActs> prepared;
  thread_local std::vector<Acts> acts;
  thread_local std::vector<RowsJob> jobs;
  if (prepared.size() < groups.size()) prepared.resize(groups.size());
  acts.resize(groups.size());  // sized first: jobs point into it
  jobs.clear();
  for (const Group& g : groups) {
    const int rows = (g.end - g.begin) * R;
    if (rows <= kMaxRows) {
      const size_t i = jobs.size();
      acts[i] = prepared[i].prepare(g.w, g.x, rows, &k);
      jobs.push_back({&g.w, &acts[i], g.y});
    }
  }
  if (!jobs.empty()) run_rows(jobs.data(), jobs.size());
  if (!gemm) {
    for (const Group& g : groups) {
      const int rows = (g.end - g.begin) * R;
      if (rows > kMaxRows) product(g.w, g.x, rows, g.y);
    }
  } else {  // every large group's rows prepared in one job, all their panels in another
    thread_local std::vector<const float*> src;
    thread_local std::vector<GemmJob> gemms;
    thread_local GemmActs large;
    src.clear(), gemms.clear();
    for (const Group& g : groups) {
      const int rows = (g.end - g.begin) * R;
      if (rows <= kMaxRows) continue;
      gemms.push_back({g.w, {}, g.y, N});
      gemms.back().a.M = static_cast<int>(src.size());  // its first row, until prepared
      for (int b = g.begin; b < g.end; b++)
        for (int r = 0; r < R; r++) src.push_back(x + order[b] * xblock + static_cast<long>(r) * K);
    }
    if (!gemms.empty()) {
      large.prepare(k, experts.first, src.data(), static_cast<int>(src.size()));
      for (size_t i = 0; i < gemms.size(); i++) {
        const int end = i + 1 < gemms.size() ? gemms[i + 1].a.M : static_cast<int>(src.size());
        gemms[i].a = large.rows(gemms[i].a.M, end);
      }
      run_gemms(k, gemms.data(), gemms.size());
    }
  }
  for (const Group& g : groups) {
    if (g.end - g.begin == 1) continue;
    for (int b = g.begin; b < g.end; b++)
      std::memcpy(y + order[b] * yblock, g.y + static_cast<long>(b - g.begin) * yblock, yblock * sizeof(float));
  }
}

WeightSpec expert_spec(const mx::array& w, const mx::array& scales, const std::optional<mx::array>& biases,
                       int group_size, int bits, const char* what) {
  const std::string where = std::string("[") + what + "] ";
  if (w.ndim() != 3 || scales.ndim() != 3 || (biases && biases->ndim() != 3))
    throw std::invalid_argument(where + "w, scales and biases must be 3-D [experts, N, ...]");
  const int E = w.shape(0);
  if (scales.shape(0) != E || (biases && biases->shape(0) != E))
    throw std::invalid_argument(where + "w, scales and biases must have the same experts");
  // One expert's layout, checked as the dense product checks it.
  auto first = [](const mx::array& a) {
    return mx::reshape(mx::slice(a, {0, 0, 0}, {1, a.shape(1), a.shape(2)}), {a.shape(1), a.shape(2)});
  };
  std::optional<mx::array> b0;
  if (biases) b0 = first(*biases);
  return weight_spec(first(w), first(scales), b0, group_size, bits);
}

mx::array gather_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                        const std::optional<mx::array>& biases, const mx::array& indices, int group_size,
                        int bits, mx::StreamOrDevice s) {
  if (x.ndim() < 2) throw std::invalid_argument("[shoal_gather_matmul] x must be [..., rows, K]");
  if (!mx::issubdtype(indices.dtype(), mx::integer))
    throw std::invalid_argument("[shoal_gather_matmul] indices must be integers");
  const WeightSpec spec = expert_spec(w, scales, biases, group_size, bits, "shoal_gather_matmul");
  if (x.shape(-1) != spec.K)
    throw std::invalid_argument("[shoal_gather_matmul] x has " + std::to_string(x.shape(-1)) + " features, w " +
                                std::to_string(spec.K));
  const int R = x.shape(-2);
  mx::Shape batch = mx::broadcast_shapes(mx::Shape(x.shape().begin(), x.shape().end() - 2), indices.shape());
  mx::Shape x_shape = batch;
  x_shape.push_back(R);
  x_shape.push_back(spec.K);
  mx::Shape out_shape = batch;
  out_shape.push_back(R);
  out_shape.push_back(spec.N);
  std::vector<mx::array> inputs{
      mx::contiguous(mx::broadcast_to(mx::astype(x, mx::float32, s), x_shape, s), false, s),
      mx::contiguous(mx::broadcast_to(mx::astype(indices, mx::uint32, s), batch, s), false, s), w, scales};
  if (biases) inputs.push_back(*biases);
  auto primitive = std::make_shared<GatherMatmul>(mx::to_stream(s), spec.format, spec.group_size);
  return mx::array(out_shape, mx::float32, primitive, std::move(inputs));
}

void GatherMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &x = inputs[0], &indices = inputs[1], &w = inputs[2], &scales = inputs[3];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int E = w.shape(0), N = w.shape(1), K = x.shape(-1), R = x.shape(-2);
  const int P = static_cast<int>(indices.size());
  const Weights first =
      weights_of({format_, group_size_, N, K}, w, &scales, inputs.size() > 4 ? &inputs[4] : nullptr);
  // Row-contiguous (checked by weights_of): an expert's bytes are its stride along the first axis.
  const Experts experts{first, static_cast<long>(w.strides(0) * w.itemsize()),
                        static_cast<long>(scales.strides(0) * scales.itemsize()), E};
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([experts, x = mx::array::unsafe_weak_copy(x), indices = mx::array::unsafe_weak_copy(indices),
                    y = out.data<float>(), P, R]() {
    thread_local std::vector<float> copy;
    gather_product(experts, row_major(x, copy), indices.data<uint32_t>(), P, R, y);
  });
}

void GatherMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[shoal_gather_matmul] has no GPU implementation: on a GPU MLX's own kernels are used");
}

bool GatherMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const GatherMatmul&>(other);
  return format_ == o.format_ && group_size_ == o.group_size_;
}

std::vector<mx::Shape> GatherMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[2].shape(1);
  return {shape};
}

}  // namespace shoal
