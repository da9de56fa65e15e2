// Python bindings: `node.native._kernels`. Built with nanobind 3 in MLX's domain, so mx.array
// arguments and results cross as the same Python type mlx.core uses.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "matmul.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_kernels, m) {
  m.doc() = "Shoal's CPU kernels for weights kept as stored (MLX affine 4/8-bit, float16, bfloat16).";
  m.def("weight_matmul", &shoal::weight_matmul, "x"_a, "w"_a, "scales"_a = nb::none(), "biases"_a = nb::none(),
        "group_size"_a = 64, "bits"_a = 4, nb::kw_only(), "stream"_a = nb::none(),
        "x @ W.T with W as stored; x float32 [..., K]; returns float32 [..., N].");
  m.def("set_blas_library", &shoal::set_blas_library, "path"_a,
        "Load the sgemm of an OpenBLAS for the prefill path; returns '' or why not.");
  m.def("kernel_name", [] { return std::string(shoal::active_kernels().name); });
  m.def("has_blas", &shoal::has_blas);
  m.def("threads", &shoal::pool_threads);
}
