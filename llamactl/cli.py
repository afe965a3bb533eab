"""The Typer app: each command parses options, calls one core function and hands the result to ui."""

from __future__ import annotations

import errno
import json
import sys
import traceback
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from llamactl import __version__, ui
from llamactl.errors import InputError, LlamactlError
from llamactl.kernels.arith import QUANT_INPUTS


GLOBAL_FLAGS = ("-q", "--quiet")
# a full, read-only or forbidden disk: the machine's state, not a bug; one line, exit 1
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class ErrorBoundary(TyperGroup):
    """The one error boundary: known errors become one line and exit 1; usage errors exit 2.
    Global flags (--quiet) work after the command name too."""

    def parse_args(self, ctx, args):
        cut = args.index("--") if "--" in args else len(args)
        flags = [a for a in args[:cut] if a in GLOBAL_FLAGS]
        rest = [a for a in args[:cut] if a not in GLOBAL_FLAGS] + args[cut:]
        return super().parse_args(ctx, flags + rest)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LlamactlError as e:
            from llamactl.options import debug

            if debug():
                traceback.print_exc()
            ui.error(e.message, e.hint)
            raise typer.Exit(1)
        except OSError as e:
            if e.errno not in _ENVIRONMENT_ERRNOS:
                raise  # anything else is a bug: keep its traceback
            ui.error(f"{e.strerror}: {e.filename or 'writing the output'}",
                     "free some space or choose another -o path" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                     else "choose a path you can write")
            raise typer.Exit(1)
        except KeyboardInterrupt as e:
            terminated = isinstance(e, Terminated)
            ui.error(f"{'terminated' if terminated else 'interrupted'}; nothing was written")
            raise typer.Exit(143 if terminated else 130)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that staged outputs are removed as for Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Terminated()


