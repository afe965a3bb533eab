"""generate and serve: the commands that run a model."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from llamactl import ui
from llamactl.cli.options import (DeviceOpt, DtypeOpt, JsonOpt, KernelsOpt, KvDtypeOpt, ModelArg, PickleOpt, PinsFileOpt,
                                  QuantInputsOpt, TpOpt, TrustCacheOpt, runtime_options)
from llamactl.errors import InputError


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
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="With --chat: this template instead of the model's: a built-in (plain, chatml, llama3) or a Jinja file [default: the model's; plain for the embedded model].")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at the end-of-sequence token.")] = False,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Speculative decoding: ngram (prompt lookup: proposes the tokens that followed the text's last few tokens earlier; strong where the answer copies from the prompt), a model folder with the same tokenizer (a smaller model, or this one's `llamactl quantize` output), or self-int4 / self-int8 (this model's round-to-nearest copy, made at start). The output is what plain decoding gives (greedy: the same tokens; sampled: the same distribution).")] = None,
    speculate: Annotated[int, typer.Option("--speculate", min=1, max=16, help="With --draft: the most proposals one verify step checks.")] = 4,
    compile_: Annotated[Optional[bool], typer.Option("--compile/--no-compile", help="torch.compile the decode step (loading the folder's compile cache from `llamactl compile` on this machine) [default: on where the folder holds such a cache, on the CPU; else off].", show_default=False)] = None,
    aot: Annotated[bool, typer.Option("--aot", help="On the CPU, greedy (--temperature 0): compile the decode step ahead of time with AOTInductor, one C++ call a step with no Python around it; built once (tens of seconds for a small model, minutes for a large one) and loaded from ~/.cache/llamactl/aot after.")] = False,
    trust_cache: TrustCacheOpt = False,
    quant_inputs: QuantInputsOpt = None,
    kernels: KernelsOpt = None,
    pins_file: PinsFileOpt = None,
    kv_dtype: KvDtypeOpt = None,
    json_out: JsonOpt = False,
    allow_pickle: PickleOpt = False,
    tp: TpOpt = 1,
):
    """Generate text, streamed to stdout; timing goes to stderr."""
    from llamactl.runtime import generate as gen
    from llamactl.layers.plan import Plan
    from llamactl.runtime.load import load

    options = runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file, kv_dtype=kv_dtype)
    world = tensor_parallel(tp, model, device, allow_pickle)
    if aot and compile_:
        raise typer.BadParameter("--aot and --compile: give one")
    if world and aot:
        raise InputError("--aot with --tp is not supported", "drop --aot")
    if draft is not None:
        if aot or compile_ or world:
            raise InputError("--draft runs its verify steps eagerly, on one process", "drop --aot, --compile and --tp")
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
    from llamactl.runtime import chat as chats

    if chat_template is not None:
        chats.resolve(chat_template)  # a bad name or file fails before the model loads
    art, m, tok, _ = load(model, device, dtype, allow_pickle, options, world=world)
    if compile_ is None:  # the fast path a user expects: the folder's own compile cache, made on this machine
        from llamactl.compile import signed_cache_here

        compile_ = not (aot or draft or world) and m.device.type == "cpu" and signed_cache_here(art, m.device, m.dtype)
        if compile_:
            ui.log(f"using the compile cache in {art.path}, made on this machine (--no-compile: eager)")
    if chat:
        chats.apply(tok, chat_template)
    if draft in (None, "ngram"):
        drafter = draft
    else:
        from llamactl.quantize.draft import load_draft

        drafter = load_draft(draft, art.path, tok, m, allow_pickle, options, ui.log)
    ids, templated = gen.encode_prompt(tok, prompt, chat)
    if chat and not templated:
        ui.warn(f"{art.path} has no chat template; using the prompt as plain text")
    if world and temperature > 0 and seed is None:
        from llamactl.runtime.tp import shared_seed

        seed = shared_seed()  # every rank must draw the same tokens
    sampling = gen.Sampling(temperature=temperature, top_k=top_k or 0, top_p=top_p, seed=seed)
    mode, buckets, entry = ("aot" if aot else None), None, None
    if compile_:
        from llamactl.compile import load_compile_cache, skip_compile_workers

        entry = load_compile_cache(art, m.device, m.dtype, ui.warn, trust_cache)
        if entry:
            skip_compile_workers()
        mode, buckets = "compile", (entry or {}).get("buckets")
    result = plan = None
    for ev in gen.generate(m, tok, ids, max_new_tokens, sampling, gen.eos_ids(m, tok, art), ignore_eos, mode, buckets,
                           options, drafter, speculate):
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
    compiled = f"aot {result.compile_s:.1f} s ({result.extra.get('aot_cache', 'built')}) | " if aot else ""
    if compile_:
        compiled = f"compile {result.compile_s:.1f} s ({'loaded compiled code' if entry else 'compiled now'}) | "
    ui.log(f"[dim]{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated ({result.stop_reason}) | "
           f"ttft {result.ttft_s * 1000:.1f} ms | {compiled}prefill {result.prefill_tok_s:.1f} tok/s | "
           f"decode {result.decode_tok_s:.1f} tok/s | peak mem {ui.human_bytes(result.peak_mem_bytes)} "
           f"| {result.device} {result.dtype} {result.extra.get('mode')} | gemv {result.extra['gemv']} | "
           f"{result.extra.get('attention_backend')} | kv {result.extra.get('kv_dtype')}[/dim]")
    spec = result.extra.get("speculation")
    if spec:
        ui.log(f"[dim]speculation ({spec['draft']}, up to {spec['k']} a step): {spec['accepted']} of {spec['proposed']} "
               f"proposals kept ({(spec['acceptance'] or 0) * 100:.0f}%), {spec['tokens_per_step'] or 0:.2f} tokens a "
               f"verify step over {spec['verify_steps']} steps[/dim]")


def tensor_parallel(tp: int, model: str | None, device: str, allow_pickle: bool, synthetic: str | None = None,
                     synthetic_quant: str | None = None):
    """--tp N: start N processes of this command (unless torchrun did) and join their group;
    None for --tp 1. Rank 0 prints; the others only their errors."""
    if tp == 1:
        return None
    from llamactl.runtime import tp as tpm
    from llamactl.runtime.load import resolve_device

    dev = resolve_device(device)
    if not tpm.under_launcher():
        if synthetic:
            from llamactl.runtime.synthetic import synthetic_args

            for q in (synthetic_quant or "none").split(","):
                for rank in range(tp):
                    tpm.plan_synthetic(synthetic_args(synthetic), q.strip(), rank, tp)
        else:
            from llamactl.folder.artifact import open_artifact, resolve_model_path

            tpm.check_shard_fits(open_artifact(resolve_model_path(model), allow_pickle=allow_pickle), tp)
        if dev.type == "cuda" and torch_cuda_count() < tp:
            raise InputError(f"--tp {tp} needs {tp} GPUs; {torch_cuda_count()} visible", f"use --tp {torch_cuda_count()} or fewer")
        raise typer.Exit(tpm.launch(tp, sys.argv[1:]))
    world = tpm.join(tp, dev)
    if world.rank:
        ui.follow()
    return world


def rank_device(device: str):
    """This rank's device: its own GPU (tp.join chose it), or the CPU."""
    import torch

    from llamactl.runtime.load import resolve_device

    dev = resolve_device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def serve(
    model: ModelArg = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface; mind --api-key then).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port; 0 picks a free one (printed).")] = 8000,
    max_batch: Annotated[Optional[int], typer.Option("--max-batch", min=1, max=1024, help="Most requests running at once (the KV memory may hold fewer) [default: 256 on a GPU, 8 on the CPU].")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=0, help="Requests waiting for a slot; more are answered 429 at once.")] = 64,
    max_seq: Annotated[Optional[int], typer.Option("--max-seq", min=2, help="Most tokens of one sequence (prompt + output) (default: the model's context, at most 4096).")] = None,
    kv_memory: Annotated[Optional[float], typer.Option("--kv-memory", min=0.001, help="GiB of KV cache blocks (default: what --gpu-memory-fraction leaves after the weights and activations; on the CPU --max-batch x --max-seq tokens, at most 2 GiB).")] = None,
    gpu_memory_fraction: Annotated[Optional[float], typer.Option("--gpu-memory-fraction", min=0.05, max=1.0, help="Of the GPU's memory, what weights, activations and the KV cache may take together [default: 0.9].")] = None,
    block_size: Annotated[int, typer.Option("--block-size", min=1, max=256, help="Tokens a KV block holds (prefixes are reused by whole blocks).")] = 16,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="The chat template of /v1/chat/completions: a built-in (plain, chatml, llama3) or a Jinja file [default: the model's; plain for the embedded model].")] = None,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse the KV blocks of prompts' shared prefixes (system prompts, earlier turns) instead of computing them again.")] = True,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Speculative decoding: ngram (each row proposes the tokens that followed the latest earlier occurrence of its last ones, prompt lookup), a model folder with the same tokenizer, or self-int4 / self-int8 (this model's round-to-nearest copy, made at start; its K/V in the same KV blocks); checked in one forward, the output unchanged.")] = None,
    speculate: Annotated[int, typer.Option("--speculate", min=1, max=16, help="With --draft: the most proposals a row checks in one step (each row adapts: one more than it last kept).")] = 4,
    speculate_rows: Annotated[int, typer.Option("--speculate-rows", min=1, help="With --draft: speculate only while at most this many requests run and none is prefilling (under load it steps aside).")] = 8,
    mixed_steps: Annotated[bool, typer.Option("--mixed-steps/--no-mixed-steps", help="On a GPU, the running rows' decode step goes through the same forward as the prompt chunks prefilled with it (the weights read once for both).")] = True,
    prefill_chunk: Annotated[Optional[int], typer.Option("--prefill-chunk", min=1, help="Most prompt tokens prefilled a step while others decode (a long prompt delays them by one chunk a step) [default: 2048 on a GPU, 512 on the CPU].")] = None,
    gather_ms: Annotated[Optional[float], typer.Option("--gather-ms", min=0.0, help="From idle, wait while requests keep arriving this close together (at most 10x as long), so that a burst is prefilled in one forward (not after a lone request: the next one is not held); 0: off [default: 10 on a GPU, 0 on the CPU].")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Require Authorization: Bearer KEY on /v1/* (default: LLAMACTL_API_KEY; none: open).")] = None,
    model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The name clients pass as `model` (default: the folder's name).")] = None,
    max_request_bytes: Annotated[int, typer.Option("--max-request-bytes", min=1024, help="Most bytes of a request body; a larger one is a 413. Bodies must arrive within 30 s (else 408).")] = 8 << 20,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", min=0.0, help="Seconds SIGTERM waits for the streams in flight to end.")] = 30.0,
    mode: Annotated[str, typer.Option(help="The decode step: eager, graphs (a CUDA graph per batch bucket), compile (torch.compile, then graphs: faster steps at several rows, minutes to start), or auto (graphs on CUDA, eager on the CPU).")] = "auto",
    prefill_graphs: Annotated[bool, typer.Option("--prefill-graphs/--no-prefill-graphs", help="With graphs or compile: prefills of at most 2,048 tokens (whole prompts joining) replay CUDA graphs captured at start, instead of eager launches.")] = True,
    synthetic: Annotated[Optional[str], typer.Option(help="Serve random weights of a named shape instead of MODEL (load tests): tiny, llama2-7b, llama2-7b-32k, llama2-13b, llama3-8b, llama3-70b.")] = None,
    synthetic_quant: Annotated[Optional[str], typer.Option("--synthetic-quant", help="With --synthetic: int3, int4, int5, int6 (RTN, group 128), int8 (per channel), fp8 (e4m3 per channel) or none.")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    quant_inputs: QuantInputsOpt = None,
    kernels: KernelsOpt = None,
    pins_file: PinsFileOpt = None,
    kv_dtype: KvDtypeOpt = None,
    allow_pickle: PickleOpt = False,
    tp: TpOpt = 1,
):
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching, until SIGTERM."""
    from llamactl.options import api_key as key_from_env
    from llamactl.serve.run import ServeOptions, run

    opts = ServeOptions(host=host, port=port, max_batch=max_batch, max_queue=max_queue, max_seq=max_seq,
                        prefill_chunk=prefill_chunk, gather_ms=gather_ms, drain_s=drain_timeout, api_key=api_key or key_from_env(),
                        model_name=model_name, mode=serve_mode(mode), prefill_graphs=prefill_graphs,
                        kv_memory_gib=kv_memory, gpu_memory_fraction=gpu_memory_fraction, block_size=block_size,
                        prefix_cache=prefix_cache, chat_template=chat_template, max_request_bytes=max_request_bytes,
                        mixed_steps=mixed_steps, draft=draft, speculate=speculate, speculate_rows=speculate_rows)
    if chat_template is not None:
        from llamactl.runtime.chat import resolve

        resolve(chat_template)  # a bad name or file fails before the model loads
    options = runtime_options(kernels=kernels, quant_inputs=quant_inputs, pins_file=pins_file, kv_dtype=kv_dtype)
    if model and synthetic:
        raise typer.BadParameter("MODEL and --synthetic: give one")
    world = tensor_parallel(tp, model, device, allow_pickle, synthetic, synthetic_quant)
    stopped_by, cut = run(model, device, dtype, allow_pickle, options, opts, lambda m: ui.log(m, markup=False),
                          ui.warn, synthetic, synthetic_quant, world)
    ui.log(f"stopped ({stopped_by or 'the server ended'})", markup=False)
    if cut:
        raise InputError(f"{cut} request(s) were still running when --drain-timeout {drain_timeout:g} s ended: each "
                         "got an error event and [DONE]", "give --drain-timeout more seconds to let streams finish")
    if stopped_by == "SIGINT":
        raise typer.Exit(130)


def serve_mode(mode: str) -> str | None:
    from llamactl.runtime.step import MODES

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
