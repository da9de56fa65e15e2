// Attention on the CPU: mx.fast.scaled_dot_product_attention's replacement (FusedSDPA) and a decode
// step's whole attention (DecodeAttention: rope, KV-cache write and attention in one operation).
// Both run `attend`, so a decode step's output has the bits of rope + cache update + FusedSDPA.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "fused.h"
#include "fused_util.h"

namespace shoal {

using namespace fused_detail;

namespace {
constexpr int kMaxChunkRows = 32;  // query rows per attention task: scores stay 32 x S floats

// Keys past the last one a row's array mask lets through add exact zeros (exp(-inf)): how many
// keys query rows [r0, r0 + R) of kv head hk need. mlx-lm's batched caches pass causal masks as
// arrays, so this is what spares their prefill the upper triangle. S if a row lets no key through
// (as in MLX, such a row averages all S values under a boolean mask, and is NaN under an additive one).
// Where the mask's row for batch b, query head h, position l starts (its keys are ms[3] apart).
long mask_row(const Attention& a, int b, int h, int l) { return b * a.ms[0] + h * a.ms[1] + l * a.ms[2]; }

int mask_reach(const Attention& a, int b, int hk, int r0, int R) {
  const int G = a.Hq / a.Hkv;
  const long step = a.ms[3];
  int reach = 0;
  for (int r = 0; r < R; r++) {
    const long at = mask_row(a, b, hk * G + (r0 + r) / a.L, (r0 + r) % a.L);
    int j = a.S;
    if (a.kind == MaskKind::Boolean) {
      const bool* m = static_cast<const bool*>(a.mask) + at;
      while (j > 0 && !m[(j - 1) * step]) j--;
    } else {
      const float* m = static_cast<const float*>(a.mask) + at;
      while (j > 0 && m[(j - 1) * step] == -std::numeric_limits<float>::infinity()) j--;
    }
    if (j == 0) return a.S;
    reach = std::max(reach, j);
  }
  return reach;
}

// The rows of a cache `at` elements in.
const void* head_rows(const void* cache, KvType t, long at) {
  return static_cast<const char*>(cache) + at * static_cast<long>(kv_bytes(t));
}
}  // namespace

void fused_detail::attend(const Attention& a) {
  const int B = a.B, Hq = a.Hq, L = a.L, D = a.D, Hkv = a.Hkv, S = a.S, Dv = a.Dv, G = Hq / Hkv;
  if (static_cast<long>(B) * Hq * L * Dv == 0) return;
  const MaskKind kind = a.kind;
  const bool array_mask = kind == MaskKind::Additive || kind == MaskKind::Boolean;
  const int q_off = std::max(0, S - L);  // causal: query l sees keys <= q_off + l (lower right)
  // Tasks: (batch, kv head, chunk of its G * L query rows), so each task reads its K/V once.
  Pool& pool = Pool::instance();
  const int per_head = G * L;
  const long work = static_cast<long>(B) * Hq * L * S * (D + Dv);
  const bool parallel = pool.threads() > 1 && work >= kParallelMinWork;
  int chunk = std::min(per_head, kMaxChunkRows);
  if (parallel) {
    const int want = 2 * pool.threads();  // a preempted thread then delays little
    const int splits = std::max(1, (want + B * Hkv - 1) / (B * Hkv));
    chunk = std::max(1, std::min(chunk, (per_head + splits - 1) / splits));
  }
  const int chunks = (per_head + chunk - 1) / chunk;
  const FusedKernels& fk = active_fused();
  auto task = [&](int t) {
    const int b = t / (Hkv * chunks), hk = t / chunks % Hkv, r0 = t % chunks * chunk;
    const int R = std::min(chunk, per_head - r0);
    thread_local std::vector<float> qbuf, scores, obuf;
    qbuf.resize(static_cast<size_t>(R) * D);
    // keys past every row's causal limit, or its mask's reach: never read
    int limit = kind == MaskKind::Causal ? 0 : array_mask ? mask_reach(a, b, hk, r0, R) : S;
    for (int r = 0; r < R; r++) {
      const int g = (r0 + r) / L, l = (r0 + r) % L;
      std::memcpy(qbuf.data() + static_cast<long>(r) * D, a.q + ((static_cast<long>(b) * Hq + hk * G + g) * L + l) * D,
                  4 * D);
      if (kind == MaskKind::Causal) limit = std::max(limit, std::min(S, q_off + l + 1));
    }
    scores.resize(static_cast<size_t>(R) * limit);
    obuf.resize(static_cast<size_t>(R) * Dv);
    fk.qk(qbuf.data(), R, head_rows(a.k, a.kv, b * a.ks[0] + hk * a.ks[1]), a.kv, a.ks[2], limit, D, a.scale,
          scores.data());
    for (int r = 0; r < R; r++) {
      const int h = hk * G + (r0 + r) / L, l = (r0 + r) % L;
      float* sc = scores.data() + static_cast<long>(r) * limit;
      const int last = kind == MaskKind::Causal ? std::min(limit, q_off + l + 1) : limit;
      constexpr float kNegInf = -std::numeric_limits<float>::infinity();
      for (int j = last; j < limit; j++) sc[j] = kNegInf;
      if (array_mask) {
        const long at = mask_row(a, b, h, l), step = a.ms[3];
        if (kind == MaskKind::Boolean) {  // as MLX: the lowest float, so a row with no key averages all
          constexpr float kLowest = std::numeric_limits<float>::lowest();
          const bool* mb = static_cast<const bool*>(a.mask) + at;
          for (int j = 0; j < limit; j++) sc[j] = mb[j * step] ? sc[j] : kLowest;
        } else {
          const float* mf = static_cast<const float*>(a.mask) + at;
          for (int j = 0; j < limit; j++) sc[j] += mf[j * step];
        }
      }
      // Softmax in float32 with the maximum subtracted; a sink adds a logit to the denominator.
      fk.softmax(sc, limit, a.sinks ? a.sinks[h * a.sink_stride] : kNegInf);
    }
    fk.pv(scores.data(), R, head_rows(a.v, a.kv, b * a.vs[0] + hk * a.vs[1]), a.kv, a.vs[2], limit, Dv,
          obuf.data());
    for (int r = 0; r < R; r++) {
      const int h = hk * G + (r0 + r) / L, l = (r0 + r) % L;
      std::memcpy(a.y + ((static_cast<long>(b) * Hq + h) * L + l) * Dv, obuf.data() + static_cast<long>(r) * Dv,
                  4 * Dv);
    }
  };
  const int tasks = B * Hkv * chunks;
  if (parallel) {
    pool.run(tasks, task);
  } else {
    for (int t = 0; t < tasks; t++) task(t);
  }
}

namespace {

// A cache (float32 or float16) as one row-major block: itself, or a copy in the buffer of its type.
struct KvCopy {
  std::vector<float> f32;
  std::vector<mx::float16_t> f16;
  const void* of(const mx::array& a) {
    if (kv_type(a) == KvType::F16) return dense(a, f16);
    return dense(a, f32);
  }
};

// k or v with a dense last axis: itself, or a row-major copy (rare: a transposed cache).
const void* dense_rows(const mx::array& a, KvCopy& copy, long st[3]) {
  if (a.strides()[3] == 1 || a.shape(3) == 1) {
    for (int d = 0; d < 3; d++) st[d] = a.strides()[d];
    return a.data<void>();
  }
  st[2] = a.shape(3), st[1] = st[2] * a.shape(2), st[0] = st[1] * a.shape(1);
  return copy.of(a);
}

// The strides that read `mask` (at most 4-D, right-aligned) as [B, Hq, L, S]: 0 on broadcast axes.
void mask_strides(const mx::array& mask, long ms[4]) {
  const int pad = 4 - static_cast<int>(mask.ndim());
  for (int d = 0; d < 4; d++) ms[d] = d < pad || mask.shape(d - pad) == 1 ? 0 : mask.strides()[d - pad];
}

// Whether nothing but this operation's `outputs` outputs hold `a` and its buffer: MLX's is_donatable(),
// for a primitive with several outputs (make_arrays gives each of them the inputs, so a donatable
// input has one handle per output). MLX keeps the handle count private; an mx::array is exactly
// one shared_ptr to its descriptor, which is what is_donatable() itself reads.
bool only_ours(const mx::array& a, size_t outputs) {
  static_assert(sizeof(mx::array) == sizeof(std::shared_ptr<void>));
  const long handles = reinterpret_cast<const std::shared_ptr<void>&>(a).use_count();
  return handles == static_cast<long>(outputs) && a.data_shared_ptr().use_count() == 1 &&
         a.data_shared_ptr()->is_owned();
}

MaskKind mask_kind(const mx::array& mask) { return mask.dtype() == mx::bool_ ? MaskKind::Boolean : MaskKind::Additive; }

}  // namespace

// ---- scaled dot-product attention ----

namespace {

// The mask as an input of an attention primitive, checked against [B, Hq, L, S]; read broadcast.
mx::array mask_input(const mx::array& m, const mx::Shape& target, const char* op, mx::StreamOrDevice s) {
  if (m.ndim() > 4) throw std::invalid_argument(std::string("[") + op + "] an array mask has at most 4 dimensions");
  const int pad = 4 - static_cast<int>(m.ndim());
  for (int d = pad; d < 4; d++)
    if (m.shape(d - pad) != 1 && m.shape(d - pad) != target[d])
      throw std::invalid_argument(std::string("[") + op + "] the mask does not broadcast to [B, Hq, L, S]");
  return m.dtype() == mx::bool_ ? m : mx::astype(m, mx::float32, s);
}

}  // namespace

mx::array sdpa(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
               const std::optional<std::variant<std::string, mx::array>>& mask,
               const std::optional<mx::array>& sinks, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("[shoal sdpa] q, k and v must be 4-D");
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Hkv = k.shape(1), S = k.shape(2);
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S || k.shape(3) != q.shape(3) ||
      Hkv == 0 || Hq % Hkv)
    throw std::invalid_argument("[shoal sdpa] q [B, Hq, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], Hkv | Hq");
  // A float16 cache is read as it is; keys and values of other or mixed types as float32.
  const mx::Dtype kv = k.dtype() == mx::float16 && v.dtype() == mx::float16 ? mx::float16 : mx::float32;
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s), mx::astype(k, kv, s), mx::astype(v, kv, s)};
  MaskKind kind = MaskKind::None;
  if (mask && std::holds_alternative<std::string>(*mask)) {
    if (std::get<std::string>(*mask) != "causal") throw std::invalid_argument("[shoal sdpa] mask must be 'causal'");
    kind = MaskKind::Causal;
  } else if (mask) {
    const mx::array& m = std::get<mx::array>(*mask);
    kind = mask_kind(m);
    inputs.push_back(mask_input(m, {B, Hq, L, S}, "shoal sdpa", s));
  }
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != Hq) throw std::invalid_argument("[shoal sdpa] sinks must be [Hq]");
    inputs.push_back(mx::astype(*sinks, mx::float32, s));
  }
  auto primitive = std::make_shared<FusedSDPA>(mx::to_stream(s), scale, kind, sinks.has_value());
  return mx::array({B, Hq, L, v.shape(3)}, mx::float32, primitive, std::move(inputs));
}

