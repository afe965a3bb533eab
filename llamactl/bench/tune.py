"""`bench --tune`: the autotuner's picks of a run, written as a pins file for this GPU.

A bench run with pins off tunes every GEMV shape it launches (Triton's autotuner times each
candidate alone); the picks of the run whose decode was fastest are the ones to pin, since the
tuner's choice changes from run to run (kernels/pinned.py). The file records the commit and the
bench command; `--pins-file FILE` runs it, copying it to llamactl/kernels/configs/ ships it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llamactl.bench.trials import source_commit
from llamactl.kernels import pinned
from llamactl.kernels.arith import from_switches


def picks() -> list[dict]:
    """The pins of every shape the GEMV autotuners chose a config for in this process."""
    from llamactl.kernels import gemv, gemv_int4

    rows = []
    for kernel, tuned in (("gemv", gemv._gemv_tuned), ("int4", gemv_int4._gemv_int4_tuned)):
        names = list(tuned.keys)  # the autotune key's argument names, then the dtypes of the tensors
        for key, config in sorted(tuned.cache.items(), key=repr):
            values = dict(zip(names, key))
            if values.get("HI"):
                continue  # 5- and 6-bit launches are tuned, never pinned (a pin's key has no field for them)
            dtype = str(key[len(names)]).removeprefix("torch.")  # x, the first tensor argument
            third = "G" if kernel == "int4" else "HAS_SCALE"
            row_key = {"N": values["N"], "K": values["K"], third: values[third], "NORM": values["NORM"],
                       "GLU": values["GLU"], "RESIDUAL": values["RESIDUAL"], "GLU_OUT": values["GLU_OUT"],
                       "PDL": values["PDL"], "inputs": from_switches(values), "dtype": dtype}
            rows.append({"kernel": kernel, "key": row_key,
                         "config": {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}})
    return rows


def write_pins(path: Path, device: torch.device, command: str) -> int:
    """Write this process's autotune picks for `device`'s GPU to `path`; returns how many."""
    rows = picks()
    pinned.write(path, torch.cuda.get_device_name(device), rows, source_commit(), command)
    return len(rows)
