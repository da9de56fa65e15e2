// Python bindings: `node.native._kernels`. Built with nanobind 3 in MLX's domain, so mx.array
// arguments and results cross as the same Python type mlx.core uses.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "choice.h"
#include "fused.h"
#include "gather.h"
#include "layers.h"
#include "matmul.h"
#include "moe.h"
#include "stack.h"
#include "tensor_link.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_kernels, m) {
  m.doc() = "Shoal's CPU kernels for weights kept as stored (MLX affine 4/8-bit, MXFP4, float16, bfloat16).";
  m.def("weight_matmul", &shoal::weight_matmul, "x"_a, "w"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
        "group_size"_a = 64, "bits"_a = 4, nb::kw_only(), "stream"_a = nb::none(),
        "x @ W.T with W as stored (uint8 scales: MXFP4); x float32 [..., K]; returns float32 [..., N].");
  m.def("gather_matmul", &shoal::gather_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a.none(), "indices"_a,
        nb::kw_only(), "group_size"_a = 64, "bits"_a = 4, "stream"_a = nb::none(),
        "mx.gather_qmm(x, w, scales, biases, rhs_indices=indices, transpose=True) for affine or MXFP4 "
        "(uint8 scales) experts; "
        "float32 [batch..., rows, N].");
  // An expert projection is (weight, scales, biases, bias, group_size, bits), absent parts None.
  m.def("moe_mlp", &shoal::moe_mlp, "x"_a, "indices"_a, "scores"_a, "gate"_a, "up"_a, "down"_a, nb::kw_only(),
        "activation"_a = "swiglu", "alpha"_a = 1.702f, "limit"_a = 7.0f, "stream"_a = nb::none(),
        "sum_j scores[..., j] * down(act(gate(x), up(x))) over each token's experts indices[..., j], in one "
        "operation (activation 'swiglu' or gpt_oss's 'swiglu_oai'); float32 [..., D].");
  m.def("moe_routed", &shoal::moe_routed, "x"_a, "router"_a, "gate"_a, "up"_a, "down"_a, nb::kw_only(), "top_k"_a,
        "routing"_a, "norm_topk_prob"_a = false, "activation"_a = "swiglu", "alpha"_a = 1.702f, "limit"_a = 7.0f,
        "stream"_a = nb::none(),
        "moe_mlp with the router inside: logits = router(x), each token's top_k experts and scores by `routing` "
        "('softmax_topk': qwen3_moe, 'topk_softmax': gpt_oss); float32 [..., D].");
  nb::class_<shoal::TensorLink>(m, "TensorLink",
                                "A tensor-parallel group's sockets (native/kernels/tensor_link.h).")
      .def(nb::new_([](std::vector<int> fds, int rank, double timeout_s, std::vector<nb::bytes> keys) {
             std::vector<std::string> raw;
             for (const nb::bytes& k : keys) raw.emplace_back(k.c_str(), k.size());
             return std::make_shared<shoal::TensorLink>(std::move(fds), rank, timeout_s, raw);
           }),
           "fds"_a, "rank"_a, "timeout_s"_a, "keys"_a = std::vector<nb::bytes>{},
           "keys: each rank's 32-byte pair key (b'' at this rank) to seal frames with; none: in the clear.")
      .def_prop_ro("sealed", &shoal::TensorLink::sealed)
      .def_prop_ro("rank", &shoal::TensorLink::rank)
      .def_prop_ro("size", &shoal::TensorLink::size)
      .def_prop_ro("ok", &shoal::TensorLink::ok)
      .def_prop_ro("error", &shoal::TensorLink::error)
      .def("close", &shoal::TensorLink::close)
      .def(
          "broadcast", [](shoal::TensorLink& l, nb::bytes b) { l.broadcast(std::string(b.c_str(), b.size())); },
          "payload"_a, nb::call_guard<nb::gil_scoped_release>(), "Rank 0: send a command to every other rank.")
      .def(
          "receive",
          [](shoal::TensorLink& l, double timeout_s) {
            std::string got;
            {
              nb::gil_scoped_release release;
              got = l.receive(timeout_s);
            }
            return nb::bytes(got.data(), got.size());
          },
          "timeout_s"_a, "Other ranks: rank 0's next command (b'' once the link is broken).");
  m.def("link_sum", &shoal::link_sum, "x"_a, "link"_a, nb::kw_only(), "stream"_a = nb::none(),
        "x summed over the link's ranks in rank order (float32).");
  m.def("link_gather", &shoal::link_gather, "x"_a, "link"_a, "widths"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Rank 0: the ranks' x side by side on the last axis; elsewhere zeros of that shape.");
  m.def("set_blas_library", &shoal::set_blas_library, "path"_a,
        "Load the sgemm of an OpenBLAS for the prefill path; returns '' or why not.");
  m.def("link_can_seal", &shoal::can_seal, "Whether tensor links can seal their frames (built with OpenSSL).");
  m.def("kernel_name", [] { return std::string(shoal::active_kernels().name); });
  m.def("int8_activations", [] { return shoal::active_kernels().int8; },
        "Whether the rows kernel rounds quantized weights' activations to int8 (else int16).");
  m.def("expert_int8_activations", [] { return shoal::expert_kernels().int8; },
        "The same for experts' products (moe_mlp, moe_routed, gather_matmul).");
  // Kernel sets chosen by measurement per layout and row class (node/cpu/calibration.py).
  m.def(
      "rows_candidates",
      [] {
        std::vector<std::string> names;
        for (const shoal::Kernels* k : shoal::rows_candidates()) names.push_back(k->name);
        return names;
      },
      "The kernel sets a small-batch product may run on here, widest first (the default first).");
  m.def("choose_rows_kernels", &shoal::choose_rows_kernels, "format"_a, "rows"_a, "name"_a,
        "Run `format`'s products of `rows` rows (1, or 2-8) on the set `name` ('': the default).");
  m.def("rows_choice", &shoal::rows_choice, "format"_a, "rows"_a, "The chosen set's name, '' for the default.");
  m.def("time_rows", &shoal::time_rows, "weights"_a, "rows"_a, "name"_a, "repeats"_a,
        "Seconds `repeats` rounds of one product per weight (as decoder projections: weight, scales, biases, "
        "bias, group_size, bits) with `rows` random rows take on the set `name`.");
  m.def("has_blas", &shoal::has_blas);
  m.def("threads", &shoal::pool_threads);
  // Fused CPU versions of mx.fast.rms_norm / rope / scaled_dot_product_attention (node/runner/fused.py).
  m.def("rms_norm", &shoal::rms_norm, "x"_a, "weight"_a.none(), "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rms_norm on the CPU in one pass; float32 out.");
  m.def("rope", &shoal::rope, "a"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a.none(), "scale"_a,
        "offset"_a, "freqs"_a = nb::none(), "stream"_a = nb::none(),
        "mx.fast.rope on the CPU in one pass; float32 out.");
  m.def("scaled_dot_product_attention", &shoal::sdpa, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a,
        "mask"_a = nb::none(), "sinks"_a = nb::none(), "stream"_a = nb::none(),
        "mx.fast.scaled_dot_product_attention on the CPU, rows split over the pool; float32 out.");
  m.def("silu", &shoal::silu, "x"_a, nb::kw_only(), "stream"_a = nb::none(), "nn.silu on the CPU in one pass.");
  m.def("logsumexp", &shoal::logsumexp, "x"_a, nb::kw_only(), "keepdims"_a, "stream"_a = nb::none(),
        "mx.logsumexp over the last axis on the CPU in one pass; float32 out.");
  // A decoder layer in two operations (node/cpu/fused_layers.py). A projection is the tuple
  // (weight, scales, biases, bias, group_size, bits), absent parts None.
  m.def("decoder_head", &shoal::decoder_head, "x"_a, "norm_weight"_a, "eps"_a, "projections"_a, "heads"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "rms_norm(x) * w, then each projection (+ bias) as [B, heads, L, head_dim].");
  m.def("decoder_tail", &shoal::decoder_tail, "attention"_a, "x"_a, "o"_a, "norm_weight"_a, "eps"_a, "gate"_a,
        "up"_a, "down"_a, nb::kw_only(), "link"_a = nb::none(), "stream"_a = nb::none(),
        "h = x + o(attention); h + down(silu(gate(n)) * up(n)) with n = rms_norm(h) * w (with a link, o's and "
        "down's outputs summed over its ranks first).");
  m.def("decode_attention", &shoal::decode_attention, "q"_a, "k"_a, "v"_a, "keys"_a, "values"_a, nb::kw_only(),
        "index"_a, "dims"_a, "traditional"_a, "base"_a.none(), "rope_scale"_a, "offset"_a, "scale"_a,
        "freqs"_a = nb::none(), "mask"_a = nb::none(), "stream"_a = nb::none(),
        "A decode step's rope, KV-cache write at `index` and attention: (out [B, 1, Hq * Dv], keys, values).");
  // A decode step of the whole layer stack in one operation (node/cpu/fused_stack.py). A plan's layer
  // is (norm, eps, q, k, v, q_norm, k_norm, qk_eps, o, post_norm, post_eps, gate, up, down).
  nb::class_<shoal::StackPlan>(m, "StackPlan")
      .def(nb::init<const std::vector<shoal::StackLayerArgs>&, int, int, std::shared_ptr<shoal::TensorLink>>(),
           "layers"_a, "q_heads"_a, "kv_heads"_a, "link"_a = nb::none())
      .def("__len__", &shoal::StackPlan::size);
  m.def("decoder_stack", &shoal::decoder_stack, "x"_a, "plan"_a, "keys"_a, "values"_a, nb::kw_only(), "index"_a,
        "dims"_a, "traditional"_a, "base"_a.none(), "rope_scale"_a, "offset"_a, "scale"_a, "freqs"_a = nb::none(),
        "mask"_a = nb::none(), "stream"_a = nb::none(),
        "x [B, 1, E] through every layer of the plan, each cache written in place at `index`; [B, 1, E].");
  m.def("exclusive", &shoal::exclusive, "arrays"_a,
        "Whether each array is evaluated, row-contiguous and the only holder of its buffer.");
  m.def("fused_kernel_name", [] { return std::string(shoal::active_fused().name); });
}
