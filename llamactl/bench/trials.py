"""bench: trials of prefill + decode -> result dicts, the optimization ladder, and the environment.

Speed follows ../shared/bench/PROTOCOL.md: random prompt tokens, greedy, EOS ignored, warm-up
runs excluded, the median of the timed runs. decode tok/s = (new tokens - 1) / (total - TTFT).
The bandwidth ceiling is this machine's measured copy bandwidth divided by the bytes a decode
step must read: every weight except the embedding table, plus the KV cache at the mean context.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from llamactl import __version__
from llamactl.bench.stats import median, percentile, spread
from llamactl.errors import InputError
from llamactl.kernels.arith import QUANT_INPUT_LABELS
from llamactl.layers.plan import products, quant_input_layers
from llamactl.options import RuntimeOptions
from llamactl.runtime.generate import peak_memory_bytes
from llamactl.runtime.kv_format import KVFormat
from llamactl.runtime.step import Decoder, attention_backend, sync

SCHEMA_VERSION = 2  # 2: rows carry "plan" (what the step ran, layers.plan.Plan) and "options"


@dataclass
class Trial:
    prompt_lens: list[int] = field(default_factory=lambda: [128])
    gen_len: int = 256
    batches: list[int] = field(default_factory=lambda: [1])
    warmup: int = 2
    repeat: int = 5
    seed: int = 0


@dataclass
class Target:
    """A model to measure: a folder or a synthetic shape, loaded once."""

    label: str
    model: Any
    artifact: Any = None  # llamactl.folder.artifact.Artifact for folders
    synthetic: str | None = None



def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device (or RAM-to-RAM) copy bandwidth in bytes/s, counting read + write.

    On CUDA, CUDA events around 4 back-to-back copies of 1 GiB, median of 10: host-timed single
    copies read 2-7% low on an H200 (3.90-4.16 TB/s against PROTOCOL.md's 4.23-4.25), which
    flatters every fraction of the ceiling computed from it."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(4):
                dst.copy_(src)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1000 / 4
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            elapsed = time.perf_counter() - t0
        if i >= 2:
            times.append(elapsed)
    del src, dst
    return 2 * nbytes / median(times)


def weight_bytes(model) -> tuple[int, int]:
    """(all weight bytes, bytes of the embedding table), counting tied tensors once."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    emb = model.model.embed_tokens
    if not isinstance(emb, torch.nn.Embedding):  # a low-bit table (its head, when tied, a kernel's copy)
        return total, sum(t.numel() * t.element_size() for t in emb.buffers())
    tied = model.lm_head.weight is emb.weight if hasattr(model.lm_head, "weight") else False
    return total, 0 if tied else emb.weight.numel() * emb.weight.element_size()


def kv_bytes_per_token(model, fmt=None) -> int:
    """K and V bytes of one position over all layers, in fmt (runtime.kv_format; default: the model's dtype)."""
    a = model.args
    return 2 * a.num_hidden_layers * a.num_key_value_heads * (fmt or KVFormat.of(model.dtype)).bytes_per_head(a.head_dim)


def _peak(device: torch.device) -> int:
    return peak_memory_bytes(device)


def time_llamactl(model, batch: int, prompt_len: int, gen_len: int, trial: Trial, mode: str,
                  profile_dir: Path | None = None, options: RuntimeOptions | None = None) -> dict[str, Any]:
    """Run warm-up + timed generations through Decoder in `mode` with `options`; per-run timings
    and latencies, and the Decoder's plan."""
    device = model.device
    gen = torch.Generator(device="cpu").manual_seed(trial.seed)
    ids = torch.randint(0, model.args.vocab_size, (batch, prompt_len), generator=gen).to(device)
    dec = Decoder(model, batch, prompt_len + gen_len, mode, options=options)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    for r in range(trial.warmup + trial.repeat):
        runs.append(_one_run(dec, ids, gen_len))
    if profile_dir is not None:
        profile_decode(dec, ids, gen_len, profile_dir)
    timed = runs[trial.warmup:]
    backend = attention_backend(model, batch, dec.max_seq, device)
    if dec.kernels["decode_attention"] != "sdpa":
        backend = f"{dec.kernels['decode_attention']} (decode), {backend} (prefill)"
    return {"runs": timed, "backend": backend, "kv_bytes": dec.cache.nbytes, "gemv": dec.plan.label, "plan": dec.plan,
            "products": products(model, batch), "kv_format": dec.cache.fmt}


