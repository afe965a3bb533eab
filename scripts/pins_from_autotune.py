"""Print kernels/pinned.py table rows from a bench run's autotune log (gpu_run.sh's autotune.txt).

The log holds what TRITON_PRINT_AUTOTUNING printed: per GEMV shape its key and the config chosen.
Keys carry PDL only when it is on, then the arithmetic switches of the log's commit: A8 (commit
c65f477 on, runs 23-35: --switches 1), A8 and H16 (runs 36-40: --switches 2), A8, H16 and I16
(run 41 on: the default, 3); earlier logs lack A8 and are not read. Paste the rows of the run whose
decode was fastest into pinned.py, under the GPU's name, with the run named.
Usage: python scripts/pins_from_autotune.py [--switches N] docs/bench/run41-autotune.txt
"""

from __future__ import annotations

import ast
import re
import sys

from llamactl.kernels import INPUT_SWITCHES, pinned

KEY = re.compile(r"autotuning for function (_gemv_kernel|_gemv_int4_kernel),\s*with key as (\(.*?\)),.*?"
                 r"best config selected: (.*?);", re.S)


def rows(text: str, switches: int = 3) -> list[str]:
    out = []
    for fn, key, config in KEY.findall(text):
        values = ast.literal_eval(key)
        flags = [v for v in values if not isinstance(v, str)]  # the dtypes come last
        dtype = values[len(flags)].removeprefix("torch.")  # x's dtype: the first argument
        if len(flags) - 8 not in (switches, switches + 1):
            raise SystemExit(f"{key}: {len(flags)} key values, not 8 + PDL + {switches} switches (see --switches)")
        n, k, third, norm, glu, res, _use_asm, glu_out, *rest = flags
        pdl = rest.pop(0) if len(rest) > switches else False
        inputs = pinned.inputs(dict(zip(INPUT_SWITCHES.values(), rest)))
        cfg = dict(item.split(": ") for item in config.split(", "))
        kw = {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"]}
        variant = "X_CONTIG" if fn == "_gemv_int4_kernel" else "REDUCE_EACH"
        args = [kw["BLOCK_N"], kw["BLOCK_K"], cfg["num_warps"]] + ([cfg["num_stages"]] if cfg["num_stages"] != "1" else [])
        args += ["prefetch=True"] if cfg["PREFETCH"] == "True" else []
        args.append(f"{variant}={cfg[variant]}")
        kernel = "int4" if fn == "_gemv_int4_kernel" else "gemv"
        out.append(f'"{kernel}": ({n}, {k}, {third}, {norm}, {glu}, {res}, {glu_out}, {pdl}, "{inputs}", "{dtype}"): '
                   f"_cfg({', '.join(map(str, args))}),")
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args[1]) if args[:1] == ["--switches"] else 3
    print("\n".join(rows(open(args[-1]).read(), n)))
