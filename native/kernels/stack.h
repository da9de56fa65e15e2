// A decode step of a whole llama-family layer stack as one MLX operation (native/kernels/stack.cpp).
//
// The per-layer primitives (layers.h, DecodeAttention) make a decode step three operations a layer.
// Each costs ~5 us of scheduling on the CPU stream and ~15 us of Python to build: for SmolLM2's 30
// layers, ~0.9 ms of a ~6.5 ms token. This operation runs every layer's head, attention and tail in
// one task, with the same functions and so the same bits.
//
// The KV caches are written in place, at position `index`: an operation with a cache output per
// layer would copy every input handle into each of its 2 x layers outputs (MLX's make_arrays) each
// step. So the caller hands over only caches no other array shares a buffer with (`exclusive`);
// the views mlx-lm takes of a cache read positions below `index`, which the step never changes.
#pragma once

#include <memory>
#include <optional>
#include <tuple>
#include <variant>
#include <vector>

#include "fused.h"
#include "layers.h"

namespace shoal {

// One layer as Python hands it over: input norm weight and eps; q, k, v projections; q and k per-head
// norm weights (qwen3: both, else neither) and their eps; o; post-attention norm weight and eps; gate,
// up, down. Head counts come with the plan.
using StackLayerArgs = std::tuple<mx::array, float, Projection, Projection, Projection, std::optional<mx::array>,
                                  std::optional<mx::array>, float, Projection, mx::array, float, Projection,
                                  Projection, Projection>;

// Every layer's weights, checked and listed once per model: a step hands over only its caches.
struct StackPlan {
  struct Layer {
    float eps, qk_eps, post_eps;
    bool qk_norm;
    std::vector<ProjectionDesc> projections;  // q, k, v, o, gate, up, down
  };
  StackPlan(const std::vector<StackLayerArgs>& layers, int q_heads, int kv_heads,
            std::shared_ptr<TensorLink> link = nullptr);
  int E, Hq, Hkv, D, Dv;
  std::shared_ptr<TensorLink> link;  // a tensor-parallel slice's (tail_rows sums over it)
  std::shared_ptr<const std::vector<Layer>> layers;
  std::vector<mx::array> arrays;  // per layer: norm, q, k, v, [q norm, k norm], o, post norm, gate, up, down
  size_t size() const { return layers->size(); }
};

class DecoderStack : public mx::Primitive {
 public:
  DecoderStack(mx::Stream stream, const StackPlan& plan, DecodeAttention::Params p)
      : mx::Primitive(stream), layers_(plan.layers), E_(plan.E), Hq_(plan.Hq), Hkv_(plan.Hkv), D_(plan.D),
        Dv_(plan.Dv), link_(plan.link), p_(p) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override { no_gpu(name()); }
  const char* name() const override { return "ShoalDecoderStack"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  std::shared_ptr<const std::vector<StackPlan::Layer>> layers_;
  int E_, Hq_, Hkv_, D_, Dv_;
  std::shared_ptr<TensorLink> link_;
  DecodeAttention::Params p_;
};

// x [B, 1, E] through every layer of `plan`; keys[l] [B, Hkv, C, D] and values[l] [B, Hkv, C, Dv]
// (float32 or float16, row-contiguous) get the step's position written at `index`. Rope, offset, scale, freqs
// and mask as decode_attention takes them. Returns the last layer's output [B, 1, E].
mx::array decoder_stack(const mx::array& x, const StackPlan& plan, const std::vector<mx::array>& keys,
                        const std::vector<mx::array>& values, int index, int dims, bool traditional,
                        std::optional<float> base, float rope_scale, const std::variant<int, mx::array>& offset,
                        float scale, const std::optional<mx::array>& freqs, const std::optional<mx::array>& mask,
                        mx::StreamOrDevice s = {});

// Whether each array is evaluated, row-contiguous and the only one holding its buffer: what a cache
// must be for decoder_stack to write it in place.
bool exclusive(const std::vector<mx::array>& arrays);

}  // namespace shoal