app = typer.Typer(
    cls=ErrorBoundary,
    name="llamactl",
    help="Quantize, convert, compile, run and measure LLaMA checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain usage errors and help: one line a problem, readable when piped
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _check_device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise typer.BadParameter(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")


def _check_dtype(value: str) -> str:
    if value in ("auto", "float32", "bfloat16", "float16"):
        return value
    raise typer.BadParameter(f"{value!r} is not a dtype; use auto, float32, bfloat16 or float16")


# Shared option types.
ModelArg = Annotated[Optional[str], typer.Argument(
    help="Model folder (Hugging Face format, with or without a llamactl manifest); `embedded` or none: the embedded model.",
    show_default=False, metavar="MODEL")]
ModelReq = Annotated[str, typer.Argument(help="Model folder (Hugging Face format); `embedded`: the embedded model.",
                                         metavar="MODEL")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.", callback=_check_device)]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=_check_dtype,
    help="auto, float32, bfloat16 or float16; auto = the checkpoint's on a GPU; on the CPU bfloat16 where its AVX-512 BF16 kernels build (and for GPTQ checkpoints), else float32 for models under 2B parameters.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel processes: the model split over N GPUs (or CPU processes); started here, or by torchrun --nproc-per-node N.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow .bin/.pth weights (loaded with weights_only=True).")]


def _version(value: bool):
    if value:
        typer.echo(f"llamactl {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or timing on stderr.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
):
    ui.set_quiet(quiet)


@app.command()
def generate(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text; read from stdin when omitted.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature; 0 = greedy.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[Optional[int], typer.Option("--top-k", min=1, help="Sample from the k likeliest tokens.")] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, max=2**63 - 1, help="Random seed (0 to 2^63-1); the same seed gives the same text.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    chat: Annotated[bool, typer.Option("--chat", help="Apply the tokenizer's chat template when it has one.")] = False,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the end-of-sequence token.")] = False,
    compile_: Annotated[bool, typer.Option("--compile", help="torch.compile the decode step (uses the folder's compile cache from `llamactl compile` on this machine).")] = False,
    trust_cache: TrustCacheOpt = False,
    quant_inputs: QuantInputsOpt = None,
    kernels: KernelsOpt = None,
    pins_file: PinsFileOpt = None,
    json_out: JsonOpt = False,
    allow_pickle: PickleOpt = False,
    tp: TpOpt = 1,
):
    """Generate text, streamed to stdout; timing goes to stderr."""
    from llamactl import generate as gen
    from llamactl.layers.plan import Plan
    from llamactl.load import load

    options = _runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file)
    world = _tensor_parallel(tp, model, device, allow_pickle)
    if world and compile_:
        raise InputError("--compile with --tp is not supported yet", "drop --compile (CUDA graphs still capture each rank's step)")
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InputError("no prompt given", "pass --prompt TEXT or pipe the prompt on stdin")
        try:
            prompt = sys.stdin.read().rstrip("\n")
        except UnicodeDecodeError as e:
            raise InputError(f"stdin is not UTF-8 text (at byte {e.start})", "pipe UTF-8 text, or pass --prompt TEXT") from None
        if not prompt:
            raise InputError("no prompt given: stdin was empty", "pass --prompt TEXT or pipe the prompt on stdin")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable bytes, kept as surrogates by Python's stdin/argv decoding
        raise InputError(f"the prompt is not UTF-8 text (at character {e.start})", "pass UTF-8 text") from None
    art, m, tok, _ = load(model, device, dtype, allow_pickle, options, world=world)
    ids, templated = gen.encode_prompt(tok, prompt, chat)
    if chat and not templated:
        ui.warn(f"{art.path} has no chat template; using the prompt as plain text")
    if world and temperature > 0 and seed is None:
        from llamactl.tp import shared_seed

        seed = shared_seed()  # every rank must draw the same tokens
    sampling = gen.Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    mode, buckets, entry = None, None, None
    if compile_:
        from llamactl.compile import load_compile_cache, skip_compile_workers

        entry = load_compile_cache(art, m.device, m.dtype, ui.warn, trust_cache)
        if entry:
            skip_compile_workers()
        mode, buckets = "compile", (entry or {}).get("buckets")
    result = plan = None
    for ev in gen.generate(m, tok, ids, max_new_tokens, sampling, gen.eos_ids(m, tok, art), ignore_eos, mode, buckets,
                           options):
        if isinstance(ev, Plan):
            plan = ev
            for w in plan.warnings:
                ui.warn(w)
        elif isinstance(ev, gen.Result):
            result = ev
        elif not json_out:
            ui.emit_text(ev.text)
    if not json_out:
        ui.emit_text("\n")  # before any warning, which goes to stderr
    _warn_about_gemv(plan, result.device, entry, quant_inputs)
    if json_out:
        ui.emit_json({"model": str(art.path), **vars(result),
                      "compile_cache": None if not compile_ else ("loaded" if entry else "compiled now"),
                      "tensor_parallel": m.tp.describe() if world else None})
        return
    compiled = ""
    if compile_:
        compiled = f"compile {result.compile_s:.1f} s ({'loaded compiled code' if entry else 'compiled now'}) | "
    ui.log(f"[dim]{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated ({result.stop_reason}) | "
           f"ttft {result.ttft_s * 1000:.1f} ms | {compiled}prefill {result.prefill_tok_s:.1f} tok/s | "
           f"decode {result.decode_tok_s:.1f} tok/s | peak mem {ui.human_bytes(result.peak_mem_bytes)} "
           f"| {result.device} {result.dtype} {result.extra.get('mode')} | gemv {result.extra['gemv']} | "
           f"{result.extra.get('attention_backend')}[/dim]")


def _tensor_parallel(tp: int, model: str | None, device: str, allow_pickle: bool, synthetic: str | None = None,
                     synthetic_quant: str | None = None):
    """--tp N: start N processes of this command (unless torchrun did) and join their group;
    None for --tp 1. Rank 0 prints; the others only their errors."""
    if tp == 1:
        return None
    from llamactl import tp as tpm
    from llamactl.load import resolve_device

    dev = resolve_device(device)
    if not tpm.under_launcher():
        if synthetic:
            from llamactl.synthetic import synthetic_args

            for q in (synthetic_quant or "none").split(","):
                for rank in range(tp):
                    tpm.plan_synthetic(synthetic_args(synthetic), q.strip(), rank, tp)
        else:
            from llamactl.artifact import open_artifact, resolve_model_path

            tpm.check_shard_fits(open_artifact(resolve_model_path(model), allow_pickle=allow_pickle), tp)
        if dev.type == "cuda" and torch_cuda_count() < tp:
            raise InputError(f"--tp {tp} needs {tp} GPUs; {torch_cuda_count()} visible", f"use --tp {torch_cuda_count()} or fewer")
        raise typer.Exit(tpm.launch(tp, sys.argv[1:]))
    world = tpm.join(tp, dev)
    if world.rank:
        ui.follow()
    return world