def allreduce_ms_per_step(model, batch: int, steps: int = 20) -> float:
    """The all-reduces of one decode step alone (two a layer, [batch, hidden] each), in ms."""
    import time

    import torch.distributed._functional_collectives as funcol

    group = model.model.layers[0].mlp.tp_group
    x = torch.ones(batch, 1, model.args.hidden_size, device=model.device, dtype=model.dtype)
    n = 2 * model.args.num_hidden_layers

    def run():
        for _ in range(n):
            funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    run()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return (time.perf_counter() - t0) * 1000 / steps


def _one_run(dec: Decoder, ids: torch.Tensor, gen_len: int) -> dict[str, Any]:
    device, p = dec.device, ids.shape[1]
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(gen_len + 1)]
        sync(device)
        events[0].record()
        tok = dec.prefill(ids)
        events[1].record()
        for i in range(gen_len - 1):
            tok = dec.step(tok, p + i)
            events[i + 2].record()
        sync(device)
        marks = [0.0] + [events[0].elapsed_time(e) / 1000 for e in events[1:]]
    else:
        t0 = time.perf_counter()
        tok = dec.prefill(ids)
        marks = [0.0, time.perf_counter() - t0]
        for i in range(gen_len - 1):
            tok = dec.step(tok, p + i)
            marks.append(time.perf_counter() - t0)
    return {"ttft": marks[1], "total": marks[-1], "latencies": [b - a for a, b in zip(marks[1:], marks[2:])]}


