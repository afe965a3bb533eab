"""GPTQ through GPTQModel (the maintained successor of auto-gptq).

GPTQModel 7.6.0 facts this module depends on (checked against its source and output):
- `desc_act=False` silently turns on `act_group_aware` unless it is passed explicitly: llamactl
  passes `act_group_aware=False` so --no-desc-act means plain column order.
- its default `damp_percent` is 0.05; llamactl passes --damp (0.01, the GPTQ paper's value).
- it writes v1 checkpoints (`checkpoint_format: gptq`, stored zero point = zero - 1) with fp16 scales.
- on a CPU it needs GPTQMODEL_CPU_WORKERS set to the cores it may use.
- it writes a log file a run under ./logs of the working directory (`loop_processor._PROJECT_LOG_DIR`);
  llamactl points that at a temporary folder, so the user's folder gets nothing but the output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from llamactl.folder.artifact import _alive
from llamactl.folder.checkpoint import load_tokenizer
from llamactl.folder.describe import params_from_config
from llamactl.quantize.calib import build_samples, resolve_spec
from llamactl.quantize.options import EMBED, dynamic_overrides, module_schemes
from llamactl.runtime.cores import usable


ENGINE_LOG = "quantize.log"  # GPTQModel's output, kept beside the weights
OFFLOAD_PREFIX = "llamactl-gptq-offload-"  # GPTQModel's offload folder, in the temporary dir


def clean_stale_offload(log) -> None:
    """Remove the offload folders of GPTQ runs that were killed (their pid is gone), saying so."""
    for p in Path(tempfile.gettempdir()).glob(f"{OFFLOAD_PREFIX}*"):
        pid = p.name[len(OFFLOAD_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            log(f"removed {p}, GPTQModel's offload folder of a run that was killed")


# GPTQModel 7.6.0 on 2 CPU cores, the embedded 17M model (docs/quantize-quality.md, calibration
# curve): about 15 s of fixed cost, then 0.9 ms per calibration token.
CPU_FIXED_S, CPU_S_PER_TOKEN, CPU_REF_PARAMS, CPU_REF_CORES = 15.0, 0.9e-3, 17e6, 2


def expected_cpu_seconds(art, tokens: int) -> float:
    """A rough time for GPTQ on this CPU: the measured run scaled by tokens, parameters and cores."""
    scale = params_from_config(art.args) / CPU_REF_PARAMS * CPU_REF_CORES / usable()
    return CPU_FIXED_S + CPU_S_PER_TOKEN * tokens * scale


def write_gptq(art, opts, folder, dev: torch.device, progress, log) -> dict[str, Any]:
    """Run GPTQModel on `art` with calibration samples and save a GPTQ-format folder."""
    clean_stale_offload(log)
    spec = resolve_spec(opts.calib, opts.n_samples, opts.seq_len, opts.seed)
    tok = load_tokenizer(art)
    with progress(f"calibration data ({spec.name})", spec.n_samples * spec.seq_len) as advance:
        seen = [0]

        def on_tokens(n: int) -> None:
            advance(min(n, spec.n_samples * spec.seq_len) - seen[0])
            seen[0] = min(n, spec.n_samples * spec.seq_len)

        samples = build_samples(spec, tok, on_tokens)  # [n, seq_len]
    if samples.shape[0] < spec.n_samples:
        log(f"calibration set {spec.name!r} gave {samples.shape[0]} samples of {spec.seq_len} tokens, not {spec.n_samples}")

    if dev.type == "cpu":
        log(f"GPTQ on {samples.numel():,} calibration tokens: expect about {expected_cpu_seconds(art, samples.numel()):.0f} s "
            "on this CPU (scaled from a measured run; fewer tokens with --n-samples/--seq-len)")
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, os.cpu_count() or 1)))
    log_path = folder / ENGINE_LOG
    with progress("gptq layers", art.args.num_hidden_layers) as advance, open(log_path, "w") as engine_log, \
            contextlib.redirect_stdout(engine_log), contextlib.redirect_stderr(engine_log):
        # GPTQModel's banners, bars and tables go to OUT/quantize.log; llamactl's bar above was
        # bound to the terminal before the redirect and advances per layer
        from gptqmodel import GPTQModel, QuantizeConfig
        from gptqmodel.version import __version__ as gptqmodel_version

        offload = Path(tempfile.mkdtemp(prefix=f"{OFFLOAD_PREFIX}{os.getpid()}-"))
        # lm_head=True alone, GPTQModel 7.6.0 quantizes the head to 8 bits in groups of 32 with its
        # mse search (module_looper): the head's scheme (and every module's that differs from the
        # default, --target-bpw) goes in its per-module `dynamic` entries
        schemes = module_schemes(art, opts)
        mse = 2.4 if opts.clip_search else 0.0
        dynamic = {k: (v | {"desc_act": opts.desc_act, "mse": mse} if v else v)
                   for k, v in dynamic_overrides(schemes, opts).items()}
        head = schemes.get("lm_head")
        if head and "lm_head" not in dynamic:
            dynamic["lm_head"] = head | {"desc_act": opts.desc_act, "mse": mse}
        qcfg = QuantizeConfig(bits=opts.bits, group_size=opts.group_size, desc_act=opts.desc_act, sym=opts.sym,
                              damp_percent=opts.damp, act_group_aware=False, lm_head=bool(head),
                              mse=mse, offload_to_disk_path=str(offload),
                              dynamic=dynamic or None, **_variant(opts.gptq_variant))
        try:
            model = GPTQModel.load(str(art.path), qcfg, device=str(dev))
            layers = model.model.model.layers
            calib = [{"input_ids": s.tolist(), "attention_mask": [1] * len(s)} for s in samples]
            hooks = [layer.register_forward_pre_hook(_once(advance)) for layer in layers]
            try:
                with _logs_outside_the_working_dir():
                    model.quantize(calib, batch_size=1, calibration_sort=None)
            finally:
                for h in hooks:
                    h.remove()
            model.save(str(folder))
        finally:
            shutil.rmtree(offload, ignore_errors=True)  # also on an error or Ctrl-C
    log(f"GPTQModel's own output: {ENGINE_LOG} in the output folder")
    for extra in ("quant_log.csv",):
        (folder / extra).unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    qc = config.get("quantization_config", {})
    return {
        "name": "gptqmodel", "version": gptqmodel_version,
        "checkpoint_format": f"{qc.get('checkpoint_format', 'gptq')} (v1: stored zero = zero - 1)",
        "scales_dtype": "float16",
        "damp_percent": qc.get("meta", {}).get("damp_percent", opts.damp),
        "act_group_aware": qc.get("meta", {}).get("act_group_aware"),
        "mse": qc.get("meta", {}).get("mse"),
        "variant": opts.gptq_variant,
        "gptaq": qc.get("meta", {}).get("gptaq"),
        "foem": qc.get("meta", {}).get("foem"),
        "desc_act": qc.get("desc_act"),
        "calibration": spec.describe() | {"n_samples": int(samples.shape[0]), "tokens": int(samples.numel())},
        "quantized_modules": sorted(n for n, v in schemes.items() if v and n != EMBED),
        "scheme": f"int{opts.bits} g{opts.group_size} {'sym' if opts.sym else 'asym'}",
        "device": str(dev),
    }


@contextlib.contextmanager
def _logs_outside_the_working_dir():
    """Send GPTQModel's per-run log files (./logs/gptq_log_*.log) to a temporary folder."""
    from gptqmodel.looper import loop_processor

    if not hasattr(loop_processor, "_PROJECT_LOG_DIR"):  # another GPTQModel version: nothing to redirect
        yield
        return
    with tempfile.TemporaryDirectory(prefix="llamactl-gptq-logs-") as tmp:
        saved, loop_processor._PROJECT_LOG_DIR = loop_processor._PROJECT_LOG_DIR, Path(tmp)
        try:
            yield
        finally:
            loop_processor._PROJECT_LOG_DIR = saved


def _variant(name: str) -> dict[str, Any]:
    """GPTQModel's newer error-propagation rules (alpha/beta are their papers' recommended values)."""
    from gptqmodel.quantization.config import FOEMConfig, GPTAQConfig

    if name == "gptaq":
        return {"gptaq": GPTAQConfig(alpha=0.25)}
    if name == "foem":
        return {"foem": FOEMConfig(alpha=0.0, beta=0.2)}
    return {}


def _once(advance):
    """A forward pre-hook that advances the progress bar the first time its layer runs."""
    done = [False]

    def hook(module, args):
        if not done[0]:
            done[0] = True
            advance(1)

    return hook
