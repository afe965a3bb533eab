"""The commands that read a model folder and write or describe one: inspect, quantize, calibrate,
convert-heads, convert, compile."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from llamactl import ui
from llamactl.cli.options import (DeviceOpt, DtypeOpt, EvalOpt, EvalTokensOpt, ForceOpt, JsonOpt, KernelsOpt, ModelArg,
                                  ModelReq, OutOpt, PickleOpt, PinsFileOpt, QuantInputsOpt, int_list, runtime_options)

LARGE_KL = 0.1  # nats a token: more than 4-bit RTN costs the embedded model (0.07); convert-heads warns past it


def inspect(model: ModelArg = None, json_out: JsonOpt = False, allow_pickle: PickleOpt = False):
    """Architecture, sizes, KV-cache cost, quantization and lineage of a model folder."""
    from llamactl.folder.artifact import open_artifact, resolve_model_path
    from llamactl.folder.describe import describe

    art = open_artifact(resolve_model_path(model), allow_pickle=allow_pickle)
    from llamactl.runtime.load import check_tensors  # torch: only for a folder that opened

    check_tensors(art)  # inspect accepts only what the loaders accept
    info = describe(art)
    if json_out:
        ui.emit_json(info)
        return
    q = info["quantization"]
    ui.kv_table(f"{info['path']}", [
        ("architecture", f"{info['architecture']} ({info['attention']})"),
        ("parameters", f"{info['params']:,}"),
        ("layers / hidden / ffn", f"{info['num_hidden_layers']} / {info['hidden_size']} / {info['intermediate_size']}"),
        ("heads / KV heads / head dim", f"{info['num_attention_heads']} / {info['num_key_value_heads']} / {info['head_dim']}"),
        ("vocab / context", f"{info['vocab_size']} / {info['context_length']}"),
        ("rope", f"{info['rope_type']}, theta {info['rope_theta']:g}"),
        ("weights on disk", f"{ui.human_bytes(info['disk_bytes'])} in {info['weight_files']} {info['weight_format']} file(s)"),
        ("weights in memory", ui.human_bytes(info["memory_bytes"])),
        ("embeddings", _embedding_line(info)),
        ("KV cache (bf16/fp16)", _kv_line(info)),
        ("quantization", "none" if not q else ", ".join(f"{k}={v}" for k, v in q.items() if not isinstance(v, (dict, list)))),
        *([("tensors by bits", ", ".join(f"{n} {k}" for k, n in info["tensor_bits"].items()))] if info.get("tensor_bits") else []),
        ("lineage", " <- ".join(f"{e['stage']} ({e['path']})" + (f" [parent {e['parent_status']}]" if e.get("parent_status")
                                                                    not in (None, "ok") else "")
                               for e in info["lineage"]) or "none (plain Hugging Face folder)"),
    ])


def _embedding_line(info: dict) -> str:
    table = (((info.get("quantization") or {}).get("meta")) or {}).get("embed_tokens")
    bits = "" if not table else (f"{table['bits']}-bit table ("
                                 + ("per row" if table["group_size"] == -1 else f"groups of {table['group_size']}") + "), ")
    head = ((info.get("quantization") or {}).get("dynamic") or {}).get("lm_head")
    own = "" if not head else f" ({head.get('bits')}-bit" + (", per row)" if head.get("group_size") == -1 else ")")
    return bits + ("tied: lm_head shares the embedding matrix" if info["tie_word_embeddings"] else f"untied lm_head{own}")


def _kv_line(info: dict) -> str:
    """KV-cache bytes per token, at 4K and at the model's context (float32 on the CPU doubles them)."""
    ctx, h = info["context_length"], ui.human_bytes
    at = f"{h(info['kv_bytes_at_4k'])} at 4K, " if ctx > 4096 else ""
    return (f"{h(info['kv_bytes_per_token'])}/token, {at}{h(info['kv_bytes_at_context'])} at its "
            f"{ctx:,}-token context (float32 doubles these)")


