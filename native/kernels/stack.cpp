// The layer stack's decode step (stack.h): per layer head_rows, the q/k norms, decode_step and
// tail_rows, exactly what DecoderHead, RMSNorm, DecodeAttention and DecoderTail run one by one.
#include "stack.h"

#include <stdexcept>
#include <string>

#include "fused_util.h"

namespace shoal {

using namespace fused_detail;

namespace {

constexpr const char* kOp = "[shoal decoder_stack] ";

std::invalid_argument bad(const std::string& what) { return std::invalid_argument(kOp + what); }

// A norm weight as a dense float32 [n] input.
mx::array norm_input(const mx::array& w, int n, const char* what) {
  if (w.ndim() != 1 || w.shape(0) != n) throw bad(std::string(what) + " must be [" + std::to_string(n) + "]");
  return mx::contiguous(mx::astype(w, mx::float32));
}

}  // namespace

StackPlan::StackPlan(const std::vector<StackLayerArgs>& args, int q_heads, int kv_heads, std::shared_ptr<TensorLink> link)
    : Hq(q_heads), Hkv(kv_heads), link(std::move(link)) {
  if (args.empty()) throw bad("the plan needs at least one layer");
  if (Hq <= 0 || Hkv <= 0 || Hq % Hkv) throw bad("head counts: kv heads must divide q heads");
  auto built = std::make_shared<std::vector<Layer>>();
  E = std::get<0>(args[0]).ndim() == 1 ? std::get<0>(args[0]).shape(0) : 0;
  for (const auto& a : args) {
    const auto& [norm, eps, q, k, v, q_norm, k_norm, qk_eps, o, post, post_eps, gate, up, down] = a;
    Layer layer{eps, qk_eps, post_eps, q_norm.has_value(), {}};
    if (q_norm.has_value() != k_norm.has_value()) throw bad("give both q and k norms or neither");
    auto& d = layer.projections;
    d = {describe(q, E, "q"), describe(k, E, "k"), describe(v, E, "v")};
    if (d[0].spec.N % Hq || d[1].spec.N % Hkv || d[2].spec.N % Hkv) throw bad("q, k, v do not split into heads");
    const int head_dim = d[0].spec.N / Hq, value_dim = d[2].spec.N / Hkv;
    if (d[1].spec.N / Hkv != head_dim) throw bad("q and k heads differ in size");
    if (built->empty()) D = head_dim, Dv = value_dim;
    if (head_dim != D || value_dim != Dv) throw bad("every layer must have the same heads");
    d.push_back(describe(o, Hq * Dv, "o"));
    d.push_back(describe(gate, E, "gate"));
    d.push_back(describe(up, E, "up"));
    d.push_back(describe(down, d[4].spec.N, "down"));
    if (d[3].spec.N != E || d[5].spec.N != d[4].spec.N || d[6].spec.N != E) throw bad("o, gate, up, down do not chain");
    for (size_t i = 3; i < d.size(); i++)
      if (d[i].bias) throw bad("o, gate, up and down cannot have a bias");
    arrays.push_back(norm_input(norm, E, "the input norm"));
    for (const Projection* p : {&q, &k, &v}) push(*p, arrays, {});
    if (q_norm) arrays.push_back(norm_input(*q_norm, D, "q norm")), arrays.push_back(norm_input(*k_norm, D, "k norm"));
    push(o, arrays, {});
    arrays.push_back(norm_input(post, E, "the post-attention norm"));
    for (const Projection* p : {&gate, &up, &down}) push(*p, arrays, {});
    built->push_back(std::move(layer));
  }
  mx::eval(arrays);
  layers = std::move(built);
}

bool exclusive(const std::vector<mx::array>& arrays) {
  for (const auto& a : arrays) {
    if (!a.is_available() || !a.flags().row_contiguous) return false;
    const auto& data = a.data_shared_ptr();
    if (!data || data.use_count() != 1) return false;
  }
  return true;
}

mx::array decoder_stack(const mx::array& x, const StackPlan& plan, const std::vector<mx::array>& keys,
                        const std::vector<mx::array>& values, int index, int dims, bool traditional,
                        std::optional<float> base, float rope_scale, const std::variant<int, mx::array>& offset,
                        float scale, const std::optional<mx::array>& freqs, const std::optional<mx::array>& mask,
                        mx::StreamOrDevice s) {
  if (x.ndim() != 3 || x.shape(1) != 1 || x.shape(2) != plan.E) throw bad("x must be [B, 1, E]");
  if (keys.size() != plan.size() || values.size() != plan.size()) throw bad("give one key and value cache a layer");
  const int B = x.shape(0);
  if (index < 0) throw bad("index is outside the caches");
  for (size_t l = 0; l < plan.size(); l++) {
    const mx::array &k = keys[l], &v = values[l];
    if (k.ndim() != 4 || v.ndim() != 4 || k.dtype() != v.dtype() ||
        (k.dtype() != mx::float32 && k.dtype() != mx::float16) ||
        k.shape() != mx::Shape{B, plan.Hkv, k.shape(2), plan.D} ||
        v.shape() != mx::Shape{B, plan.Hkv, k.shape(2), plan.Dv})
      throw bad("caches must be keys [B, Hkv, C, D] and values [B, Hkv, C, Dv], both float32 or both float16");
    if (index >= k.shape(2)) throw bad("index is outside the caches");
  }
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, s)};
  const DecodeAttention::Params p = decode_inputs("shoal decoder_stack", B, plan.Hq, plan.D, index, dims, traditional,
                                                  base, rope_scale, offset, scale, freqs, mask, inputs, s);
  inputs.insert(inputs.end(), plan.arrays.begin(), plan.arrays.end());
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  return mx::array(x.shape(), mx::float32, std::make_shared<DecoderStack>(mx::to_stream(s), plan, p),
                   std::move(inputs));
}

