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
  std::vector<GemmJob> gate_jobs, up_jobs, down_jobs;
  std::vector<PanelTask> tasks;
  GemmActs xa, ha;
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

// Gate, up and the activation of every group on `gemm`: one task per panel of gate's rows.
void gate_up_on_gemm(const Kernels& k, const BoundExperts& gate, const BoundExperts& up, Activation act,
                     float alpha, float limit, int I, Scratch& s) {
  bind_jobs(s.groups, gate.experts, s.xa, s.g.data(), I, s.gate_jobs);
  bind_jobs(s.groups, up.experts, s.xa, s.u.data(), I, s.up_jobs);
  panel_tasks(s.gate_jobs.data(), s.gate_jobs.size(), s.tasks);
  Pool::instance().run(static_cast<int>(s.tasks.size()), [&](int t) {
    const PanelTask& p = s.tasks[t];
    const GemmJob &gj = s.gate_jobs[p.job], &uj = s.up_jobs[p.job];
    k.gemm(gj.w, gj.a, gj.y, gj.ldy, p.n0, p.n1);
    k.gemm(uj.w, uj.a, uj.y, uj.ldy, p.n0, p.n1);
    const Group& g = s.groups[p.job];
    activate_rows(gate, up, act, alpha, limit, g.e, g.begin, g.end, p.n0, p.n1, I, s);
  });
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
  const Kernels& kern = active_kernels();
  if (gemm_takes(kern, gate.experts.first) && gemm_takes(kern, down.experts.first)) {
    s.src.resize(rows);
    for (int r = 0; r < rows; r++) s.src[r] = x + static_cast<long>(s.order[r] / k) * D;
    s.xa.prepare(kern, gate.experts.first, s.src.data(), rows);
    gate_up_on_gemm(kern, gate, up, act, alpha, limit, I, s);
    for (int r = 0; r < rows; r++) s.src[r] = &s.h[static_cast<size_t>(r) * I];
    s.ha.prepare(kern, down.experts.first, s.src.data(), rows);
    bind_jobs(s.groups, down.experts, s.ha, s.d.data(), D, s.down_jobs);
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
