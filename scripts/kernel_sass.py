"""Instruction count of the int4 GEMV's main loop, compiled here for sm_90 (no GPU needed).

Triton compiles to a Hopper cubin with its bundled ptxas; cuobjdump (also in Triton's package)
disassembles it. The loop body's instructions per weight say whether the kernel can keep up with
memory (about 3 a weight: LOP3, FADD, FFMA) and which configs spill registers.
Usage: python scripts/kernel_sass.py [--a8] [--int8] [--xc] [--h16] [--i16] [BLOCK_N BLOCK_K WARPS ...]   (no blocks: every
autotune config; --a8: the int8-input variant, DP4A; --int8: the int8-weight GEMV instead of int4;
--xc: int4's X_CONTIG variant; --h16: packed fp16 arithmetic; --i16: int16 inputs, DP2A)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton

from llamactl.kernels import gemv, gemv_int4

sys.path.insert(0, os.path.dirname(__file__))
from compile_kernels import GEMV, INT4, compile_one  # noqa: E402  (the runtime's specialization, constexpr defaults)


def loop_body(bn: int, bk: int, warps: int, prefetch: bool = False, a8: bool = False, int8: bool = False,
              reduce_each: bool = False, x_contig: bool = False, h16: bool = False, i16: bool = False) -> list[str]:
    const = {"NORM": False, "GLU": False, "RESIDUAL": False, "USE_ASM": True, "BLOCK_N": bn, "BLOCK_K": bk,
             "PREFETCH": prefetch, "A8": a8, "I16": i16}
    if int8:
        kernel = compile_one(gemv._gemv_kernel, dict(GEMV, w_ptr="*i8"), const | {"HAS_SCALE": True, "REDUCE_EACH": reduce_each, "H16": h16},
                             warps)
    else:
        kernel = compile_one(gemv_int4._gemv_int4_kernel, INT4, const | {"G": 128, "X_CONTIG": x_contig, "H16": h16}, warps)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", sass)]
    back = [(a, int(t.group(1), 16)) for a, i in ins
            if (t := re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", i)) and int(t.group(1), 16) < a]
    lo, hi = (back[-1][1], back[-1][0]) if back else (0, 1 << 30)  # the last backward branch closes the K loop
    return [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for a, i in ins if lo <= a <= hi]


def main():
    a8, int8, xc, h16, i16 = (f"--{o}" in sys.argv for o in ("a8", "int8", "xc", "h16", "i16"))
    args = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    configs = [(*args[i : i + 3], False, False, xc) for i in range(0, len(args), 3)] or [
        (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.kwargs["PREFETCH"], c.kwargs.get("REDUCE_EACH", False),
         c.kwargs.get("X_CONTIG", False))
        for c in (gemv._bf16_configs() if int8 else gemv_int4._int4_configs())]
    for bn, bk, warps, prefetch, reduce_each, x_contig in configs:
        body = loop_body(bn, bk, warps, prefetch, a8, int8, reduce_each, x_contig, h16, i16)
        per_thread = bn * bk / (32 * warps)
        kinds = Counter(op.split(".")[0] for op in body)
        spills = kinds.get("STL", 0) + kinds.get("LDL", 0)
        print(f"BLOCK_N {bn:3d} BLOCK_K {bk:5d} warps {warps}{' prefetch' * prefetch}{' reduce_each' * reduce_each}{' x_contig' * x_contig}{' a8' * a8}{' h16' * h16}{' i16' * i16}: {len(body):5d} instructions / {per_thread:4.0f} weights "
              f"per thread = {len(body) / per_thread:.2f} a weight; spills {spills}; {kinds.most_common(5)}")


if __name__ == "__main__":
    main()
