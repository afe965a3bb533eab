"""The convert-heads stage: validation, calibration, conversion, optional distillation, report."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llamactl.errors import InputError
from llamactl.folder.artifact import check_output, copy_side_files, open_artifact, save_weights, staged_output, write_manifest
from llamactl.gqa.heads import GROUPINGS, MERGES, convert_state, layer_stats
from llamactl.quality import announce, check_eval_file, measure, no_progress
from llamactl.runtime.load import (checkpoint_dtype, iter_checkpoint, load_model, load_tokenizer, resolve_device,
    resolve_model_path)
from llamactl.options import RuntimeOptions
from llamactl.quantize.calib import build_samples, check_spec, resolve_spec


@dataclass(frozen=True)
class HeadsOptions:
    kv_heads: int
    grouping: str = "contiguous"
    merge: str = "fit"  # the measured best without distillation (docs/convert-heads.md)
    calib: str = "docs"
    n_samples: int = 64
    seq_len: int = 512
    distill_steps: int = 0
    distill_lr: float = 3e-4
    distill_batch: int = 4
    seed: int = 0


def validate(art, opts: HeadsOptions) -> None:
    a = art.args
    if art.quantization:
        raise InputError(f"{art.path} is quantized ({art.quantization.get('quant_method')})",
                         "convert the 16-bit model first, then quantize the result")
    if opts.grouping not in GROUPINGS:
        raise InputError(f"--grouping {opts.grouping!r} is not known", f"use one of {', '.join(GROUPINGS)}")
    if opts.merge not in MERGES:
        raise InputError(f"--merge {opts.merge!r} is not known", f"use one of {', '.join(MERGES)}")
    g, h, kv = opts.kv_heads, a.num_attention_heads, a.num_key_value_heads
    valid = [d for d in range(1, kv) if kv % d == 0]
    hint = (f"valid values for {art.path}: {', '.join(map(str, valid))}" if valid
            else f"{art.path} has {kv} KV head: there is nothing to merge")
    if g < 1 or h % g or g >= kv or kv % g:
        why = ("is not below the model's" if g >= kv else "does not divide the model's") + f" {kv} KV heads"
        raise InputError(f"--kv-heads {g} {why}", hint)
    if opts.merge == "fit" and a.attention_bias:
        raise InputError("--merge fit does not support attention biases", "use --merge mean")


def convert_heads(model: str | Path, out: str | Path, opts: HeadsOptions, *, force: bool = False,
                  eval_file: str | None = None, eval_tokens: int | None = None, device: str = "auto",
                  progress=no_progress, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Convert `model` to opts.kv_heads KV heads into `out`; returns the manifest written."""
    art = open_artifact(resolve_model_path(str(model)))
    validate(art, opts)
    out = Path(out)
    if eval_tokens != 0:
        check_eval_file(eval_file)
    check_output(out, force, [art.path])
    dev = resolve_device(device)
    t0 = time.perf_counter()
    args = art.args
    need_stats = opts.grouping == "similarity" or opts.merge == "fit"
    samples = _samples(art, opts, log, progress) if need_stats or opts.distill_steps else None
    stats = None
    parent = load_model(art, dev, torch.float32, RuntimeOptions(kernels=False))  # the exact float path
    if need_stats:
        stats = layer_stats(parent, samples, _advance_ctx(progress, "calibration statistics", args.num_hidden_layers))
    store = checkpoint_dtype(art)
    state = {k: v.float() for k, v in iter_checkpoint(art)}
    with torch.no_grad():
        groups = convert_state(state, args, opts.kv_heads, opts.grouping, opts.merge, stats)
    if stats is not None:
        stats.close()
    with staged_output(out, force, log) as tmp:
        config = dict(art.config, num_key_value_heads=opts.kv_heads)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        distill = None
        if opts.distill_steps:
            distill = _distill(parent, state, config, samples, opts, dev, progress)
        save_weights({k: v.to(store) for k, v in state.items()}, tmp)
        copy_side_files(art.path, tmp)
        child = open_artifact(tmp)
        metrics: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 2)}
        metrics.update(kv_report(args, child.args))
        metrics["params_before"] = sum(math.prod(m["shape"]) for m in art.tensor_index().values())
        metrics["params_after"] = sum(v.numel() for v in state.values())
        if distill:
            metrics["distill"] = distill
        if eval_tokens != 0:
            n = announce(eval_tokens, dev, art, log)
            metrics["quality"] = measure(art, child, dev, eval_file, n, progress,
                                         parent_model=parent if dev.type == "cpu" else None).to_dict()
        params = asdict(opts) | {"groups_per_layer": groups["groups_per_layer"],
                                 "kv_heads_before": args.num_key_value_heads}
        return write_manifest(tmp, "convert-heads", art, params, metrics) | {"output": str(out)}


