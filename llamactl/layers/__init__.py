"""The runtime's linear layers and the step that puts the fast ones into a model.

fused  the 16-bit GEMV linear; RMSNorm, SwiGLU and residual folding (FusedIO)
int4   4-bit layers: llamactl's GEMV (TritonInt4Linear) or PyTorch's tinygemm (Int4Linear)
int8   per-channel int8 layers (Int8Kernel): llamactl's GEMV or torch's _weight_int8pack_mm
gptq   the GPTQ checkpoint format and its dequantizing layer (GPTQLinear)
bnb    readers of bitsandbytes NF4 / LLM.int8 checkpoints
plan   prepare(model, options) -> Plan: what runs, chosen once

Depends on llamactl.kernels, never the reverse.
"""
