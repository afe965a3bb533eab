"""Print kernels/pinned.py table rows from a bench run's autotune log (gpu_run.sh's autotune.txt).

The log holds what TRITON_PRINT_AUTOTUNING printed: per GEMV shape its key and the config chosen.
Keys from commit c65f477 on carry A8 always and PDL only when on, so a key has 10 values with PDL
and 9 without (earlier logs lack A8: not read here). Paste the rows of the run whose decode was
fastest into pinned.py, under the GPU's name, with the run named.
Usage: python scripts/pins_from_autotune.py docs/bench/run24-autotune.txt
"""

from __future__ import annotations

import ast
import re
import sys

KEY = re.compile(r"autotuning for function (_gemv_kernel|_gemv_int4_kernel),\s*with key as (\(.*?\)),.*?"
                 r"best config selected: (.*?);", re.S)


def rows(text: str) -> list[str]:
    out = []
    for fn, key, config in KEY.findall(text):
        values = ast.literal_eval(key)
        flags = [v for v in values if not isinstance(v, str)]  # the dtypes come last
        dtype = values[len(flags)].removeprefix("torch.")  # x's dtype: the first argument
        if len(flags) not in (9, 10):
            raise SystemExit(f"{key}: {len(flags)} key values, not a log of c65f477 or later")
        n, k, third, norm, glu, res, _use_asm, glu_out, *rest = flags
        pdl, a8 = (rest[0], rest[1]) if len(rest) == 2 else (False, rest[0])
        cfg = dict(item.split(": ") for item in config.split(", "))
        kw = {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
        variant = "X_CONTIG" if fn == "_gemv_int4_kernel" else "REDUCE_EACH"
        args = [kw["BLOCK_N"], kw["BLOCK_K"], cfg["num_warps"]] + ([cfg["num_stages"]] if cfg["num_stages"] != "1" else [])
        args += ["prefetch=True"] if cfg["PREFETCH"] == "True" else []
        args.append(f"{variant}={cfg[variant]}")
        kernel = "int4" if fn == "_gemv_int4_kernel" else "gemv"
        out.append(f'"{kernel}": ({n}, {k}, {third}, {norm}, {glu}, {res}, {glu_out}, {pdl}, {a8}, "{dtype}"): '
                   f"_cfg({', '.join(map(str, args))}),")
    return out


if __name__ == "__main__":
    print("\n".join(rows(open(sys.argv[1]).read())))
