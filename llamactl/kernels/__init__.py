"""llamactl's own kernels for the decode step: a leaf package (no nn.Module, no UI).

device     whether the kernels run on a device, and programmatic dependent launch there
arith      what the int4/int8 GEMVs multiply with (float, int8, fp16, int16)
gemv       16-bit, int8 and 4-bit matrix-vector products that read weights near memory bandwidth
int4_layout  the 4-bit packing and its dequantizing kernel (prefill)
attention  split-KV decode attention that reads the cache only up to the current position
pinned     tuned launch configs per GPU (data files in configs/)
check      a self-check of every kernel against a float64 reference
cache      Triton cache entries that travel with `llamactl compile` artifacts
cpu        the CPU kernels (cpu_gemv.cpp: low-bit and bf16 products), built with g++ at first use

They run on CUDA when Triton is importable; with TRITON_INTERPRET=1 they run on the CPU through
Triton's interpreter (slow; used by the tests). Layers that use them live in llamactl.layers.
"""