void FusedSDPA::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  dispatch(stream(), inputs, {out}, [in = weak(inputs), y = out.data<float>(), scale = scale_, kind = mask_,
                                     has_sinks = sinks_]() {
    const mx::array& q = in[0];
    std::vector<float> qcopy;
    KvCopy kcopy, vcopy;
    Attention a{dense(q, qcopy), q.shape(0), q.shape(1), q.shape(2), q.shape(3), nullptr, {}, nullptr, {},
                in[1].shape(1), in[1].shape(2), in[2].shape(3), kv_type(in[1]), scale, kind, nullptr, {}, nullptr,
                0, y};
    a.k = dense_rows(in[1], kcopy, a.ks);
    a.v = dense_rows(in[2], vcopy, a.vs);
    if (kind == MaskKind::Additive || kind == MaskKind::Boolean) {
      a.mask = kind == MaskKind::Boolean ? static_cast<const void*>(in[3].data<bool>()) : in[3].data<float>();
      mask_strides(in[3], a.ms);
    }
    if (has_sinks) a.sinks = in.back().data<float>(), a.sink_stride = in.back().strides()[0];
    attend(a);
  });
}

bool FusedSDPA::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const FusedSDPA&>(other);
  return scale_ == o.scale_ && mask_ == o.mask_ && sinks_ == o.sinks_;
}

