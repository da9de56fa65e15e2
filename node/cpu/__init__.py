"""How models run on the CPU here, for runners and pipeline stages alike.

The weight policy at load (`dtype`: keep as stored on the native kernels, else float32), the
kernel layers that hold the stored arrays (`kernel_layers`), the fused norm/rope/attention/SiLU
ops (`fused`), one-layer-at-a-time prefill (`layer_eval`), the BLAS shim's environment for
child processes (`fastpath`) and the one memory probe (`memory`: psutil capped by cgroup limits)
that placement and the weight policy both use. Below `runner/` and `pipeline/` (both use it),
above `native/`.
"""
