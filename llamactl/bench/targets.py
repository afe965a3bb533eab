"""What bench measures: model folders or synthetic shapes, transformers references, quality."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from llamactl.bench.trials import SkipStage, Target, is_quantized
from llamactl.compile import load_compile_cache
from llamactl.errors import InputError
from llamactl.folder.artifact import lineage, open_artifact
from llamactl.folder.describe import params_from_config
from llamactl.kernels.arith import QUANT_INPUT_LABELS
from llamactl.layers.plan import linear_kernels, prepare
from llamactl.options import RuntimeOptions
from llamactl.quality import cache_logits, compare, decode_logits, eval_windows, measure, prefill_logits
from llamactl.runtime.kv_format import resolve
from llamactl.runtime.load import load_model, load_shard, load_tokenizer, resolve_dtype, resolve_model_path
from llamactl.runtime.synthetic import synthetic_dtype, synthetic_model, hf_config


def load_targets(models: list[str], synthetic: str | None, device: torch.device, dtype_name: str,
                 synthetic_quant: str | None = None, compile_warn: Callable[[str], None] | None = None,
                 options: RuntimeOptions | None = None, trust_cache: bool = False, world=None) -> list[Target]:
    """The models to time. compile_warn (when a compile mode is timed): load each model folder's
    `llamactl compile` cache for this machine, warning through it where one does not match.
    options: the runtime's (quantized layers on llamactl's kernels where they run). world: a
    tensor-parallel group (tp.join): each model's shard of this rank."""
    targets = []
    options = options or RuntimeOptions()
    if synthetic:
        dtype = synthetic_dtype(dtype_name, device, linear_kernels(device, options))
        for quant in (synthetic_quant or "none").split(","):
            targets.append(synthetic_target(synthetic, quant.strip(), device, dtype, linear_kernels(device, options),
                                            world))
    for m in models or ([] if synthetic else [None]):
        art = open_artifact(resolve_model_path(m))
        if world is not None:
            model = load_shard(art, device, resolve_dtype(dtype_name, device, art, options.kernels), world.group,
                               world.rank, world.size, options)
        else:
            model = load_model(art, device, resolve_dtype(dtype_name, device, art, options.kernels), options)
        if compile_warn:
            load_compile_cache(art, model.device, model.dtype, compile_warn, trust_cache)
        targets.append(Target(label=str(art.path) if m else "embedded:docs-llama-17m", model=model, artifact=art))
    dtypes = {t.model.dtype for t in targets}
    if len(dtypes) > 1:
        raise InputError(f"the models load in different dtypes ({', '.join(map(str, dtypes))})", "pass --dtype")
    return targets


def synthetic_target(shape: str, quant: str, device: torch.device, dtype: torch.dtype, kernels: str,
                     world=None) -> Target:
    label, model = synthetic_model(shape, quant, device, dtype, kernels, world)
    return Target(label=label, model=model, synthetic=shape)


