"""The quantize stage: validation, the method's writer and the quality report.

Each method writes a Hugging Face folder into a staging directory; this module adds the side files,
measures quality against the parent with llamactl's runtime, writes the manifest and renames the
folder into place.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from llamactl.errors import InputError, MissingDependencyError
from llamactl.folder.artifact import Artifact, check_output, copy_side_files, open_artifact, staged_output, write_manifest
from llamactl.folder.describe import params_from_config
from llamactl.quality import announce, check_eval_file, measure, no_progress

from llamactl.quantize.options import (BITS, EMBED, GPTQ_VARIANTS, LINEARS, QuantOptions, module_schemes,  # noqa: F401
                                       scheme_label, target_linears, used_params)
from llamactl.folder.artifact import save_weights
from llamactl.folder.checkpoint import iter_checkpoint
from llamactl.layers.embedding import EMBED_BITS
from llamactl.layers.gptq import PLANES
from llamactl.quantize import sensitivity
from llamactl.quantize.budget import plan
from llamactl.quantize.calib import check_spec, resolve_spec
from llamactl.quantize.formats import write
from llamactl.quantize.rtn import quantize_embedding
from llamactl.runtime.load import resolve_device, resolve_model_path


def validate(art: Artifact, opts: QuantOptions) -> None:
    """Raise InputError for anything that would fail after work has started."""
    if opts.method not in BITS:
        raise InputError(f"--method {opts.method!r} is not known", f"use one of {', '.join(BITS)}")
    if opts.bits not in BITS[opts.method]:
        raise InputError(f"--bits {opts.bits} is not supported by --method {opts.method}",
                         f"{opts.method} supports {', '.join(map(str, BITS[opts.method]))} bits")
    if art.quantization:
        meta = art.quantization.get("meta") or {}
        method = meta.get("method") if meta.get("method") in BITS else art.quantization.get("quant_method", "?")
        raise InputError(f"{art.path} is already quantized ({method})",
                         "quantize the 16-bit parent instead (see `llamactl inspect` for its lineage)")
    if opts.bits in PLANES:  # packed in whole blocks of 32 rows (GPTQModel's layouts)
        odd = sorted({d for n, shape in target_linears(art, opts.lm_head).items() for d in shape if d % 32})
        if odd:
            raise InputError(f"--bits {opts.bits} packs 32 rows at a time, and this model has layers {odd[0]} wide",
                             "use --bits 4 or 8, or --target-bpw (which uses these widths where they fit)")
    if opts.method in ("gptq", "rtn"):
        if opts.group_size not in (-1,) and opts.group_size < 1:
            raise InputError(f"--group-size {opts.group_size} is not valid", "use a positive size such as 128, or -1")
    if opts.method == "gptq" and not 0 < opts.damp < 1:
        raise InputError(f"--damp {opts.damp} is outside (0, 1)", "the usual value is 0.01")
    if opts.gptq_variant not in GPTQ_VARIANTS:
        raise InputError(f"--gptq-variant {opts.gptq_variant!r} is not known", f"use one of {', '.join(GPTQ_VARIANTS)}")
    if opts.method != "gptq" and opts.gptq_variant != "gptq":
        raise InputError("--gptq-variant applies to --method gptq only")
    calibrates = opts.method == "gptq" or (opts.target_bpw is not None and not opts.calib_stats)
    if not calibrates and (opts.calib != "docs" or opts.n_samples or opts.seq_len or opts.seed is not None):
        raise InputError(f"--calib, --n-samples, --seq-len and --seed apply to --method gptq and --target-bpw only; "
                         f"{opts.method} uses no calibration here", "drop them, or use --method gptq")
    _validate_budget(art, opts)
    if opts.method != "gptq" and opts.desc_act:
        raise InputError("--desc-act applies to --method gptq only")
    if opts.method in ("nf4", "int8") and (opts.clip_search or opts.lm_head or opts.embed_bits != 16):
        raise InputError(f"--clip-search, --quantize-lm-head, --head-bits and --embed-bits are not available with --method {opts.method}",
                         "use --method rtn or gptq")
    if opts.method == "fp8" and (opts.clip_search or opts.embed_bits != 16 or opts.head_bits is not None):
        raise InputError("--clip-search, --head-bits and --embed-bits are not available with --method fp8",
                         "drop them (--quantize-lm-head makes lm_head FP8 too)")
    if opts.method == "fp8" and opts.lm_head and art.args.tie_word_embeddings:
        raise InputError("--quantize-lm-head with --method fp8 on a tied model: its head is its embedding table, "
                         "which FP8 keeps 16-bit", "drop --quantize-lm-head")
    if opts.embed_bits not in EMBED_BITS:
        raise InputError(f"--embed-bits {opts.embed_bits} is not supported", f"use {', '.join(map(str, EMBED_BITS))}")
    if opts.head_bits is not None and opts.head_bits not in (4, 8):
        raise InputError(f"--head-bits {opts.head_bits} is not supported", "use 4 or 8")
    if opts.head_bits is not None and art.args.tie_word_embeddings:
        raise InputError("--head-bits on a tied model: its head is its embedding table",
                         "use --embed-bits 8 or 4, which quantizes the one table both read")
    if opts.embed_bits != 16 and opts.lm_head and art.args.tie_word_embeddings:
        raise InputError("--quantize-lm-head with --embed-bits on a tied model: its head is its embedding table",
                         f"drop --quantize-lm-head (--embed-bits {opts.embed_bits} quantizes the one table both use)")
    _require_engine(opts.method)
    if calibrates:
        spec = resolve_spec(opts.calib, opts.n_samples, opts.seq_len, opts.seed)
        check_spec(spec)
        if spec.seq_len > art.args.max_position_embeddings:
            raise InputError(f"--seq-len {spec.seq_len} is longer than the model's context "
                             f"({art.args.max_position_embeddings})", "lower --seq-len")


def _validate_budget(art: Artifact, opts: QuantOptions) -> None:
    if opts.target_bpw is None and opts.calib_stats is None:
        return
    if opts.method not in ("rtn", "gptq"):
        raise InputError(f"--target-bpw and --calib-stats are not available with --method {opts.method}",
                         "use --method rtn or gptq")
    if opts.target_bpw is None:
        return
    if not 1 <= opts.target_bpw <= 32:
        raise InputError(f"--target-bpw {opts.target_bpw:g} is not a budget", "use bits per parameter such as 4.5 or 6")
    if opts.lm_head or opts.head_bits is not None or opts.embed_bits != 16:
        raise InputError("--target-bpw chooses the bits of lm_head and the embedding table too",
                         "drop --quantize-lm-head, --head-bits and --embed-bits")
    if opts.desc_act:
        raise InputError("--target-bpw with --desc-act is not supported", "drop --desc-act")
    if not opts.widths or any(b not in (3, 4, 5, 6, 8) for b in opts.widths):
        raise InputError(f"--widths {','.join(map(str, opts.widths))} is not a list of 3, 4, 5, 6 and 8",
                         "for example --widths 4,8")


def _require_engine(method: str) -> None:
    from importlib.util import find_spec

    if method == "gptq" and find_spec("gptqmodel") is None:
        raise MissingDependencyError("gptqmodel", "gptq", "--method gptq")
    if method in ("nf4", "int8") and find_spec("bitsandbytes") is None:
        raise MissingDependencyError("bitsandbytes", "bnb", f"--method {method}")


def quantize(model: str | Path, out: str | Path, opts: QuantOptions, *, force: bool = False,
             eval_file: str | None = None, eval_tokens: int | None = None, device: str = "auto",
             progress=no_progress, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Quantize the model folder `model` into `out`; returns the manifest written.

    Raises InputError/CheckpointError/MissingDependencyError before anything is written.
    """
    art = open_artifact(resolve_model_path(str(model)))
    validate(art, opts)
    if eval_tokens != 0:
        check_eval_file(eval_file)
    out = Path(out)
    check_output(out, force, [art.path])
    dev = resolve_device(device)
    t0 = time.perf_counter()
    stats = _calib_stats(art, opts, dev, progress, log)
    allocation = None
    if opts.target_bpw is not None:
        allocation = plan(art, stats, opts.target_bpw, opts.sym, opts.clip_search, progress, opts.widths, dev)
        opts = replace(opts, schemes=allocation.schemes)
        log(f"--target-bpw {opts.target_bpw:g}: " + ", ".join(f"{n} {k}" for k, n in allocation.summary().items())
            + f" (predicted file {8 * allocation.bytes / params_from_config(art.args):.3f} bpw, "
            f"KL about {allocation.predicted_kl:.4f})")
    with staged_output(out, force, log) as tmp:
        engine = _run_method(art, opts, tmp, dev, progress, log, stats)
        if allocation is not None:
            engine["allocation"] = _allocation_record(allocation, art)
        if stats is not None:
            engine["calibration_stats"] = {"file": opts.calib_stats, "tokens": stats.tokens} | stats.meta.get("calibration", {})
        engine |= _short_groups(art, opts, tmp, log)
        engine |= _embedding(art, opts, tmp, log)
        copy_side_files(art.path, tmp)
        seconds = time.perf_counter() - t0
        metrics: dict[str, Any] = {"quantize_seconds": round(seconds, 2)}
        child = open_artifact(tmp)
        metrics["weight_bytes"] = child.disk_bytes
        metrics["parent_weight_bytes"] = art.disk_bytes
        metrics["compression"] = round(art.disk_bytes / child.disk_bytes, 3)
        metrics["file_bpw"] = round(8 * child.disk_bytes / params_from_config(art.args), 3)
        if eval_tokens != 0:
            n = announce(eval_tokens, dev, art, log)
            t1 = time.perf_counter()
            metrics["quality"] = measure(art, child, dev, eval_file, n, progress).to_dict()
            metrics["eval_seconds"] = round(time.perf_counter() - t1, 2)
        params = used_params(opts) | {"engine": engine}
        return write_manifest(tmp, "quantize", art, params, metrics) | {"output": str(out)}