def time_transformers(hf_model, batch: int, prompt_len: int, gen_len: int, trial: Trial, static: bool,
                      vocab: int) -> dict[str, Any]:
    """transformers' generate(): greedy, EOS ignored; per-token times from a logits processor."""
    from transformers import LogitsProcessor, LogitsProcessorList

    device = hf_model.device
    marks: list[Any] = []
    cuda = device.type == "cuda"

    class Clock(LogitsProcessor):
        """Marks when each new token's logits are ready; CUDA events, so no sync slows generate()."""

        def __call__(self, input_ids, scores):
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append(time.perf_counter())
            return scores

    gen = torch.Generator(device="cpu").manual_seed(trial.seed)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen).to(device)
    kwargs = dict(do_sample=False, max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=0,
                  attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([Clock()]))
    if static:
        kwargs["cache_implementation"] = "static"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = []
    with torch.inference_mode():
        for r in range(trial.warmup + trial.repeat):
            marks.clear()
            sync(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            hf_model.generate(ids, **kwargs)
            if cuda:
                end.record()
            sync(device)
            if cuda:  # marks[i]: when the logits for new token i were ready (before sampling it)
                ts = [start.elapsed_time(e) / 1000 for e in marks]
                total = start.elapsed_time(end) / 1000
            else:
                ts = [m - t0 for m in marks]
                total = time.perf_counter() - t0
            runs.append({"ttft": ts[0], "total": total, "latencies": [b - a for a, b in zip(ts, ts[1:])]})
    backend = getattr(hf_model.config, "_attn_implementation", "sdpa")
    return {"runs": runs[trial.warmup:], "backend": f"transformers:{backend}", "kv_bytes": None}


def summarize(raw: dict[str, Any], batch: int, prompt_len: int, gen_len: int) -> dict[str, Any]:
    runs = raw["runs"]
    decode = [batch * (gen_len - 1) / (r["total"] - r["ttft"]) for r in runs if r["total"] > r["ttft"]]
    ttft = [r["ttft"] for r in runs]
    lat = [x * 1000 for r in runs for x in r["latencies"]]
    return {
        "ttft_s": median(ttft),
        "prefill_tok_s": batch * prompt_len / median(ttft),
        "decode_tok_s": median(decode) if decode else 0.0,
        "decode_tok_s_per_row": (median(decode) if decode else 0.0) / batch,
        "decode_tok_s_spread": spread(decode),
        "latency_ms_p50": percentile(lat, 50) if lat else None,
        "latency_ms_p95": percentile(lat, 95) if lat else None,
        "repeats": len(runs),
        "attention_backend": raw["backend"],
        "gemv": raw.get("gemv"),
        "products": raw.get("products"),
        "plan": raw["plan"].as_dict() if raw.get("plan") else None,
        "kv_bytes": raw["kv_bytes"],
        **({"kv_dtype": raw["kv_format"].name} if raw.get("kv_format") else {}),
    }


def ceiling(model, batch: int, prompt_len: int, gen_len: int, bandwidth: float, fmt=None) -> dict[str, float]:
    """Bytes one decode step must read (its KV cache in fmt: runtime.kv_format), and the tokens/s that bandwidth allows."""
    total, emb = weight_bytes(model)
    kv_read = kv_bytes_per_token(model, fmt) * batch * (prompt_len + gen_len / 2)
    step_bytes = total - emb + kv_read
    return {"weight_bytes": total, "bytes_per_step": step_bytes, "ceiling_tok_s": batch * bandwidth / step_bytes}


def environment(device: torch.device, dtype: torch.dtype, bandwidth: float) -> dict[str, Any]:
    commit = source_commit()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                    platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import transformers
    from importlib.metadata import PackageNotFoundError, version

    try:
        flash_attn = version("flash-attn")
    except PackageNotFoundError:
        flash_attn = None  # llamactl then runs PyTorch's SDPA kernels (flash/cuDNN/efficient), as reported per row

    return {"schema_version": SCHEMA_VERSION, "llamactl_version": __version__, "commit": commit,
            "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
            "transformers": transformers.__version__, "flash_attn": flash_attn, "device": str(device), "device_name": name,
            "cpu_threads": torch.get_num_threads(), "dtype": str(dtype).replace("torch.", ""),
            "copy_bandwidth_gbs": round(bandwidth / 1e9, 2), "host": platform.node(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def source_commit() -> str | None:
    """The git commit of llamactl's source, "+dirty" when its tracked files differ from it (a copy
    of a working tree carried to another machine), None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "llamactl")
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def profile_decode(dec: Decoder, ids: torch.Tensor, gen_len: int, out_dir: Path) -> None:
    """One generation under torch.profiler; the trace opens in TensorBoard and Perfetto, and
    kernels-MODE-GEMV.txt lists the device kernels with their time per decode step."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dec.device.type == "cuda" else [])
    steps, p = min(gen_len, 32), ids.shape[1]
    with torch.inference_mode():
        tok = dec.prefill(ids)  # the prefill stays out of the profile
        sync(dec.device)
        with profile(activities=acts, on_trace_ready=tensorboard_trace_handler(str(out_dir))) as prof:
            for i in range(steps):
                tok = dec.step(tok, p + i)
            sync(dec.device)
    name = f"kernels-{dec.mode}-{dec.kernels['gemv'].split()[0]}.txt"
    n = 2
    while (out_dir / name).exists():  # one table per measured configuration
        name = f"kernels-{dec.mode}-{dec.kernels['gemv'].split()[0]}-{n}.txt"
        n += 1
    (out_dir / name).write_text(kernel_table(prof.key_averages(), steps, dec.device.type == "cuda"))


def kernel_table(events, steps: int, cuda: bool) -> str:
    """Device (CPU: host) time per kernel over `steps` decode steps, largest first."""
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    rows = [(e.key, e.count, getattr(e, attr, 0)) for e in events]
    rows = sorted((r for r in rows if r[2] > 0), key=lambda r: -r[2])
    total = sum(r[2] for r in rows) or 1
    lines = [f"device time of {steps} decode steps: {total / 1000:.2f} ms, {total / max(steps, 1):.1f} us per step",
             f"{'us/step':>9} {'share':>6} {'calls/step':>10}  kernel"]
    lines += [f"{t / max(steps, 1):9.1f} {t / total:6.1%} {c / max(steps, 1):10.2f}  {k[:150]}" for k, c, t in rows]
    return "\n".join(lines) + "\n"


def variants(modes: list[str], kernels: tuple[bool, ...], pdl: tuple[bool | None, ...],
             device: torch.device, inputs: tuple[str | None, ...] = (None,), quantized: bool = True,
             base: RuntimeOptions | None = None, kv: tuple[str | None, ...] = (None,)) -> list[tuple[str, RuntimeOptions]]:
    """The llamactl configurations timed per target, batch and prompt length: (mode, options),
    each of `base`'s options with one choice of kernels on/off, programmatic dependent launch
    on/off and the quantized GEMVs' inputs (None: base's). PDL and the inputs change only
    llamactl's kernels on a GPU, and the inputs only a `quantized` model's, so elsewhere only the
    first choice is timed. kv: the KV cache's formats (--kv-dtype), each timed everywhere."""
    base = base or RuntimeOptions()
    out = []
    for mode in modes:
        for on in kernels:
            gpu = on and device.type == "cuda"
            for i, p in enumerate(pdl):
                for j, kind in enumerate(inputs):
                    if (i == 0 or gpu) and (j == 0 or gpu and quantized):
                        out += [(mode, base.replace(kernels=on, pdl=p, quant_inputs=kind, kv_dtype=f)) for f in kv]
    return out


def is_quantized(model) -> bool:
    """Whether the model has int4 or int8 layers whose GEMV inputs --quant-inputs chooses."""
    return bool(quant_input_layers(model))


def stage_name(mode: str, plan, device_type: str = "cuda", kv=None) -> str:
    """A row's stage for people, from its mode and what ran (the row's plan has the fields), and
    the KV cache's format where one was asked for (kv: runtime.kv_format.KVFormat)."""
    stage = {"eager": "llamactl static cache", "graphs": "llamactl + CUDA graphs",
             "compile": "llamactl + compile + CUDA graphs" if device_type == "cuda" else "llamactl + compile",
             "aot": "llamactl + AOTInductor"}[mode]
    stage += " + Triton kernels" if plan.kernels else ""
    stage += " + PDL" if plan.pdl else ""
    stage += f" + {QUANT_INPUT_LABELS[plan.inputs]}" if plan.inputs != "float" else ""
    return stage + (f" + {kv.name} KV" if kv is not None else "")


def run(targets: list[Target], trial: Trial, modes: list[str], hf_stages: list[tuple[str, Callable, bool]],
        device: torch.device, dtype: torch.dtype, on_result: Callable[[dict], None] = lambda r: None,
        profile_dir: Path | None = None, kernels: tuple[bool, ...] = (True,),
        pdl: tuple[bool | None, ...] = (None,), inputs: tuple[str | None, ...] = (None,),
        options: RuntimeOptions | None = None, warn: Callable[[str], None] = lambda m: None,
        on_partial: Callable[[dict], None] = lambda r: None, kv: tuple[str | None, ...] = (None,)) -> dict[str, Any]:
    """Measure every target x variant (mode and options; see `variants`) x batch x prompt length;
    hf_stages run transformers first. kernels: llamactl's Triton kernels on (where they run)
    and/or off (cuBLAS + SDPA); kv: the KV cache's formats. warn: what a plan's warnings go to (kernels that failed their check).
    on_partial: the result so far ("partial": true) after each row, for a file that loses nothing
    when the run stops. A variant that fails is a row with its error ("failed": true), and the
    others go on."""
    for t in targets:
        ctx = t.model.args.max_position_embeddings
        if max(trial.prompt_lens) + trial.gen_len > ctx:
            raise InputError(f"--prompt-len {max(trial.prompt_lens)} + --gen-len {trial.gen_len} is longer than "
                             f"{t.label}'s context ({ctx})", "shorten them")
    bw = copy_bandwidth(device)
    env = environment(device, dtype, bw)
    results = []

    def add(base: dict, model, batch: int, p: int, raw: dict | None, skipped: str | None = None,
            failed: bool = False):
        row = dict(base, batch=batch, prompt_len=p, gen_len=trial.gen_len, device=str(device),
                   dtype=str(dtype).replace("torch.", ""))
        if skipped:
            row["skipped"] = skipped
            if failed:
                row["failed"] = True
        else:
            row.update(summarize(raw, batch, p, trial.gen_len))
            row.update(ceiling(model, batch, p, trial.gen_len, bw, raw.get("kv_format")))
            row["peak_mem_bytes"] = _peak(device)
            row["bandwidth_ceiling_frac"] = row["decode_tok_s"] / row["ceiling_tok_s"]
            if row.get("kv_bytes") is None:
                row["kv_bytes"] = kv_bytes_per_token(model) * batch * (p + trial.gen_len)
            if getattr(model, "tp", None) is not None:  # one rank's shard: its bytes, its fraction
                row["world_size"] = model.tp.world
                row["tensor_parallel"] = model.tp.describe()
                row["allreduce_ms_per_step"] = allreduce_ms_per_step(model, batch)
        results.append(row)
        on_result(row)
        on_partial({"env": env, "results": list(results), "partial": True})

    try:
        _measure_all(targets, trial, modes, hf_stages, device, profile_dir, kernels, pdl, inputs, options, warn, add, kv)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: the rows measured so far go with it (bench writes them)
        e.partial = {"env": env, "results": results, "interrupted": True}
        raise
    return {"env": env, "results": results}


def _measure_all(targets, trial, modes, hf_stages, device, profile_dir, kernels, pdl, inputs, options, warn, add, kv):
    for batch in trial.batches:
        for p in trial.prompt_lens:
            for label, make_hf, static in hf_stages:
                target = targets[0]
                stage = f"transformers generate() {'static cache' if static else 'eager'}"
                try:
                    hf = make_hf()
                except SkipStage as e:
                    add({"model": target.label, "stage": stage}, target.model, batch, p, None, str(e))
                    continue
                raw = time_transformers(hf, batch, p, trial.gen_len, trial, static, target.model.args.vocab_size)
                del hf
                add({"model": target.label, "stage": stage}, target.model, batch, p, raw)
                _free(device)
            for target in targets:
                for mode, opts in variants(modes, kernels, pdl, device, inputs, is_quantized(target.model), options, kv):
                    if mode == "graphs" and device.type != "cuda":
                        add({"model": target.label, "stage": "llamactl + CUDA graphs"}, target.model, batch, p, None,
                            "needs a CUDA device")
                        continue
                    try:
                        raw = time_llamactl(target.model, batch, p, trial.gen_len, trial, mode, profile_dir, opts)
                    except Exception as e:  # one variant failing loses no other row
                        _free(device)
                        why = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                        add({"model": target.label, "stage": f"llamactl {mode}", "options": opts.as_dict()},
                            target.model, batch, p, None, why, failed=True)
                        continue
                    for w in raw["plan"].warnings:
                        warn(w)
                    stage = stage_name(mode, raw["plan"], device.type, raw["kv_format"] if opts.kv_dtype != "auto" else None)
                    add({"model": target.label, "stage": stage, "options": opts.as_dict()}, target.model, batch, p, raw)


class SkipStage(Exception):
    """A stage that cannot run here; its message is the reason shown in the table."""


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
