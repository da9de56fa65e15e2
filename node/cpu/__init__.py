"""How models run on the CPU here, for runners and pipeline stages alike.

The weight policy at load (`dtype`: keep as stored on the native kernels, else float32), the
kernel layers that hold the stored arrays (`kernel_layers`), the fused norm/rope/attention/SiLU
ops (`fused`), one-layer-at-a-time prefill (`layer_eval`) and the BLAS shim's environment for
child processes (`fastpath`). Below `runner/` and `pipeline/`, above `native/`: both floors use it.
"""