# The group sizes GPTQModel's kernels (transformers' GPTQ loader) accept, as of 7.6.0.
GPTQMODEL_GROUPS = (-1, 16, 32, 64, 128, 256, 512, 1024)


def _calib_stats(art, opts: QuantOptions, dev, progress, log):
    """The calibration statistics --target-bpw and importance-weighted RTN use: read from
    --calib-stats, measured here for --target-bpw, else None."""
    if opts.calib_stats:
        return sensitivity.load_stats(opts.calib_stats, art)
    if opts.target_bpw is None:
        return None
    spec = resolve_spec(opts.calib, opts.n_samples, opts.seq_len, opts.seed)
    log(f"measuring each tensor's sensitivity on {spec.n_samples} x {spec.seq_len} tokens of {spec.name} "
        "(`llamactl calibrate` saves them for the next run)")
    return sensitivity.collect(art, spec, dev, progress)


def _allocation_record(allocation, art) -> dict[str, Any]:
    params = params_from_config(art.args)
    return {"target_bpw": round(8 * allocation.budget_bytes / params, 3),
            "predicted_bpw": round(8 * allocation.bytes / params, 3),
            "predicted_kl": round(allocation.predicted_kl, 6), "choices": allocation.summary(),
            "tensors": {n: scheme_label(s) for n, s in sorted(allocation.schemes.items())}}