std::vector<mx::Shape> FusedSDPA::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), inputs[0].shape(2), inputs[2].shape(3)}};
}

// ---- a decode step's attention on the KV cache ----

std::vector<float> fused_detail::decode_angles(const DecodeAttention::Params& p, int B, const int32_t* offsets,
                                              long offset_stride, const float* freqs, long freq_stride) {
  const std::vector<float> inv = rope_inverse_frequencies(p.dims, p.base, freqs, freq_stride);
  std::vector<float> angles(static_cast<size_t>(B) * p.dims);
  for (int b = 0; b < B; b++)  // as FusedRoPE: position (0 + offset) * scale
    rope_angles(inv, static_cast<float>(offsets[b * offset_stride]) * p.rope_scale, angles.data() + b * p.dims);
  return angles;
}

void fused_detail::decode_step(const DecodeStep& s) {
  const auto& p = s.p;
  const int B = s.B, Hq = s.Hq, Hkv = s.Hkv, D = s.D, Dv = s.Dv;
  thread_local std::vector<float> qr, kr;
  qr.resize(static_cast<size_t>(B) * Hq * D);
  kr.resize(D);
  const long unit = static_cast<long>(kv_bytes(s.kv));
  auto at = [unit](void* cache, const long st[3], int b, int h, int index) {
    return static_cast<char*>(cache) + (b * st[0] + h * st[1] + index * st[2]) * unit;
  };
  for (int b = 0; b < B; b++) {
    const float* angles = s.angles + b * p.dims;
    for (int h = 0; h < Hq; h++) {
      const long row = static_cast<long>(b) * Hq + h;
      rope_row(s.q + row * D, D, p.dims, p.traditional, angles, qr.data() + row * D);
    }
    for (int h = 0; h < Hkv; h++) {
      const long row = static_cast<long>(b) * Hkv + h;
      rope_row(s.k + row * D, D, p.dims, p.traditional, angles, kr.data());
      store_kv(kr.data(), D, at(s.kc, s.kst, b, h, p.index), s.kv);
      store_kv(s.v + row * Dv, Dv, at(s.vc, s.vst, b, h, p.index), s.kv);
    }
  }
  Attention a{qr.data(), B, Hq, 1, D, s.kc, {s.kst[0], s.kst[1], s.kst[2]}, s.vc, {s.vst[0], s.vst[1], s.vst[2]},
              Hkv, p.index + 1, Dv, s.kv, p.scale, p.mask, nullptr, {}, nullptr, 0, s.out};
  if (p.mask != MaskKind::None) {
    const mx::array& m = *s.mask;
    a.mask = p.mask == MaskKind::Boolean ? static_cast<const void*>(m.data<bool>()) : m.data<float>();
    mask_strides(m, a.ms);
  }
  attend(a);
}

