"""What rounding the int4/int8 GEMVs' inputs to int8 (LLAMACTL_QUANT_INPUTS=int8) costs in quality, on the CPU.

The kernel rounds each projection's input to int8 per 32 columns (127 / max |x|, after the folded
RMSNorm/SwiGLU) and multiplies in integers; here every projection's input is rounded the same way
(a forward pre-hook; lm_head is left as it is, as in the kernel path) and the model scored with
llamactl's quality.measure (KL against the parent, 16K tokens of the packaged eval text).
Usage: python scripts/quant_inputs_kl.py PARENT CHILD   (CHILD: e.g. `llamactl quantize PARENT --method rtn -o CHILD`)
"""

from __future__ import annotations

import sys

import torch

from llamactl import quality
from llamactl.artifact import open_artifact
from llamactl.load import load_model


def int8_per_32(module, args):
    x = args[0]  # [..., in]
    xb = x.unflatten(-1, (-1, 32))  # [..., in / 32, 32]
    scale = xb.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(xb / scale) * scale).flatten(-2).to(x.dtype), *args[1:]


def main() -> None:
    cpu = torch.device("cpu")
    for child_path in sys.argv[2:]:
        parent, child = open_artifact(sys.argv[1]), open_artifact(child_path)
        pm, cm = load_model(parent, cpu, torch.float32), load_model(child, cpu, torch.float32)
        before = quality.measure(parent, child, cpu, None, 16384, parent_model=pm, child_model=cm)
        hooked = [m.register_forward_pre_hook(int8_per_32) for name, m in cm.named_modules()
                  if name.endswith("_proj") and not list(m.children())]
        after = quality.measure(parent, child, cpu, None, 16384, parent_model=pm, child_model=cm)
        print(f"{child_path}: {before.tokens} tokens; {len(hooked)} projections; "
              f"KL {before.kl_mean:.5f} -> {after.kl_mean:.5f} nats with int8 inputs; "
              f"perplexity {before.ppl:.3f} -> {after.ppl:.3f} (parent {before.ppl_parent:.3f}); "
              f"top-1 agreement {before.top1_agreement:.2%} -> {after.top1_agreement:.2%}")


if __name__ == "__main__":
    main()
