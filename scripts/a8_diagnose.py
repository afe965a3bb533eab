"""Which rounding of x does the int4 GEMV with int8 inputs apply on this GPU? Its product against
references that round x per 16, 32, 64 and 128 columns, with 127 / max |x| correctly rounded or as
torch's 127.0 / t computes it (runs 37-38: 1.2e-3 off the per-32 one for bf16-valued x).
Usage: python scripts/a8_diagnose.py"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_kernels import DEV, _int4_case, rel  # noqa: E402

from llamactl.kernels import gemv  # noqa: E402


def rounded(x: torch.Tensor, block: int, exact_div: bool) -> torch.Tensor:
    xb = x.double().view(-1, block)
    qmax = xb.abs().amax(1, keepdim=True)
    inv = (127.0 / qmax) if exact_div else (127.0 / qmax.float()).double()
    inv = torch.where(qmax > 0, inv.float().double(), torch.zeros_like(qmax))
    return (torch.round((xb * inv).float().double()) * (qmax / 127)).view(-1)


def main() -> None:
    q, s, z, w = _int4_case(72, 1152, 128, seed=7)
    x = torch.randn(1152, device=DEV, dtype=torch.bfloat16).float()
    for a8 in (True, False):
        gemv.FIXED_BLOCKS = True
        y = gemv.gemv_int4(x, q, s, z, 128, inputs="int8" if a8 else "float").double()
        print(f"a8={a8}: exact x {rel(y, w @ x.double()):.2e}", end="")
        for block in (16, 32, 64, 128):
            for exact in (True, False):
                print(f" | per {block}{'' if exact else ' torch-div'} {rel(y, w @ rounded(x, block, exact)):.2e}", end="")
        print()
    x32 = torch.randn(1152, device=DEV)  # float32 inputs (test_quant_inputs' exactness tests pass with these)
    y = gemv.gemv_int4(x32, q, s, z, 128, inputs="int8").double()
    print(f"float32 x: per 32 {rel(y, w @ rounded(x32, 32, True)):.2e}")

if __name__ == "__main__":
    main()