def hf_factory(target: Target, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """A function that builds transformers' LlamaForCausalLM for the same weights or shape."""

    def make():
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        if target.synthetic:
            cfg = LlamaConfig(**{k: v for k, v in hf_config(target.model.args).items() if k != "model_type"})
            cfg._attn_implementation = "sdpa"
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    model = LlamaForCausalLM(cfg)
            finally:
                torch.set_default_dtype(prev)
            return model.eval()
        if target.artifact.quantization:
            raise SkipStage("transformers reference runs on 16-bit models only")
        # no device_map: that needs accelerate, which the base install does not bring
        model = AutoModelForCausalLM.from_pretrained(str(target.artifact.path), dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()

    return make


def hf_stages(target: Target, device: torch.device, dtype: torch.dtype) -> list[tuple[str, Callable, bool]]:
    make = hf_factory(target, device, dtype)

    def skip_static():
        raise SkipStage("transformers' static cache compiles the forward: measured on a GPU only")

    return [("eager", make, False), ("static", make if device.type == "cuda" else skip_static, True)]


def quality_for(targets: list[Target], reference: str | None, eval_file: str | None, eval_tokens: int,
                device: torch.device, progress, inputs: tuple[str, ...] = (),
                options: RuntimeOptions | None = None) -> dict[tuple[str, str], dict]:
    """(label, "float") -> quality dict (ppl, and KL/top-1 against the reference when there is
    one). inputs ("int8", "fp16", "int16"): also (label, kind) for a quantized model on a GPU, scored
    through the decode step's GEMVs with those inputs one position at a time (prefill runs cuBLAS
    on dequantized weights, with its inputs as they are)."""
    options = options or RuntimeOptions()
    out = {}
    for t in targets:
        if t.artifact is None:
            for kind in ("float", *inputs):
                out[t.label, kind] = {"skipped": "synthetic weights: quality is meaningless"}
            continue
        ref_path = None if reference is None else str(resolve_model_path(reference))  # `embedded` names the packaged model
        if ref_path is None:  # the root of the manifest chain, if every link of it is intact
            chain = lineage(t.artifact)
            broken = next((e for e in chain if e.get("parent_status") not in (None, "ok")), None)
            if broken:
                raise InputError(f"--quality: the parent of {broken['path']} ({broken['parent_path']}) is "
                                 f"{broken['parent_status']}, so KL against it would compare other weights",
                                 "pass --reference FOLDER to name the model to compare against")
            roots = [e.get("parent_path") for e in chain if e.get("parent_path")]
            ref_path = roots[-1] if roots else None
        ref_art = open_artifact(ref_path) if ref_path else t.artifact
        if ref_path and Path(ref_path).resolve() == t.artifact.path.resolve():
            if reference is None:
                raise InputError(f"--quality: {t.artifact.path}'s manifest names itself as its parent",
                                 "pass --reference FOLDER to name the model to compare against")
            ref_art = t.artifact  # --reference the model itself: perplexity only
        own = ref_art is t.artifact
        kinds = ["float"]
        if device.type == "cuda" and is_quantized(t.model):
            kinds += [k for k in inputs if k in QUANT_INPUT_LABELS]
        for kind in kinds:
            if kind != "float" and prepare(t.model, options.replace(kernels=True, quant_inputs=kind)).inputs != kind:
                out[t.label, kind] = {"skipped": f"the GEMVs with {kind} inputs did not run here"}
                continue
            q = measure(ref_art, t.artifact, device, eval_file, eval_tokens, progress,
                        parent_model=t.model if own else None, child_model=t.model,
                        child_logits=prefill_logits if kind == "float" else decode_logits).to_dict()
            q["reference"] = None if own else str(ref_art.path)
            q["file_bpw"] = round(8 * t.artifact.disk_bytes / params_from_config(ref_art.args), 3)  # this folder's files
            q["scored"] = "prefill" if kind == "float" else f"decode steps, {QUANT_INPUT_LABELS[kind]}"
            if own:  # no reference: only perplexity is meaningful
                q = {k: v for k, v in q.items() if k not in ("kl_mean", "kl_p99", "top1_agreement", "ppl_parent")}
            out[t.label, kind] = q
    return out


def add_quality(rows: list[dict], targets: list[Target], reference: str | None, eval_file: str | None,
                eval_tokens: int, device: torch.device, progress, options: RuntimeOptions | None = None,
                kv: list[str] = ()) -> None:
    """Set each result row's "quality" (quality_for), the rows with int16/int8 inputs or fp16
    arithmetic scored through the decode step; kv: 8-bit cache formats, whose rows also get
    "kv_quality" (kv_quality_for)."""
    if kv:
        kq = kv_quality_for(targets, kv, eval_file, eval_tokens, device, progress)
        for r in rows:
            if r.get("kv_dtype") in kv:
                r["kv_quality"] = kq.get((r["model"], r["kv_dtype"]))

    def kind(row: dict) -> str:
        return (row.get("plan") or {}).get("inputs") or "float"

    qs = quality_for(targets, reference, eval_file, eval_tokens, device, progress,
                     tuple(sorted({kind(r) for r in rows} - {"float"})), options)
    for r in rows:
        r["quality"] = qs.get((r["model"], kind(r)))


def kv_quality_for(targets: list[Target], kv: list[str], eval_file: str | None, eval_tokens: int,
                   device: torch.device, progress) -> dict[tuple[str, str], dict]:
    """(label, kv format) -> the KL (and top-1 agreement, perplexity) an 8-bit KV cache adds to
    the model against its own 16-bit logits on the eval text (quality.cache_logits)."""
    out = {}
    for t in targets:
        if t.artifact is None:
            out.update({(t.label, k): {"skipped": "synthetic weights: quality is meaningless"} for k in kv})
            continue
        windows = eval_windows(load_tokenizer(t.artifact), eval_file,
                               min(512, t.artifact.args.max_position_embeddings), eval_tokens)
        for k in kv:
            fmt = resolve(k, t.model.dtype, t.model.device)
            with progress(f"kv {k}", windows.shape[0]) as advance:
                q = compare(t.model, t.model, windows, str(eval_file or "docs-eval.txt (packaged)"), advance,
                            cache_logits(fmt))
            out[t.label, k] = {**q.to_dict(), "kv_dtype": k, "scored": "prefill through the cache"}
    return out