def quantize(
    model: ModelReq,
    output: OutOpt,
    method: Annotated[str, typer.Option(help="gptq (GPTQModel), rtn (round-to-nearest), nf4 or int8 (bitsandbytes), or fp8 (e4m3 weights per channel and activations per token, compressed-tensors' format: FP8 tensor cores on Hopper).")] = "gptq",
    bits: Annotated[Optional[int], typer.Option(help="Bits per weight: 3, 4, 5, 6 or 8 for gptq and rtn (default 4; 3, 5 and 6 are read by llamactl and GPTQModel only); nf4 is 4, int8 is 8 (their defaults).", show_default=False)] = None,
    group_size: Annotated[int, typer.Option("--group-size", min=-1, help="Columns per quantization group; -1 = one group per output channel.")] = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric (zero point fixed) or asymmetric groups.")] = True,
    desc_act: Annotated[bool, typer.Option("--desc-act/--no-desc-act", help="GPTQ act-order: quantize columns by decreasing activation.")] = False,
    damp: Annotated[float, typer.Option(help="GPTQ Hessian dampening, as a fraction of its mean diagonal.")] = 0.01,
    clip_search: Annotated[bool, typer.Option("--clip-search", help="Search each group's clipping range (rtn: llamactl's grid; gptq: GPTQModel's mse grid).")] = False,
    gptq_variant: Annotated[str, typer.Option("--gptq-variant", help="GPTQModel algorithm: gptq, gptaq or foem.")] = "gptq",
    lm_head: Annotated[bool, typer.Option("--quantize-lm-head", help="Quantize lm_head too (kept 16-bit by default).")] = False,
    head_bits: Annotated[Optional[int], typer.Option("--head-bits", help="Quantize lm_head to 4 or 8 bits (8: per row, symmetric) whatever --bits the layers take; --quantize-lm-head: the layers' bits.", show_default=False)] = None,
    embed_bits: Annotated[int, typer.Option("--embed-bits", help="The token embedding table: 16 (kept), 8 (per row, symmetric) or 4 (groups of --group-size); a tied model's head is the same table. Read by llamactl (and its GGUF export) only.")] = 16,
    calib: Annotated[str, typer.Option(help="Calibration set: a name in calib/ (docs, wikitext2, c4), a spec .json, or a .jsonl/.json/.parquet/.txt file.")] = "docs",
    n_samples: Annotated[Optional[int], typer.Option("--n-samples", min=1, help="Calibration samples (default: the spec's, 64).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=8, help="Tokens per calibration sample (default: the spec's, 512).")] = None,
    target_bpw: Annotated[Optional[float], typer.Option("--target-bpw", help="A whole-file budget in bits per parameter: each tensor (layers, lm_head, embeddings) gets 3, 4, 5 or 6 bits in groups of 32-128, 8 bits per row, or stays 16-bit, chosen from its measured sensitivity.", show_default=False)] = None,
    widths: Annotated[str, typer.Option("--widths", help="The bit widths --target-bpw may choose (a comma list). 5 and 6 bits decode at about their bytes' speed (the int4 kernels with a high bit plane); 3 bits on a slower kernel: --widths 4,5,6,8 leaves it out.")] = "3,4,5,6,8",
    calib_stats: Annotated[Optional[str], typer.Option("--calib-stats", help="Calibration statistics from `llamactl calibrate` (sensitivities for --target-bpw; rtn --clip-search weights its error by them).", show_default=False)] = None,
    eval_file: EvalOpt = None,
    eval_tokens: EvalTokensOpt = None,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Quantize a 16-bit model to 4 or 8 bits (or to a bits-per-weight budget) and report what it cost in quality."""
    from llamactl.quantize.stage import QuantOptions, quantize as run

    from llamactl.quantize.options import DEFAULT_BITS

    bits = bits if bits is not None else DEFAULT_BITS.get(method, 4)
    opts = QuantOptions(method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act, damp=damp,
                        clip_search=clip_search, gptq_variant=gptq_variant, lm_head=lm_head or head_bits is not None, head_bits=head_bits, embed_bits=embed_bits, calib=calib, n_samples=n_samples, seq_len=seq_len,
                        target_bpw=target_bpw, calib_stats=calib_stats, widths=tuple(int_list("--widths", widths)))
    manifest = run(model, output, opts, force=force, eval_file=eval_file, eval_tokens=eval_tokens, device=device,
                   progress=ui.progress, log=ui.log)
    _report(manifest, json_out)


def calibrate(
    model: ModelReq,
    output: Annotated[str, typer.Option("--output", "-o", help="The statistics file to write (safetensors).")],
    calib: Annotated[str, typer.Option(help="Calibration set: a name in calib/ (docs, wikitext2, c4), a spec .json, or a .jsonl/.json/.parquet/.txt file.")] = "docs",
    n_samples: Annotated[Optional[int], typer.Option("--n-samples", min=1, help="Calibration samples (default: the spec's, 64).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=8, help="Tokens per calibration sample (default: the spec's, 512).")] = None,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Measure each tensor's sensitivity (Fisher diagonal) and each layer's input statistics once, for `quantize --calib-stats`."""
    from llamactl.quantize.calibrate import calibrate as run

    result = run(model, output, calib, n_samples, seq_len, device=device, force=force, progress=ui.progress)
    if json_out:
        ui.emit_json(result)
    else:
        ui.log(f"wrote {result['output']}: {result['tensors']} tensors, {result['tokens']:,} calibration tokens, "
               f"{result['seconds']:.0f} s")


def convert_heads(
    model: ModelReq,
    output: OutOpt,
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="KV heads after conversion (divides the query heads, below the current KV heads).")],
    grouping: Annotated[str, typer.Option(help="contiguous (consecutive heads) or similarity (from calibration activations).")] = "contiguous",
    merge: Annotated[str, typer.Option(help="fit (fitted to calibration statistics; changes q/o too; the measured best) or mean (average K/V, the GQA paper).")] = "fit",
    calib: Annotated[str, typer.Option(help="Calibration set for similarity/fit/distillation (see quantize --calib).")] = "docs",
    n_samples: Annotated[int, typer.Option("--n-samples", min=1, help="Calibration samples.")] = 64,
    seq_len: Annotated[int, typer.Option("--seq-len", min=8, help="Tokens per calibration sample.")] = 512,
    distill_steps: Annotated[int, typer.Option("--distill-steps", min=0, help="KL distillation steps against the parent, updating only K/V projections.")] = 0,
    distill_lr: Annotated[float, typer.Option("--distill-lr", min=0.0, help="Distillation learning rate (AdamW).")] = 3e-4,
    eval_file: EvalOpt = None,
    eval_tokens: EvalTokensOpt = None,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Convert multi-head attention to grouped-query attention with fewer KV heads."""
    from llamactl.gqa.stage import HeadsOptions, convert_heads as run

    opts = HeadsOptions(kv_heads=kv_heads, grouping=grouping, merge=merge, calib=calib, n_samples=n_samples,
                        seq_len=seq_len, distill_steps=distill_steps, distill_lr=distill_lr)
    manifest = run(model, output, opts, force=force, eval_file=eval_file, eval_tokens=eval_tokens, device=device,
                   progress=ui.progress, log=ui.log)
    m = manifest["metrics"]
    q = m.get("quality")
    lost = _quality_lost(q, merge, distill_steps)
    if json_out:
        ui.emit_json({"output": manifest["output"], "kv_bytes_per_token_before": m["kv_bytes_per_token_before"],
                      "kv_bytes_per_token_after": m["kv_bytes_per_token_after"], "quality": q,
                      "params": manifest["params"], "metrics": {k: v for k, v in m.items() if k != "quality"},
                      "warnings": [lost] if lost else []})
        if lost:
            ui.warn(lost)
        return
    h = ui.human_bytes
    rows = [("KV heads", manifest["params"]["kv_heads_before"], kv_heads),
            ("KV cache per token", h(m["kv_bytes_per_token_before"]), h(m["kv_bytes_per_token_after"])),
            ("KV cache at 4K", h(m["kv_bytes_at_4k_before"]), h(m["kv_bytes_at_4k_after"])),
            ("KV cache at 32K", h(m["kv_bytes_at_32k_before"]), h(m["kv_bytes_at_32k_after"])),
            ("parameters", f"{m['params_before']:,}", f"{m['params_after']:,}")]
    if q:
        rows += [("perplexity", f"{q['ppl_parent']:.3f}", f"{q['ppl']:.3f} ({(q['ppl'] / q['ppl_parent'] - 1) * 100:+.2f}%)"),
                 ("KL(parent || child), mean", "0", f"{q['kl_mean']:.5f}"),
                 ("top-1 agreement", "100%", f"{q['top1_agreement'] * 100:.2f}%")]
    if m.get("distill"):
        rows.append(("distillation KL (train)", f"{m['distill']['kl_first']:.4f}", f"{m['distill']['kl_last']:.4f}"))
    ui.table(f"convert-heads ({grouping}, {merge}) -> {manifest['output']}", ["", "parent", "child"], rows)
    if lost:
        ui.warn(lost)


def _quality_lost(q: dict | None, merge: str, distill_steps: int) -> str | None:
    """The warning for a child that lost much quality, with what repairs most of it; None if it did not."""
    if not q or q["kl_mean"] <= LARGE_KL:
        return None
    repair = [] if merge == "fit" else ["--merge fit"]
    repair += [] if distill_steps >= 200 else ["--distill-steps 200"]
    fix = f"; {' and '.join(repair)} {'repair' if len(repair) > 1 else 'repairs'} most of it" if repair else ""
    return (f"the child lost much quality (KL {q['kl_mean']:.3f} nats a token, top-1 agreement "
            f"{q['top1_agreement'] * 100:.0f}%){fix}")


def convert(
    source: Annotated[str, typer.Argument(metavar="SRC", help="A Meta checkpoint folder (params.json, consolidated.NN.pth), a .gguf file, or a Hugging Face folder.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Output: a folder (Hugging Face), or FILE.gguf.")],
    to: Annotated[str, typer.Option(help="hf or gguf; auto: gguf when -o ends in .gguf.")] = "auto",
    gguf_type: Annotated[str, typer.Option("--type", help="GGUF tensor type: auto (16-bit as stored, quantized layers as their own 32-blocks), f32, f16, bf16, q8_0, q4_0, q4_1.")] = "auto",
    dtype: Annotated[str, typer.Option(help="dtype of a Hugging Face output: auto (the source's; bf16 for a quantized GGUF), bf16, f16, f32.")] = "auto",
    tokenizer: Annotated[Optional[str], typer.Option(help="A Hugging Face folder whose tokenizer a Meta checkpoint without tokenizer.model takes.")] = None,
    context: Annotated[Optional[int], typer.Option(min=1, help="Context length of a Meta checkpoint (default: its release's: 4096 Llama 2, 8192 Llama 3, 131072 Llama 3.1).")] = None,
    dequantize: Annotated[bool, typer.Option("--dequantize", help="GGUF -> HF: dequantize Q4_0/Q8_0 layers too (kept quantized by default).")] = False,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", min=0, help="Tokens of the KL check when layers are requantized for GGUF; 0 skips it.")] = 4096,
    allow_pickle: PickleOpt = False,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Convert between Meta checkpoints, GGUF files and Hugging Face folders."""
    from llamactl.convert.stage import ConvertOptions, convert as run

    opts = ConvertOptions(to=to, type=gguf_type, dtype=dtype, tokenizer=tokenizer, context=context,
                          keep_quantized=not dequantize, allow_pickle=allow_pickle, eval_tokens=eval_tokens)
    result = run(source, output, opts, force=force, log=ui.log)
    if json_out:
        ui.emit_json(result)
        return
    p, m = result["params"], result.get("metrics") or {}
    rows = [("source", f"{p['source']['kind']}: {p['source']['path']}"), ("output", result["output"])]
    if p["to"] == "gguf":
        rows += [("tensor types", ", ".join(f"{k} {v}" for k, v in sorted(m["tensor_types"].items()))),
                 ("size", f"{ui.human_bytes(m['bytes'])} ({m['bits_per_weight']:.2f} bits per weight)"),
                 ("exact / requantized layers", f"{m['exact_layers']} / {m['requantized_layers']}")]
        if m.get("added_kl"):
            k = m["added_kl"]
            rows.append(("added KL (requantized)", f"{k['kl_mean']:.5f} nats over {k['tokens']} tokens, top-1 {k['top1_agreement'] * 100:.1f}%"))
    else:
        rows += [("tensor types", ", ".join(f"{k} {v}" for k, v in sorted(p.get("tensor_types", {}).items())) or "-"),
                 ("kept quantized", p.get("kept_quantized") or "no"), ("tokenizer", json.dumps(p.get("tokenizer")))]
    ui.table("convert", ["", ""], rows)


def compile_cmd(
    model: ModelArg = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Output folder (default: MODEL-compiled).")] = None,
    mode: Annotated[str, typer.Option(help="default, reduce-overhead or max-autotune (inductor autotuning; slower to compile).")] = "default",
    buckets: Annotated[str, typer.Option(help="KV-cache lengths to compile for; a generation uses the smallest that fits.", callback=lambda v: int_list("--buckets", v))] = "128,512,2048",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quant_inputs: QuantInputsOpt = None,
    kernels: KernelsOpt = None,
    pins_file: PinsFileOpt = None,
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Compile and warm the decode step per bucket; keep the compile cache in an artifact folder."""
    from llamactl.compile import compile_model
    from llamactl.runtime.load import resolve_model_path

    options = runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file)
    from llamactl.folder.artifact import DEFAULT_MODEL

    src = resolve_model_path(model)
    # beside the model, but never inside the installed package: the embedded model's goes to ./
    out = output or (f"{DEFAULT_MODEL.name}-compiled" if src == DEFAULT_MODEL else f"{str(src).rstrip('/')}-compiled")
    manifest = compile_model(src, out, buckets, mode, device=device, dtype=dtype,
                             force=force, progress=ui.progress, log=ui.log, options=options)
    entry = manifest["metrics"]["compile_cache"][0]
    if json_out:
        ui.emit_json({"output": manifest["output"], **entry})
        return
    ui.table(f"compile -> {manifest['output']}", ["bucket", "compile + warm-up s"],
             [[t["bucket"], f"{t['seconds']:.1f}"] for t in entry["per_bucket"]]
             + [["cache", f"{ui.human_bytes(entry['bytes'])}, key: {entry['key']['device_name']}, torch {entry['key']['torch']}"],
                ["gemv", entry["gemv"]]])


def _report(manifest: dict, json_out: bool) -> None:
    m = manifest["metrics"]
    q = m.get("quality")
    if json_out:
        ui.emit_json({"output": manifest["output"], "stage": manifest["stage"], "params": manifest["params"],
                      "quality": q, "metrics": {k: v for k, v in m.items() if k != "quality"}})
        return
    rows = [("weight bytes", ui.human_bytes(m.get("parent_weight_bytes")), ui.human_bytes(m.get("weight_bytes")))]
    if "compression" in m:
        rows.append(("compression", "1.00x", f"{m['compression']:.2f}x"))
    if "file_bpw" in m:
        parent_bpw = m["file_bpw"] * m["parent_weight_bytes"] / m["weight_bytes"]
        rows.append(("file bits per parameter", f"{parent_bpw:.2f}", f"{m['file_bpw']:.2f}"))
    if q:
        rows += [("perplexity", f"{q['ppl_parent']:.3f}", f"{q['ppl']:.3f} ({(q['ppl'] / q['ppl_parent'] - 1) * 100:+.2f}%)"),
                 ("KL(parent || child), mean", "0", f"{q['kl_mean']:.5f}"),
                 ("KL, p99", "0", f"{q['kl_p99']:.5f}"),
                 ("top-1 agreement", "100%", f"{q['top1_agreement'] * 100:.2f}%")]
    rows.append(("time", "", f"{m.get('quantize_seconds', 0):.1f} s"))
    if "eval_seconds" in m:
        rows.append(("quality report time", "", f"{m['eval_seconds']:.1f} s"))
    title = f"{manifest['stage']} -> {manifest['output']}" + (f" ({q['tokens']} eval tokens)" if q else "")
    ui.table(title, ["", "parent", "child"], rows)