def _short_groups(art, opts, folder: Path, log) -> dict[str, Any]:
    """Where the group size does not divide a layer's width (its last group is shorter), point
    transformers at GPTQModel's torch kernel, the one of its kernels that pads (its others need
    whole groups), and say who reads the folder."""
    if opts.method not in ("gptq", "rtn"):
        return {}
    shapes = target_linears(art, True)
    groups = {(shapes[n][0], s["group_size"]) for n, s in module_schemes(art, opts).items()
              if s and n in shapes and s["group_size"] > 0 and shapes[n][0] % s["group_size"]}
    if not groups:
        return {}
    short = sorted({w for w, _ in groups})
    widths = ", ".join(f"{w} = {w // g} x {g} + {w % g}" for w, g in sorted(groups))
    log(f"the group size leaves a shorter last group in layers {widths} wide")
    if any(g not in GPTQMODEL_GROUPS for _, g in groups):
        log(f"transformers' GPTQ loader (GPTQModel) takes group sizes {', '.join(map(str, GPTQMODEL_GROUPS))}: "
            "only llamactl reads this folder")
        return {"short_last_group": short}
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["backend"] = "torch"
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log("config.json names GPTQModel's torch kernel (backend: torch) for transformers, whose other kernels need whole groups")
    return {"short_last_group": short, "transformers_backend": "torch"}


def _embedding(art, opts, folder: Path, log) -> dict[str, Any]:
    """--embed-bits 8 or 4: the written folder's embedding table replaced by its GPTQ-packed form
    (layers.embedding; RTN: there are no inputs to calibrate a lookup with). A tied model keeps
    one table, which its head reads too; an lm_head copy is dropped."""
    scheme = module_schemes(art, opts).get(EMBED)
    if scheme is None:
        return {}
    staged = open_artifact(folder)
    files = list(staged.weight_files)
    state = dict(iter_checkpoint(staged))
    table = state.pop("model.embed_tokens.weight")
    if art.args.tie_word_embeddings:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
    scheme = scheme | {"clip_search": opts.clip_search, "method": "rtn"}
    per_row = scheme["group_size"] == -1  # the int8 kernels' layout: a tied head runs on them
    config = json.loads((folder / "config.json").read_text())
    v1 = config["quantization_config"].get("checkpoint_format", "gptq") == "gptq"  # gptq_p keeps zeros as they are
    packed = quantize_embedding(table, scheme["bits"], scheme["group_size"], scheme["sym"], opts.clip_search, v1)
    state |= {f"model.embed_tokens.{k}": v for k, v in packed.items()}
    for f in files + [folder / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    save_weights(state, folder)
    config["quantization_config"].setdefault("meta", {})["embed_tokens"] = scheme
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    layout = "per row" if per_row else f"groups of {scheme['group_size']}"
    log(f"embedding table in {scheme['bits']} bits ({layout})"
        + ("; the tied head reads it" if art.args.tie_word_embeddings else "")
        + ": llamactl and its GGUF export read this folder, transformers does not")
    return {"embed_tokens": scheme}


def _run_method(art, opts, tmp, dev, progress, log, stats) -> dict[str, Any]:
    return write(opts.method, art, opts, tmp, dev, progress, log, stats)