def _rank_device(device: str):
    """This rank's device: its own GPU (tp.join chose it), or the CPU."""
    import torch

    from llamactl.load import resolve_device

    dev = resolve_device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


@app.command()
def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface; mind --api-key then).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port; 0 picks a free one (printed).")] = 8000,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, max=1024, help="Requests decoded together (slots of the KV cache).")] = 8,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests waiting for a slot; more are answered 429 at once.")] = 64,
    max_seq: Annotated[Optional[int], typer.Option("--max-seq", min=2, help="Tokens a slot holds (prompt + output) (default: the model's context, at most 4096).")] = None,
    prefill_chunk: Annotated[int, typer.Option("--prefill-chunk", min=1, help="Most prompt tokens prefilled a step while others decode (a long prompt delays them by one chunk a step).")] = 512,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require Authorization: Bearer KEY on /v1/* (default: LLAMACTL_API_KEY; none: open).")] = None,
    model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The name clients pass as `model` (default: the folder's name).")] = None,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0.0, help="Seconds SIGTERM waits for the streams in flight to end.")] = 30.0,
    mode: Annotated[str, typer.Option(help="The decode step: eager, graphs (a CUDA graph per batch bucket), compile (torch.compile, then graphs: faster steps at several rows, minutes to start), or auto (graphs on CUDA, eager on the CPU).")] = "auto",
    synthetic: Annotated[Optional[str], typer.Option(help="Serve random weights of a named shape instead of MODEL (load tests): tiny, llama2-7b, llama2-13b, llama3-8b, llama3-70b.")] = None,
    synthetic_quant: Annotated[Optional[str], typer.Option("--synthetic-quant", help="With --synthetic: int3, int4, int5, int6 (RTN, group 128), int8 (per channel) or none.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quant_inputs: QuantInputsOpt = None,
    kernels: KernelsOpt = None,
    pins_file: PinsFileOpt = None,
    allow_pickle: PickleOpt = False,
    tp: TpOpt = 1,
):
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching, until SIGTERM."""
    from llamactl.options import api_key as key_from_env
    from llamactl.serve.run import ServeOptions, run

    opts = ServeOptions(host=host, port=port, max_batch=max_batch, max_queue=max_queue, max_seq=max_seq,
                        prefill_chunk=prefill_chunk, drain_s=drain_timeout, api_key=api_key or key_from_env(),
                        model_name=model_name, mode=_serve_mode(mode))
    options = _runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file)
    if model and synthetic:
        raise typer.BadParameter("MODEL and --synthetic: give one")
    world = _tensor_parallel(tp, model, device, allow_pickle, synthetic, synthetic_quant)
    stopped_by = run(model, device, dtype, allow_pickle, options, opts, lambda m: ui.log(m, markup=False), ui.warn,
                     synthetic, synthetic_quant, world)
    ui.log(f"stopped ({stopped_by or 'the server ended'})", markup=False)
    if stopped_by == "SIGINT":
        raise typer.Exit(130)


def _serve_mode(mode: str) -> str | None:
    from llamactl.decode import MODES

    if mode != "auto" and mode not in MODES:
        raise typer.BadParameter(f"--mode {mode}: use auto, {', '.join(MODES)}")
    return None if mode == "auto" else mode


def _warn_about_gemv(plan, device: str, compiled: dict | None, quant_inputs: str | None) -> None:
    """Say when the GEMVs that ran are not those asked for: a compile cache made for others, or int8
    inputs/fp16 arithmetic/int16 inputs where they do not apply."""
    if compiled and compiled.get("gemv") not in (None, plan.label):
        ui.warn(f"the compile cache was made for gemv {compiled['gemv']}; this run used {plan.label}, "
                "so its kernels were compiled now (`llamactl compile --quant-inputs` picks what to compile for)")
    if quant_inputs not in (None, "float") and plan.inputs != quant_inputs:
        ui.warn(f"--quant-inputs {quant_inputs} changed nothing: it applies to int4/int8 models on llamactl's GPU "
                f"kernels (this run: {plan.label} on {device})")


@app.command()
def inspect(model: ModelArg = None, json_out: JsonOpt = False, allow_pickle: PickleOpt = False):
    """Architecture, sizes, KV-cache cost, quantization and lineage of a model folder."""
    from llamactl.artifact import open_artifact, resolve_model_path
    from llamactl.info import describe

    art = open_artifact(resolve_model_path(model), allow_pickle=allow_pickle)
    from llamactl.load import check_tensors  # torch: only for a folder that opened

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


LARGE_KL = 0.1  # nats a token: more than 4-bit RTN costs the embedded model (0.07); convert-heads warns past it
TrustCacheOpt = Annotated[bool, typer.Option("--trust-compile-cache", help="Load a model folder's compile cache (native code) even when it was not built by this user on this machine.")]
def _busy_cpu() -> str | None:
    """"load L on N cores" when the 1-minute load average passes half the cores, else None."""
    import os

    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return None
    return f"load {load:.1f} on {cores} cores" if load > cores / 2 else None


def _kv_line(info: dict) -> str:
    """KV-cache bytes per token, at 4K and at the model's context (float32 on the CPU doubles them)."""
    ctx, h = info["context_length"], ui.human_bytes
    at = f"{h(info['kv_bytes_at_4k'])} at 4K, " if ctx > 4096 else ""
    return (f"{h(info['kv_bytes_per_token'])}/token, {at}{h(info['kv_bytes_at_context'])} at its "
            f"{ctx:,}-token context (float32 doubles these)")


ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")]
OutOpt = Annotated[str, typer.Option("--output", "-o", help="Output folder (written atomically).")]
QuantInputsOpt = Annotated[Optional[str], typer.Option("--quant-inputs", callback=lambda v: _check_quant_inputs(v), help="What the int4/int8 GEMVs multiply with (GPU kernels): float, int8 (rounded per 32 columns, DP4A: faster, a little less exact), fp16 (packed fp16 arithmetic, x exact), or int16 (16-bit fixed point per 32 columns, DP2A: sums exact) (default: LLAMACTL_QUANT_INPUTS, else int16).")]
KernelsOpt = Annotated[Optional[str], typer.Option("--kernels", callback=lambda v: _check_on_off("--kernels", v), help="llamactl's Triton kernels on the GPU: on or off (cuBLAS/SDPA) (default: LLAMACTL_KERNELS, else on).")]
PinsFileOpt = Annotated[Optional[str], typer.Option("--pins-file", help="Pinned kernel configs to run over the packaged ones (a file `llamactl bench --tune` wrote) (default: LLAMACTL_PINS_FILE).")]
EvalOpt = Annotated[Optional[str], typer.Option("--eval", help="Plain-text file for the quality report (default: packaged docs-eval.txt).")]
EvalTokensOpt = Annotated[int, typer.Option("--eval-tokens", min=0, help="Tokens scored in the quality report; 0 skips it.")]


@app.command()
def quantize(
    model: ModelReq,
    output: OutOpt,
    method: Annotated[str, typer.Option(help="gptq (GPTQModel), rtn (round-to-nearest), nf4 or int8 (bitsandbytes).")] = "gptq",
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
    widths: Annotated[str, typer.Option("--widths", help="The bit widths --target-bpw may choose (a comma list). 3, 5 and 6 give the best quality a byte but their kernels are slower than 4 and 8 bits today: --widths 4,8 for a file at the int4/int8 kernels' speed.")] = "3,4,5,6,8",
    calib_stats: Annotated[Optional[str], typer.Option("--calib-stats", help="Calibration statistics from `llamactl calibrate` (sensitivities for --target-bpw; rtn --clip-search weights its error by them).", show_default=False)] = None,
    eval_file: EvalOpt = None,
    eval_tokens: EvalTokensOpt = 32768,
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
                        target_bpw=target_bpw, calib_stats=calib_stats, widths=tuple(_int_list("--widths", widths)))
    manifest = run(model, output, opts, force=force, eval_file=eval_file, eval_tokens=eval_tokens, device=device,
                   progress=ui.progress, log=ui.log)
    _report(manifest, json_out)


@app.command()
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


@app.command("convert-heads")
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
    eval_tokens: EvalTokensOpt = 32768,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
    json_out: JsonOpt = False,
):
    """Convert multi-head attention to grouped-query attention with fewer KV heads."""
    from llamactl.convert import HeadsOptions, convert_heads as run

    opts = HeadsOptions(kv_heads=kv_heads, grouping=grouping, merge=merge, calib=calib, n_samples=n_samples,
                        seq_len=seq_len, distill_steps=distill_steps, distill_lr=distill_lr)
    manifest = run(model, output, opts, force=force, eval_file=eval_file, eval_tokens=eval_tokens, device=device,
                   progress=ui.progress, log=ui.log)
    m = manifest["metrics"]
    if json_out:
        ui.emit_json({"output": manifest["output"], "kv_bytes_per_token_before": m["kv_bytes_per_token_before"],
                      "kv_bytes_per_token_after": m["kv_bytes_per_token_after"], "quality": m.get("quality"),
                      "params": manifest["params"], "metrics": {k: v for k, v in m.items() if k != "quality"}})
        return
    h = ui.human_bytes
    rows = [("KV heads", manifest["params"]["kv_heads_before"], kv_heads),
            ("KV cache per token", h(m["kv_bytes_per_token_before"]), h(m["kv_bytes_per_token_after"])),
            ("KV cache at 4K", h(m["kv_bytes_at_4k_before"]), h(m["kv_bytes_at_4k_after"])),
            ("KV cache at 32K", h(m["kv_bytes_at_32k_before"]), h(m["kv_bytes_at_32k_after"])),
            ("parameters", f"{m['params_before']:,}", f"{m['params_after']:,}")]
    q = m.get("quality")
    if q:
        rows += [("perplexity", f"{q['ppl_parent']:.3f}", f"{q['ppl']:.3f} ({(q['ppl'] / q['ppl_parent'] - 1) * 100:+.2f}%)"),
                 ("KL(parent || child), mean", "0", f"{q['kl_mean']:.5f}"),
                 ("top-1 agreement", "100%", f"{q['top1_agreement'] * 100:.2f}%")]
    if m.get("distill"):
        rows.append(("distillation KL (train)", f"{m['distill']['kl_first']:.4f}", f"{m['distill']['kl_last']:.4f}"))
    ui.table(f"convert-heads ({grouping}, {merge}) -> {manifest['output']}", ["", "parent", "child"], rows)
    if q and q["kl_mean"] > LARGE_KL:
        repair = [] if merge == "fit" else ["--merge fit"]
        repair += [] if distill_steps >= 200 else ["--distill-steps 200"]
        ui.warn(f"the child lost much quality (KL {q['kl_mean']:.3f} nats a token, top-1 agreement "
                f"{q['top1_agreement'] * 100:.0f}%)" + (f"; {' and '.join(repair)} {'repair' if len(repair) > 1 else 'repairs'} most of it" if repair else ""))


@app.command()
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
    from llamactl.interop.stage import ConvertOptions, convert as run

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


@app.command("compile")
def compile_cmd(
    model: ModelArg = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Output folder (default: MODEL-compiled).")] = None,
    mode: Annotated[str, typer.Option(help="default, reduce-overhead or max-autotune (inductor autotuning; slower to compile).")] = "default",
    buckets: Annotated[str, typer.Option(help="KV-cache lengths to compile for; a generation uses the smallest that fits.", callback=lambda v: _int_list("--buckets", v))] = "128,512,2048",
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
    from llamactl.load import resolve_model_path

    options = _runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file)
    from llamactl.artifact import DEFAULT_MODEL

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


def _check_quant_inputs(value: str | None) -> str | None:
    if value is not None and value not in QUANT_INPUTS:
        raise typer.BadParameter(f"{value!r}: use {', '.join(QUANT_INPUTS[:-1])} or {QUANT_INPUTS[-1]}")
    return value


def _check_on_off(option: str, value: str | None) -> str | None:
    if value is not None and value not in ("on", "off"):
        raise typer.BadParameter(f"{value!r}: use on or off")
    return value


def _int_list(option: str, value: str) -> list[int]:
    """A comma list of positive integers (a malformed one is a usage error, exit 2)."""
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma list of integers; for example {option} 128,2048")
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{value!r} needs positive integers; for example {option} 128,2048")
    return out


def _runtime_options(kernels: str | None = None, pdl: str | None = None, quant_inputs: str | None = None,
                     pins_file: str | None = None):
    """The run's RuntimeOptions: the flags given, over the LLAMACTL_* variables, over the defaults."""
    from llamactl.options import RuntimeOptions

    on = {"on": True, "off": False, None: None}
    if pins_file is not None and not Path(pins_file).is_file():
        raise InputError(f"--pins-file {pins_file}: no such file", "write one with `llamactl bench --tune FILE`")
    return RuntimeOptions.from_env().replace(kernels=on[kernels], pdl=on[pdl], quant_inputs=quant_inputs,
                                             pins_file=pins_file)


def _comma_choices(option: str, value: str | None, choices: dict, hint: str) -> tuple:
    """A comma list of `choices`' keys as their values; (None,) when the option was not given."""
    if value is None:
        return (None,)
    if not value or any(part not in choices for part in value.split(",")):
        raise typer.BadParameter(f"{option} {value!r}: use {hint}")
    return tuple(choices[part] for part in value.split(","))


@app.command()
def bench(
    models: Annotated[Optional[list[str]], typer.Argument(help="Model folders (default: the embedded model).", show_default=False)] = None,
    prompt_len: Annotated[str, typer.Option("--prompt-len", help="Prompt tokens; a comma list sweeps.", callback=lambda v: _int_list("--prompt-len", v))] = "128",
    gen_len: Annotated[int, typer.Option("--gen-len", min=2, help="New tokens per generation.")] = 256,
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes; a comma list sweeps.", callback=lambda v: _int_list("--batch", v))] = "1",
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs first (compilation, graph capture).")] = 2,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs; the median is reported.")] = 5,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    mode: Annotated[str, typer.Option(help="llamactl decode modes, comma list: eager, graphs, compile (auto: graphs on CUDA, eager on CPU).")] = "auto",
    kernels: Annotated[str, typer.Option(help="llamactl's Triton GEMV and decode-attention kernels (CUDA): on, off, or on,off to time both.")] = "on",
    pdl: Annotated[Optional[str], typer.Option("--pdl", help="Programmatic dependent launch of the kernels (Hopper GPUs): on, off, or off,on to time both in one run (default: LLAMACTL_PDL).")] = None,
    quant_inputs: Annotated[Optional[str], typer.Option("--quant-inputs", help="What the int4/int8 GEMVs multiply with (GPU kernels): float, int8 (rounded per 32 columns, DP4A), fp16 (packed fp16 arithmetic), int16 (16-bit fixed point, DP2A), or a comma list such as float,int16 to time each in one run (default: LLAMACTL_QUANT_INPUTS, else int16).")] = None,
    stages: Annotated[bool, typer.Option("--stages", help="The optimization ladder: transformers eager and static cache, llamactl eager, + CUDA graphs, + compile.")] = False,
    synthetic: Annotated[Optional[str], typer.Option(help="Random weights of a named shape: tiny, llama2-7b, llama2-13b, llama3-8b, llama3-70b.")] = None,
    synthetic_quant: Annotated[Optional[str], typer.Option("--synthetic-quant", help="int3, int4, int5, int6 (RTN, group 128), int8 (per channel) or none; a comma list times several copies of the synthetic model in one run.")] = None,
    quality: Annotated[bool, typer.Option("--quality", help="Also perplexity, and KL/top-1 against --reference.")] = False,
    reference: Annotated[Optional[str], typer.Option(help="Reference model for KL (default: the root of the manifest chain).")] = None,
    eval_file: EvalOpt = None,
    eval_tokens: EvalTokensOpt = 16384,
    fmt: Annotated[str, typer.Option("--format", help="table, json, csv or markdown.")] = "table",
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Also write the result in --format to this file.")] = None,
    profile: Annotated[Optional[str], typer.Option(help="Write a torch.profiler trace of the decode loop to this folder.")] = None,
    compare_files: Annotated[Optional[tuple[str, str]], typer.Option("--compare", help="BASE.json NEW.json: compare two results instead of measuring.")] = None,
    max_slowdown: Annotated[str, typer.Option("--max-slowdown", help="With --compare: exit 1 when decode or prefill got slower than this.")] = "5%",
    pins_file: PinsFileOpt = None,
    trust_cache: TrustCacheOpt = False,
    tune: Annotated[Optional[str], typer.Option("--tune", help="Tune every GEMV shape afresh (no pins) and write the autotuner's picks as a pins file for this GPU (CUDA).")] = None,
    url: Annotated[Optional[str], typer.Option("--url", help="Load-test the OpenAI-compatible server at this address (llamactl serve, vLLM, llama.cpp) instead of timing models here.")] = None,
    serve_model: Annotated[Optional[str], typer.Option("--serve", help="Start `llamactl serve` on this model (or `embedded`; with --synthetic, its random weights) for the load test, and stop it after.")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Load test: clients sending at once; a comma list sweeps.", callback=lambda v: _int_list("--concurrency", v))] = "1",
    requests: Annotated[int, typer.Option("--requests", min=1, help="Load test: requests per concurrency level.")] = 64,
    rate: Annotated[Optional[float], typer.Option("--rate", min=0.001, help="Load test: Poisson arrivals of this many requests a second (at most --concurrency in flight) instead of a closed loop.")] = None,
    served_model: Annotated[Optional[str], typer.Option("--model", help="Load test: the model name to send (default: the server's first in /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Load test: the server's API key (default: LLAMACTL_API_KEY).")] = None,
    tp: TpOpt = 1,
):
    """Speed, memory and quality of one or more models, as tables or JSON; with --url, a load test of a server."""
    from llamactl import report

    if fmt not in ("table", "json", "csv", "markdown"):
        raise typer.BadParameter(f"--format {fmt!r}: use table, json, csv or markdown")
    if url or serve_model:
        if url and serve_model:
            raise typer.BadParameter("--url and --serve: give one (--serve starts its own server)")
        prompt = prompt_len[0] if len(prompt_len) == 1 else None
        if prompt is None:
            raise typer.BadParameter("a load test takes one --prompt-len")
        from llamactl import loadtest
        from llamactl.options import api_key as key_from_env

        load = loadtest.Load(url=url or "", concurrency=concurrency, requests=requests, prompt_len=prompt,
                             gen_len=gen_len, rate=rate, model=served_model, api_key=api_key or key_from_env())
        _load_test(load, serve_model, synthetic, synthetic_quant, device, dtype, _serve_mode(mode), fmt, output)
        return
    if compare_files:
        diffs, ok = report.compare(report.load_report(compare_files[0]), report.load_report(compare_files[1]),
                                   report.parse_percent(max_slowdown))
        ui.table(f"{compare_files[0]} -> {compare_files[1]} (max slowdown {max_slowdown})",
                 ["model", "stage", "batch", "prompt", "decode tok/s", "change", "prefill tok/s", "change", ""],
                 [[d["model"], d["stage"], d["batch"], d["prompt_len"], f"{d['decode_tok_s'][0]:.1f} -> {d['decode_tok_s'][1]:.1f}",
                   f"{d['decode_tok_s'][2]:+.1%}", f"{d['prefill_tok_s'][0]:.0f} -> {d['prefill_tok_s'][1]:.0f}",
                   f"{d['prefill_tok_s'][2]:+.1%}", "SLOWER" if d.get("regressed") else "ok"] for d in diffs])
        if not ok:
            raise typer.Exit(1)
        return
    from llamactl import bench as core  # torch: only for measuring
    from llamactl import bench_targets as bt
    from llamactl.load import resolve_device

    if tp > 1 and (quality or stages or tune or profile or len(models or []) > 1):
        raise InputError("--tp times one model's decode", "drop --quality, --stages, --tune, --profile and extra models")
    world = _tensor_parallel(tp, (models or [None])[0], device, False, synthetic, synthetic_quant)
    trial = core.Trial(prompt_lens=prompt_len, gen_len=gen_len, batches=batch, warmup=warmup, repeat=repeat)
    dev = resolve_device(device) if world is None else _rank_device(device)
    options = _runtime_options(pins_file=pins_file)
    if tune:
        if dev.type != "cuda":
            raise InputError("--tune times the GPU kernels' configs: it needs a CUDA device", "run it on the GPU")
        options = options.replace(pins=False)
    modes = [m for m in mode.split(",") if m]
    if modes == ["auto"]:
        modes = ["graphs"] if dev.type == "cuda" else ["eager"]
    if stages:
        modes = ["eager", "graphs", "compile"]
    bad = [m for m in modes if m not in ("eager", "graphs", "compile")]
    if bad:
        raise typer.BadParameter(f"--mode {','.join(bad)}: use eager, graphs or compile")
    on_off = {"on": True, "off": False}
    kernel_list = _comma_choices("--kernels", kernels, on_off, "on, off or on,off")
    pdl_list = _comma_choices("--pdl", pdl, on_off, "on, off or off,on")
    inputs_list = _comma_choices("--quant-inputs", quant_inputs, {k: k for k in QUANT_INPUTS},
                                 f"{', '.join(QUANT_INPUTS)} or a comma list of them")
    if output:
        from llamactl.artifact import check_writable_file

        check_writable_file(Path(output), "--output")
    if quality and eval_tokens > 0:
        from llamactl.quality import check_eval_file

        check_eval_file(eval_file)
    if world and "compile" in modes:
        raise InputError("--mode compile with --tp is not supported yet", "use --mode graphs or eager")
    targets = bt.load_targets(models or [], synthetic, dev, dtype, synthetic_quant,
                              ui.warn if "compile" in modes else None, options, trust_cache, world)
    dt = targets[0].model.dtype
    hf = bt.hf_stages(targets[0], dev, dt) if stages else []
    ui.log(f"benchmarking {len(targets)} model(s) on {dev} ({str(dt).replace('torch.', '')})")
    busy = _busy_cpu() if dev.type == "cpu" else None
    if busy:
        ui.warn(f"the machine is busy ({busy}): the copy bandwidth, and so each row's fraction of the ceiling, "
                "will read low; compare rows of this run only")
    runs = sum(len(core.variants(modes, kernel_list, pdl_list, dev, inputs_list, core.is_quantized(t.model)))
               for t in targets)
    total = len(trial.batches) * len(trial.prompt_lens) * (len(hf) + runs)
    with ui.progress("bench", total) as advance:
        def measured(row: dict) -> None:
            ui.log(report.row_line(row), markup=False)
            advance(1)

        result = core.run(targets, trial, modes, hf, dev, dt, on_result=measured,
                          profile_dir=Path(profile) if profile else None, kernels=kernel_list, pdl=pdl_list,
                          inputs=inputs_list, options=options, warn=ui.warn)
    if tune:
        from llamactl.tune import write_pins

        n = write_pins(Path(tune), dev, " ".join(["llamactl", "bench", *sys.argv[2:]]))
        ui.log(f"wrote {n} pinned configs to {tune} (run them with --pins-file {tune}, or copy them into "
               "llamactl/kernels/configs/ for this GPU)")
    if quality:
        bt.add_quality(result["results"], targets, reference, eval_file, eval_tokens, dev, ui.progress, options)
    report.add_speedups(result["results"])
    env = result["env"]
    if world and world.rank:
        return  # rank 0 reports for the group
    _emit_result(result, fmt, output,
                 f"{env['device_name']} | torch {env['torch']} | copy {env['copy_bandwidth_gbs']} GB/s")


def _emit_result(result: dict, fmt: str, output: str | None, title: str) -> None:
    """A bench result on stdout in --format (a table titled `title`), and in -o's file too."""
    from llamactl import report

    text = {"json": report.to_json, "csv": report.to_csv, "markdown": report.to_markdown}.get(fmt)
    if output:
        from llamactl.artifact import atomic_write_text

        atomic_write_text(Path(output), (text or report.to_markdown)(result))
    if text:
        ui.emit_text(text(result))
    else:
        headers, body = report.rows(result["results"])
        ui.table(title, headers, body)


def _load_test(load, serve_model: str | None, synthetic: str | None, synthetic_quant: str | None, device: str,
               dtype: str, mode: str | None, fmt: str, output: str | None) -> None:
    """bench --url / --serve: run the load test (starting and stopping a server for --serve)."""
    from llamactl import loadtest, report

    if output:
        from llamactl.artifact import check_writable_file

        check_writable_file(Path(output), "--output")
    with ui.progress("load test", len(load.concurrency)) as advance:
        def measured(row: dict) -> None:
            ui.log(report.row_line(row), markup=False)
            advance(1)

        if serve_model:
            from llamactl.serve.spawn import spawned

            room = 2 * load.prompt_len + load.gen_len  # a word may be more than one token
            with spawned(serve_model, max(load.concurrency), room, device, dtype, synthetic, synthetic_quant,
                         load.api_key, ui.log, mode) as url:
                load.url = url
                result = loadtest.run(load, measured)
        else:
            result = loadtest.run(load, measured)
    _emit_result(result, fmt, output, f"load test of {result['env']['url']}")


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    app(prog_name="llamactl")
