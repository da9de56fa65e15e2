// Which kernel set runs each layout's small-batch products, chosen by measurement on this CPU
// (node/cpu/calibration.py), instead of by instruction set alone: the widest set is not the
// fastest everywhere (a CPU that splits 512-bit work into two halves, a different cache size).
#pragma once

#include <string>
#include <vector>

#include "layers.h"

namespace shoal {

// The kernel sets this CPU runs (SHOAL_KERNEL_ISA=portable, avx2 or avx512 caps the instruction set,
// to compare them or to rule one out), widest first; int8: the int8-activation variants of those
// that have one (AVX-512 VNNI).
std::vector<const Kernels*> supported_kernels(bool int8);
// The sets a rows product may be given: those above with active_kernels()'s activations, so a
// choice never changes how activations are rounded (portable only where it is the only one).
std::vector<const Kernels*> rows_candidates();
// The set that runs `format`'s rows products of M rows (1: decode, 2..kMaxRows: small batches):
// the one chosen for them, else active_kernels().
const Kernels& rows_kernels(Format format, int M);
// Choose the candidate named `name` for `format` ("affine4", "affine8", "mxfp4", "f16", "bf16",
// "f32") at `rows` rows (its class); "" puts the default back. Unknown names are errors.
void choose_rows_kernels(const std::string& format, int rows, const std::string& name);
std::string rows_choice(const std::string& format, int rows);
// Seconds `repeats` rounds of one rows product per weight (M random rows) take on the candidate
// `name`; what calibration compares.
double time_rows(const std::vector<Projection>& weights, int M, const std::string& name, int repeats);

}  // namespace shoal