DecodeAttention::Params fused_detail::decode_inputs(const char* op, int B, int Hq, int D, int index, int dims,
                                                    bool traditional, std::optional<float> base, float rope_scale,
                                                    const std::variant<int, mx::array>& offset, float scale,
                                                    const std::optional<mx::array>& freqs,
                                                    const std::optional<mx::array>& mask,
                                                    std::vector<mx::array>& inputs, mx::StreamOrDevice s) {
  if (dims <= 0 || dims % 2 || dims > D || freqs.has_value() == base.has_value())
    throw std::invalid_argument(std::string("[") + op + "] rope: even dims <= D, and exactly one of base and freqs");
  mx::array off = std::holds_alternative<int>(offset) ? mx::array(std::get<int>(offset), mx::int32)
                                                       : mx::astype(std::get<mx::array>(offset), mx::int32, s);
  if (off.ndim() > 1 || (off.size() != 1 && off.size() != static_cast<size_t>(B)))
    throw std::invalid_argument(std::string("[") + op + "] offset must be a scalar or one per sequence");
  inputs.push_back(off);
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != dims / 2)
      throw std::invalid_argument(std::string("[") + op + "] freqs must be 1-D with dims / 2 values");
    inputs.push_back(mx::astype(*freqs, mx::float32, s));
  }
  MaskKind kind = MaskKind::None;
  if (mask) {
    kind = mask_kind(*mask);
    inputs.push_back(mask_input(*mask, {B, Hq, 1, index + 1}, op, s));
  }
  return {index, dims, traditional, base.value_or(0.0f), rope_scale, scale, freqs.has_value(), kind};
}