def kv_report(before, after) -> dict[str, int]:
    b, a = before.kv_bytes_per_token(2), after.kv_bytes_per_token(2)
    return {"kv_bytes_per_token_before": b, "kv_bytes_per_token_after": a,
            "kv_bytes_at_4k_before": b * 4096, "kv_bytes_at_4k_after": a * 4096,
            "kv_bytes_at_32k_before": b * 32768, "kv_bytes_at_32k_after": a * 32768}


def _samples(art, opts: HeadsOptions, log, progress) -> torch.Tensor:
    spec = resolve_spec(opts.calib, opts.n_samples, min(opts.seq_len, art.args.max_position_embeddings), opts.seed)
    check_spec(spec)
    with progress(f"calibration data ({spec.name})", None):
        samples = build_samples(spec, load_tokenizer(art))
    if samples.shape[0] < opts.n_samples:
        log(f"calibration set gave {samples.shape[0]} samples, not {opts.n_samples}")
    return samples


def _advance_ctx(progress, description: str, total: int):
    """A progress callback that opens its bar lazily (layer_stats is a generator)."""
    ctx = progress(description, total)
    advance = ctx.__enter__()

    def step(n: int = 1) -> None:
        advance(n)
        state["done"] += n
        if state["done"] >= total:
            ctx.__exit__(None, None, None)

    state = {"done": 0}
    return step


def _distill(parent, state: dict[str, torch.Tensor], config: dict, samples: torch.Tensor, opts: HeadsOptions,
             dev: torch.device, progress) -> dict[str, Any]:
    """KL distillation against the parent (the float32 runtime model already loaded) that updates
    only the merged K/V projections (in `state`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(opts.seed)
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("model_type", "architectures", "quantization_config")})
    with torch.device(dev):  # built for real (not on meta): its RoPE buffers are computed in __init__
        child = LlamaForCausalLM(cfg)
    child.load_state_dict({k: v.to(dev) for k, v in state.items()}, strict=False)
    if cfg.tie_word_embeddings:
        child.tie_weights()
    child.train()
    trained = [p for n, p in child.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))]
    for p in child.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=opts.distill_lr, weight_decay=0.0)
    t = samples.shape[1]
    losses = []
    with progress("distillation", opts.distill_steps) as advance:
        for step in range(opts.distill_steps):
            idx = torch.randint(0, samples.shape[0], (opts.distill_batch,))
            ids = samples[idx].to(dev)
            with torch.no_grad():
                lp = parent(ids, torch.arange(t, device=dev)).float().log_softmax(-1)
            lc = child(ids).logits.float().log_softmax(-1)
            loss = (lp.exp() * (lp - lc)).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            advance(1)
    named = dict(child.named_parameters())
    for name, p in named.items():
        if p.requires_grad:
            state[name] = p.detach().float().cpu()
    k = max(1, len(losses) // 10)
    return {"steps": opts.distill_steps, "lr": opts.distill_lr, "batch": opts.distill_batch, "seq_len": t,
            "kl_first": sum(losses[:k]) / k, "kl_last": sum(losses[-k:]) / k}