void DecoderStack::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  using Layer = StackPlan::Layer;
  mx::array& result = outputs[0];
  result.set_data(mx::allocator::malloc(result.nbytes()));
  const std::vector<Layer>& layers = *layers_;
  const size_t n = layers.size(), first_cache = inputs.size() - 2 * n;
  // Raw pointers for the task: MLX keeps every input's buffer alive until it has run.
  struct Bounds {
    const float *norm, *q_norm, *k_norm, *post;
    std::vector<Bound> head;  // q, k, v
    std::vector<Bound> tail;  // o, gate, up, down
    void *kc, *vc;
    long kst[3], vst[3];
    KvType kv;
  };
  std::vector<Bounds> bound(n);
  size_t at = p_.freqs ? 3 : 2;
  const mx::array* mask = p_.mask != MaskKind::None ? &inputs[at++] : nullptr;
  for (size_t l = 0; l < n; l++) {
    Bounds& b = bound[l];
    b.norm = inputs[at++].data<float>();
    for (int i = 0; i < 3; i++) b.head.push_back(bound_at(layers[l].projections[i], inputs, at));
    b.q_norm = layers[l].qk_norm ? inputs[at++].data<float>() : nullptr;
    b.k_norm = layers[l].qk_norm ? inputs[at++].data<float>() : nullptr;
    b.tail.push_back(bound_at(layers[l].projections[3], inputs, at));
    b.post = inputs[at++].data<float>();
    for (int i = 4; i < 7; i++) b.tail.push_back(bound_at(layers[l].projections[i], inputs, at));
    const mx::array &k = inputs[first_cache + l], &v = inputs[first_cache + n + l];
    if (!k.flags().row_contiguous || !v.flags().row_contiguous) throw bad("caches must be row-contiguous");
    b.kc = const_cast<void*>(k.data<void>()), b.vc = const_cast<void*>(v.data<void>()), b.kv = kv_type(k);
    for (int d = 0; d < 3; d++) b.kst[d] = k.strides()[d], b.vst[d] = v.strides()[d];
  }
  const mx::array& x = inputs[0];
  DecodeStep step{p_, x.shape(0), Hq_, Hkv_, D_, Dv_, nullptr, nullptr, nullptr, nullptr, nullptr, {}, nullptr, {},
                  KvType::F32, nullptr, nullptr};
  std::optional<mx::array> mask_copy;
  if (mask) mask_copy = mx::array::unsafe_weak_copy(*mask);
  // The inputs' values exist only once the stream reaches this task (their buffers already do).
  dispatch(stream(), {}, {}, [bound = std::move(bound), layers = layers_, step, mask_copy = std::move(mask_copy),
                              xin = mx::array::unsafe_weak_copy(x), off = mx::array::unsafe_weak_copy(inputs[1]),
                              freqs = p_.freqs ? inputs[2].data<float>() : nullptr,
                              freq_stride = p_.freqs ? inputs[2].strides()[0] : 0, y = result.data<float>(),
                              E = E_, link = link_]() mutable {
    thread_local std::vector<float> xcopy;
    thread_local std::vector<float> h[2], q, k, v, att;
    const long M = step.B;
    q.resize(M * step.Hq * step.D), k.resize(M * step.Hkv * step.D), v.resize(M * step.Hkv * step.Dv);
    att.resize(M * step.Hq * step.Dv);
    h[0].resize(M * E), h[1].resize(M * E);
    // Rope's angles are the same for every layer: computed once a step.
    const std::vector<float> angles = decode_angles(step.p, step.B, off.data<int32_t>(),
                                                    off.size() == 1 ? 0 : static_cast<long>(off.strides()[0]), freqs,
                                                    freq_stride);
    step.q = q.data(), step.k = k.data(), step.v = v.data(), step.out = att.data(), step.angles = angles.data();
    if (mask_copy) step.mask = &*mask_copy;
    const float* in = row_major(xin, xcopy);
    const std::vector<float*> qkv{q.data(), k.data(), v.data()};
    for (size_t l = 0; l < bound.size(); l++) {
      const Bounds& b = bound[l];
      const StackPlan::Layer& layer = (*layers)[l];
      head_rows(in, M, E, b.norm, layer.eps, b.head, qkv);
      if (layer.qk_norm) {  // as the RMSNorm modules on [B, heads, 1, D]
        rms_rows(q.data(), M * step.Hq, step.D, b.q_norm, layer.qk_eps, q.data());
        rms_rows(k.data(), M * step.Hkv, step.D, b.k_norm, layer.qk_eps, k.data());
      }
      step.kc = b.kc, step.vc = b.vc, step.kv = b.kv;
      for (int d = 0; d < 3; d++) step.kst[d] = b.kst[d], step.vst[d] = b.vst[d];
      decode_step(step);
      float* out = l + 1 == bound.size() ? y : h[l % 2].data();
      tail_rows(att.data(), in, M, E, b.post, layer.post_eps, b.tail[0], b.tail[1], b.tail[2], b.tail[3], out,
                link.get());
      in = out;
    }
  });
}

bool DecoderStack::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DecoderStack&>(other);
  return layers_ == o.layers_ && p_ == o.p_ && link_ == o.link_;
}

}  // namespace shoal