std::vector<mx::array> decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& keys, const mx::array& values, int index, int dims,
                                        bool traditional, std::optional<float> base, float rope_scale,
                                        const std::variant<int, mx::array>& offset, float scale,
                                        const std::optional<mx::array>& freqs,
                                        const std::optional<mx::array>& mask, mx::StreamOrDevice s) {
  constexpr const char* op = "shoal decode_attention";
  for (const mx::array* a : {&q, &k, &v, &keys, &values})
    if (a->ndim() != 4) throw std::invalid_argument(std::string("[") + op + "] q, k, v and the caches must be 4-D");
  const int B = q.shape(0), Hq = q.shape(1), D = q.shape(3), Hkv = k.shape(1), Dv = v.shape(3), C = keys.shape(2);
  if (q.shape(2) != 1 || k.shape(2) != 1 || v.shape(2) != 1)
    throw std::invalid_argument(std::string("[") + op + "] q, k and v hold one position each");
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hkv || k.shape(3) != D || Hkv == 0 || Hq % Hkv ||
      keys.shape() != mx::Shape{B, Hkv, C, D} || values.shape() != mx::Shape{B, Hkv, C, Dv})
    throw std::invalid_argument(std::string("[") + op + "] q [B, Hq, 1, D], k [B, Hkv, 1, D], v [B, Hkv, 1, Dv], "
                                "keys [B, Hkv, C, D], values [B, Hkv, C, Dv], Hkv | Hq");
  if (keys.dtype() != values.dtype() || (keys.dtype() != mx::float32 && keys.dtype() != mx::float16))
    throw std::invalid_argument(std::string("[") + op + "] the caches must be both float32 or both float16");
  if (index < 0 || index >= C) throw std::invalid_argument(std::string("[") + op + "] index is outside the caches");
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, s), mx::astype(k, mx::float32, s),
                                mx::astype(v, mx::float32, s), keys, values};
  const DecodeAttention::Params p = decode_inputs(op, B, Hq, D, index, dims, traditional, base, rope_scale, offset,
                                                  scale, freqs, mask, inputs, s);
  return mx::array::make_arrays({{B, 1, Hq * Dv}, keys.shape(), values.shape()},
                                {mx::float32, keys.dtype(), keys.dtype()},
                                std::make_shared<DecodeAttention>(mx::to_stream(s), p), std::move(inputs));
}

void DecodeAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  std::vector<bool> copied;  // per cache: false when its buffer was donated to the output
  for (int i : {1, 2}) {
    const mx::array& cache = inputs[i + 2];
    const bool donate = only_ours(cache, outputs.size()) && cache.flags().row_contiguous;
    if (donate) {
      outputs[i].copy_shared_buffer(cache);
    } else {
      outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
    }
    copied.push_back(!donate);
  }
  dispatch(stream(), inputs, outputs, [in = weak(inputs), out = weak(outputs), copied, p = p_]() mutable {
    const mx::array &q = in[0], &off = in[5];
    for (int i : {0, 1}) {  // a cache that was not donated is copied first (MLX's slice update does the same)
      if (copied[i]) {
        KvCopy copy;
        std::memcpy(out[1 + i].data<void>(), copy.of(in[3 + i]), out[1 + i].nbytes());
      }
    }
    std::vector<float> qcopy, kcopy, vcopy;
    const std::vector<float> angles =
        decode_angles(p, q.shape(0), off.data<int32_t>(), off.size() == 1 ? 0 : static_cast<long>(off.strides()[0]),
                      p.freqs ? in[6].data<float>() : nullptr, p.freqs ? in[6].strides()[0] : 0);
    DecodeStep step{p, q.shape(0), q.shape(1), in[1].shape(1), q.shape(3), in[2].shape(3), dense(q, qcopy),
                    dense(in[1], kcopy), dense(in[2], vcopy), angles.data(), out[1].data<void>(), {},
                    out[2].data<void>(), {}, kv_type(out[1]), nullptr, out[0].data<float>()};
    for (int d = 0; d < 3; d++) step.kst[d] = out[1].strides()[d], step.vst[d] = out[2].strides()[d];
    if (p.mask != MaskKind::None) step.mask = &in.back();
    decode_step(step);
  });
}

bool DecodeAttention::is_equivalent(const mx::Primitive& other) const {
  return p_ == static_cast<const DecodeAttention&>(other).p_;
}

std::vector<mx::Shape> DecodeAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), 1, inputs[0].shape(1) * inputs[2].shape(3)}, inputs[3].shape(), inputs[4].shape()};
}

}  // namespace shoal
