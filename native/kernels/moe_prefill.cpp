// The mixture-of-experts MLP of many tokens (moe_prefill.h).
#include "moe_prefill.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "pool.h"

namespace shoal {

namespace {

constexpr int kSumTokens = 16;  // tokens per task of the weighted sum

// A run of one expert's pairs: rows [begin, end) of the sorted pairs.
struct Group {
  int e, begin, end;
};

// Buffers kept across calls (every MoE layer of a prefill chunk calls this): no allocation per call.
struct Scratch {
  std::vector<int> order, row_of;
  std::vector<Group> groups;
  std::vector<float> g, u, h, d, x;  // x: the float rows (the path without `gemm`)
  std::vector<const float*> src;
  std::vector<Group> large, small;  // groups of more than kMaxRows rows (on `gemm`), the rest
  std::vector<GemmJob> gate_jobs, up_jobs, down_jobs;
  std::vector<PanelTask> tasks;
  GemmActs xa, ha;
  std::vector<PreparedActs> small_x, small_h;  // per small group
  std::vector<Acts> small_acts;
  std::vector<Weights> small_w;
  std::vector<RowsJob> rows_jobs;
};

// The activation on rows [r0, r1) of g and u, columns [n0, n1), into h (I wide).
void activate_rows(const BoundExperts& gate, const BoundExperts& up, Activation act, float alpha, float limit,
                   int e, int r0, int r1, int n0, int n1, int I, Scratch& s) {
  const float* gb = gate.bias ? gate.bias + static_cast<long>(e) * I + n0 : nullptr;
  const float* ub = up.bias ? up.bias + static_cast<long>(e) * I + n0 : nullptr;
  for (int r = r0; r < r1; r++) {
    const long at = static_cast<long>(r) * I + n0;
    activate(act, alpha, limit, &s.g[at], &s.u[at], gb, ub, n1 - n0, &s.h[at]);
  }
}

// Rows of the groups' jobs over one GemmActs: job i's rows are its group's.
void bind_jobs(const std::vector<Group>& groups, const Experts& experts, const GemmActs& acts, float* y, int N,
               std::vector<GemmJob>& jobs) {
  jobs.clear();
  for (const Group& g : groups)
    jobs.push_back({experts.at(g.e), acts.rows(g.begin, g.end), y + static_cast<long>(g.begin) * N, N});
}

// Gate, up and the activation of the large groups on `gemm`: one task per panel of gate's rows.
void gate_up_on_gemm(const Kernels& k, const BoundExperts& gate, const BoundExperts& up, Activation act,
                     float alpha, float limit, int I, Scratch& s) {
  bind_jobs(s.large, gate.experts, s.xa, s.g.data(), I, s.gate_jobs);
  bind_jobs(s.large, up.experts, s.xa, s.u.data(), I, s.up_jobs);
  panel_tasks(s.gate_jobs.data(), s.gate_jobs.size(), s.tasks);
  Pool::instance().run(static_cast<int>(s.tasks.size()), [&](int t) {
    const PanelTask& p = s.tasks[t];
    const GemmJob &gj = s.gate_jobs[p.job], &uj = s.up_jobs[p.job];
    k.gemm(gj.w, gj.a, gj.y, gj.ldy, p.n0, p.n1);
    k.gemm(uj.w, uj.a, uj.y, uj.ldy, p.n0, p.n1);
    const Group& g = s.large[p.job];
    activate_rows(gate, up, act, alpha, limit, g.e, g.begin, g.end, p.n0, p.n1, I, s);
  });
}

// Groups of up to kMaxRows rows on the `rows` kernel, as at decode (a panel packed for a few rows
// costs more than reading the weights as stored): gate and up of all of them as one pool job, then
// the activation; with `down`, their down products instead (of h) as another.
void small_on_rows(const Kernels& kern, const BoundExperts& gate, const BoundExperts& up, const BoundExperts& down,
                   Activation act, float alpha, float limit, int D, int I, bool down_step, Scratch& s) {
  const size_t G = s.small.size();
  if (G == 0) return;
  if (s.small_x.size() < G) s.small_x.resize(G), s.small_h.resize(G);
  s.small_acts.resize(G), s.small_w.resize(2 * G);
  s.rows_jobs.clear();
  for (size_t i = 0; i < G; i++) {
    const Group& g = s.small[i];
    const int n = g.end - g.begin;
    if (down_step) {
      s.small_w[i] = down.experts.at(g.e);
      s.small_acts[i] = s.small_h[i].prepare(s.small_w[i], &s.h[static_cast<size_t>(g.begin) * I], n, &kern);
      s.rows_jobs.push_back({&s.small_w[i], &s.small_acts[i], &s.d[static_cast<size_t>(g.begin) * D]});
      continue;
    }
    s.small_w[2 * i] = gate.experts.at(g.e), s.small_w[2 * i + 1] = up.experts.at(g.e);
    s.small_acts[i] = s.small_x[i].prepare(s.small_w[2 * i], &s.x[static_cast<size_t>(g.begin) * D], n, &kern);
    s.rows_jobs.push_back({&s.small_w[2 * i], &s.small_acts[i], &s.g[static_cast<size_t>(g.begin) * I]});
    s.rows_jobs.push_back({&s.small_w[2 * i + 1], &s.small_acts[i], &s.u[static_cast<size_t>(g.begin) * I]});
  }
  run_rows(s.rows_jobs.data(), s.rows_jobs.size());
  if (!down_step)
    for (const Group& g : s.small) activate_rows(gate, up, act, alpha, limit, g.e, g.begin, g.end, 0, I, I, s);
}

// The same without `gemm`: each group's products by `product`, one after another.
void on_products(const BoundExperts& gate, const BoundExperts& up, const BoundExperts& down, Activation act,
                 float alpha, float limit, const float* x, int k, int D, int I, Scratch& s) {
  s.x.resize(s.g.size() / I * D);
  for (const Group& g : s.groups) {
    const int n = g.end - g.begin;
    for (int r = g.begin; r < g.end; r++)
      std::memcpy(&s.x[static_cast<size_t>(r) * D], x + static_cast<long>(s.order[r] / k) * D, D * sizeof(float));
    const Weights gw = gate.experts.at(g.e), uw = up.experts.at(g.e), dw = down.experts.at(g.e);
    const float* xr = &s.x[static_cast<size_t>(g.begin) * D];
    product(gw, xr, n, &s.g[static_cast<size_t>(g.begin) * I]);
    product(uw, xr, n, &s.u[static_cast<size_t>(g.begin) * I]);
    activate_rows(gate, up, act, alpha, limit, g.e, g.begin, g.end, 0, I, I, s);
    product(dw, &s.h[static_cast<size_t>(g.begin) * I], n, &s.d[static_cast<size_t>(g.begin) * D]);
  }
}

}  // namespace

void moe_prefill(const BoundExperts& gate, const BoundExperts& up, const BoundExperts& down, Activation act,
                 float alpha, float limit, const float* x, const uint32_t* indices, const float* scores, int T,
                 int k, float* y) {
  thread_local Scratch s;
  const int D = gate.experts.first.K, I = gate.experts.first.N, E = gate.experts.E;
  const int P = T * k;
  // The pairs in expert order (stable: a token's pairs keep their order within an expert); pairs
  // of no expert are dropped, so the sorted rows are the pairs' rows of g, u, h and d.
  s.order.resize(P);
  std::iota(s.order.begin(), s.order.end(), 0);
  std::stable_sort(s.order.begin(), s.order.end(), [&](int a, int b) { return indices[a] < indices[b]; });
  int rows = 0;
  while (rows < P && indices[s.order[rows]] < static_cast<uint32_t>(E)) rows++;
  s.groups.clear();
  s.row_of.assign(P, -1);
  for (int i = 0; i < rows;) {
    int j = i;
    while (j < rows && indices[s.order[j]] == indices[s.order[i]]) j++;
    s.groups.push_back({static_cast<int>(indices[s.order[i]]), i, j});
    i = j;
  }
  for (int r = 0; r < rows; r++) s.row_of[s.order[r]] = r;
  s.g.resize(static_cast<size_t>(rows) * I), s.u.resize(s.g.size()), s.h.resize(s.g.size());
  s.d.resize(static_cast<size_t>(rows) * D);
  const Kernels& kern = expert_kernels();
  if (gemm_takes(kern, gate.experts.first) && gemm_takes(kern, down.experts.first)) {
    s.large.clear(), s.small.clear();
    for (const Group& g : s.groups) (g.end - g.begin > kMaxRows ? s.large : s.small).push_back(g);
    s.x.resize(static_cast<size_t>(rows) * D);
    for (const Group& g : s.small)
      for (int r = g.begin; r < g.end; r++)
        std::memcpy(&s.x[static_cast<size_t>(r) * D], x + static_cast<long>(s.order[r] / k) * D, D * sizeof(float));
    s.src.resize(rows);  // every row is prepared for `gemm` (a small group's rows unused: a few)
    for (int r = 0; r < rows; r++) s.src[r] = x + static_cast<long>(s.order[r] / k) * D;
    s.xa.prepare(kern, gate.experts.first, s.src.data(), rows);
    small_on_rows(kern, gate, up, down, act, alpha, limit, D, I, false, s);
    gate_up_on_gemm(kern, gate, up, act, alpha, limit, I, s);
    for (int r = 0; r < rows; r++) s.src[r] = &s.h[static_cast<size_t>(r) * I];
    s.ha.prepare(kern, down.experts.first, s.src.data(), rows);
    small_on_rows(kern, gate, up, down, act, alpha, limit, D, I, true, s);
    bind_jobs(s.large, down.experts, s.ha, s.d.data(), D, s.down_jobs);
    run_gemms(kern, s.down_jobs.data(), s.down_jobs.size());
  } else {
    on_products(gate, up, down, act, alpha, limit, x, k, D, I, s);
  }
  const float* d = s.d.data();
  const int* row_of = s.row_of.data();
  Pool::instance().run((T + kSumTokens - 1) / kSumTokens, [&](int t) {
    weighted_sum(d, row_of, indices, scores, down.bias, t * kSumTokens, std::min(T, (t + 1) * kSumTokens), k, D, y);
  });
}

}  // namespace shoal
