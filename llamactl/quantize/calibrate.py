"""`llamactl calibrate`: the calibration statistics of a model, measured once, written to a file
that `quantize --calib-stats` reads (quantize.sensitivity says what they are)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from llamactl.errors import InputError
from llamactl.folder.artifact import check_output_file, open_artifact, staged_file
from llamactl.quality import no_progress
from llamactl.quantize import sensitivity
from llamactl.quantize.calib import check_spec, resolve_spec
from llamactl.runtime.load import resolve_device, resolve_model_path


def calibrate(model: str, output: str, calib: str = "docs", n_samples: int | None = None, seq_len: int | None = None,
              *, device: str = "auto", force: bool = False, progress=no_progress) -> dict[str, Any]:
    """Measure `model`'s statistics on the calibration set and write them to `output`."""
    art = open_artifact(resolve_model_path(model))
    if art.quantization:
        raise InputError(f"{art.path} is already quantized", "calibrate the 16-bit parent that quantize reads")
    out = Path(output)
    if out.is_dir():
        raise InputError(f"--output {out} is a folder", "name a file, for example stats.safetensors")
    if not out.parent.is_dir():
        raise InputError(f"--output {out}: folder {out.parent} does not exist", "create it first")
    # never the model's folder or a file in it; --force replaces only an earlier statistics file
    check_output_file(out, force, [art.path], "calibration statistics", sensitivity.is_stats_file)
    spec = resolve_spec(calib, n_samples, seq_len)
    check_spec(spec)
    if spec.seq_len > art.args.max_position_embeddings:
        raise InputError(f"--seq-len {spec.seq_len} is longer than the model's context "
                         f"({art.args.max_position_embeddings})", "lower --seq-len")
    t0 = time.perf_counter()
    stats = sensitivity.collect(art, spec, resolve_device(device), progress)
    with staged_file(out, force, "calibration statistics", sensitivity.is_stats_file) as tmp:
        stats.save(tmp)  # renamed over `out` (mode as the umask says) only once whole
    return {"output": str(out), "tensors": len(stats.fisher), "tokens": stats.tokens,
            "seconds": round(time.perf_counter() - t0, 2), "calibration": stats.meta["calibration"]}
