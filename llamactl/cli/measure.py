"""bench: speed, memory and quality of models, and load tests of servers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llamactl import ui
from llamactl.cli.options import (DeviceOpt, DtypeOpt, EvalOpt, PinsFileOpt, TpOpt, TrustCacheOpt,
                                  comma_choices, int_list, runtime_options)
from llamactl.cli.run import rank_device, serve_mode, tensor_parallel
from llamactl.errors import InputError
from llamactl.kernels.arith import QUANT_INPUTS
from llamactl.options import KV_DTYPES


def busy_cpu() -> str | None:
    """"load L on N cores" when the 1-minute load average passes half the cores, else None."""
    import os

    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        return None
    return f"load {load:.1f} on {cores} cores" if load > cores / 2 else None


def len_range(name: str, value: str, least: int) -> list[tuple[int, int]]:
    """"128", "64,128" (a sweep) or "64:2048" (a range) -> [(lo, hi)]: each at least `least`."""
    out = []
    for part in value.split(","):
        lo, _, hi = part.strip().partition(":")
        try:
            pair = (int(lo), int(hi) if hi else int(lo))
        except ValueError:
            raise typer.BadParameter(f"{name} {value!r}: whole numbers, a comma list or LO:HI") from None
        if pair[0] < least or pair[1] < pair[0]:
            raise typer.BadParameter(f"{name} {part!r}: at least {least}, and LO <= HI")
        out.append(pair)
    return out


def bench(
    models: Annotated[Optional[list[str]], typer.Argument(help="Model folders (default: the embedded model).", show_default=False)] = None,
    prompt_len: Annotated[str, typer.Option("--prompt-len", help="Prompt tokens; a comma list sweeps; a load test takes one, or a range LO:HI (uniform; words).", callback=lambda v: len_range("--prompt-len", v, 1))] = "128",
    gen_len: Annotated[str, typer.Option("--gen-len", help="New tokens per generation; a load test takes a range LO:HI too (uniform).", callback=lambda v: len_range("--gen-len", v, 2))] = "256",
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes; a comma list sweeps.", callback=lambda v: int_list("--batch", v))] = "1",
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs first (compilation, graph capture).")] = 2,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs; the median is reported.")] = 5,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    mode: Annotated[str, typer.Option(help="llamactl decode modes, comma list: eager, graphs, compile, aot (the greedy CPU step compiled ahead of time by AOTInductor: no Python a step) (auto: graphs on CUDA, eager on CPU).")] = "auto",
    kernels: Annotated[str, typer.Option(help="llamactl's Triton GEMV and decode-attention kernels (CUDA): on, off, or on,off to time both.")] = "on",
    pdl: Annotated[Optional[str], typer.Option("--pdl", help="Programmatic dependent launch of the kernels (Hopper GPUs): on, off, or off,on to time both in one run (default: LLAMACTL_PDL).")] = None,
    quant_inputs: Annotated[Optional[str], typer.Option("--quant-inputs", help="What the int4/int8 GEMVs multiply with (GPU kernels): float, int8 (rounded per 32 columns, DP4A), fp16 (packed fp16 arithmetic), int16 (16-bit fixed point, DP2A), or a comma list such as float,int16 to time each in one run (default: LLAMACTL_QUANT_INPUTS, else int16).")] = None,
    stages: Annotated[bool, typer.Option("--stages", help="The optimization ladder: transformers eager and static cache, llamactl eager, + CUDA graphs, + compile.")] = False,
    synthetic: Annotated[Optional[str], typer.Option(help="Random weights of a named shape: tiny, llama2-7b, llama2-7b-32k, llama2-13b, llama3-8b, llama3-70b.")] = None,
    synthetic_quant: Annotated[Optional[str], typer.Option("--synthetic-quant", help="int3, int4, int5, int6 (RTN, group 128), int8 (per channel), fp8 (e4m3 per channel, W8A8 on FP8 GPUs) or none; a comma list times several copies of the synthetic model in one run.")] = None,
    quality: Annotated[bool, typer.Option("--quality", help="Also perplexity, and KL/top-1 against --reference.")] = False,
    reference: Annotated[Optional[str], typer.Option(help="Reference model for KL (default: the root of the manifest chain).")] = None,
    eval_file: EvalOpt = None,
    eval_tokens: Annotated[int, typer.Option("--eval-tokens", min=0, help="Tokens --quality scores; 0 skips it.")] = 16384,
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
    concurrency: Annotated[str, typer.Option("--concurrency", help="Load test: clients sending at once; a comma list sweeps.", callback=lambda v: int_list("--concurrency", v))] = "1",
    requests: Annotated[int, typer.Option("--requests", min=1, help="Load test: requests per concurrency level.")] = 64,
    rate: Annotated[Optional[float], typer.Option("--rate", min=0.001, help="Load test: Poisson arrivals of this many requests a second (at most --concurrency in flight) instead of a closed loop.")] = None,
    ramp_up: Annotated[float, typer.Option("--ramp-up", min=0.0, help="Load test, closed loop: start the clients evenly over this many seconds, not all at once (a cold burst's queue otherwise sets the TTFT percentiles).")] = 0.0,
    shared_prefix: Annotated[int, typer.Option("--shared-prefix", min=0, help="Load test: words every prompt begins with (a system prompt), before its own --prompt-len.")] = 0,
    prefix_groups: Annotated[int, typer.Option("--prefix-groups", min=1, help="Load test: how many different shared prefixes (each request takes one at random).")] = 1,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Load test: prompts from a JSONL file, a line {\"prompt\": ...}, {\"messages\": [...]} (sent as chats) or a string.")] = None,
    slo_ttft_ms: Annotated[Optional[float], typer.Option("--slo-ttft-ms", min=0.0, help="Load test: goodput counts the requests whose time to first token is within this.")] = None,
    slo_itl_ms: Annotated[Optional[float], typer.Option("--slo-itl-ms", min=0.0, help="Load test: goodput counts the requests whose mean time between tokens is within this.")] = None,
    gpu_hourly_cost: Annotated[Optional[float], typer.Option("--gpu-hourly-cost", min=0.0, help="Load test: USD an hour of the server's GPUs; adds dollars per million output tokens.")] = None,
    served_model: Annotated[Optional[str], typer.Option("--model", help="Load test: the model name to send (default: the server's first in /v1/models).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Load test: the server's API key (default: LLAMACTL_API_KEY).")] = None,
    request_json: Annotated[Optional[str], typer.Option("--request-json", help="Load test: more fields of every request's body, a JSON object or a file holding one (for example {\"response_format\": {\"type\": \"json_object\"}}).")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option("--kv-dtype", help="What the KV cache stores: auto (the model's dtype), bf16, fp16, fp8 (e4m3; GPUs with FP8) or int8 (8 bits and a scale per position and head); a comma list such as auto,int8 times each in one run, and --quality adds the KL each 8-bit cache adds [default: auto].", show_default=False)] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Also speculative decoding at batch 1, against plain decoding in the same run: ngram, a model folder with the same tokenizer, or self-int4 / self-int8 (a folder's copy made at start; random weights: the shape's quantized weights); greedy, on the evaluation text's first --prompt-len tokens.")] = None,
    speculate: Annotated[int, typer.Option("--speculate", min=1, max=16, help="With --draft: the most proposals one verify step checks.")] = 4,
    tp: TpOpt = 1,
):
    """Speed, memory and quality of one or more models, as tables or JSON; with --url, a load test of a server."""
    from llamactl.bench import report

    if fmt not in ("table", "json", "csv", "markdown"):
        raise typer.BadParameter(f"--format {fmt!r}: use table, json, csv or markdown")
    if url or serve_model:
        if url and serve_model:
            raise typer.BadParameter("--url and --serve: give one (--serve starts its own server)")
        if len(prompt_len) != 1 or len(gen_len) != 1:
            raise typer.BadParameter("a load test takes one --prompt-len and one --gen-len (or ranges LO:HI)")
        from llamactl.bench import loadtest
        from llamactl.options import api_key as key_from_env

        (p_lo, p_hi), (g_lo, g_hi) = prompt_len[0], gen_len[0]
        load = loadtest.Load(url=url or "", concurrency=concurrency, requests=requests, prompt_len=p_lo,
                             gen_len=g_lo, prompt_max=p_hi, gen_max=g_hi, shared_prefix=shared_prefix,
                             prefix_groups=prefix_groups, dataset=dataset, slo_ttft_ms=slo_ttft_ms,
                             slo_itl_ms=slo_itl_ms, gpu_hourly_cost=gpu_hourly_cost, rate=rate,
                             ramp_up_s=ramp_up, model=served_model, api_key=api_key or key_from_env(),
                             extra=loadtest.read_extra(request_json) if request_json else None)
        if dataset:
            loadtest.read_dataset(dataset)  # a bad file fails before a server starts
        _load_test(load, serve_model, synthetic, synthetic_quant, device, dtype, serve_mode(mode), fmt, output)
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
    if any(hi != lo for lo, hi in prompt_len + gen_len):
        raise typer.BadParameter("length ranges (LO:HI) are for load tests (--url, --serve)")
    if len(gen_len) != 1:
        raise typer.BadParameter("--gen-len: one value")
    prompt_len, gen_len = [lo for lo, _ in prompt_len], gen_len[0][0]
    from llamactl.bench import trials as core  # torch: only for measuring
    from llamactl.bench import targets as bt
    from llamactl.runtime.load import resolve_device

    if tp > 1 and (quality or stages or tune or profile or len(models or []) > 1):
        raise InputError("--tp times one model's decode", "drop --quality, --stages, --tune, --profile and extra models")
    world = tensor_parallel(tp, (models or [None])[0], device, False, synthetic, synthetic_quant)
    trial = core.Trial(prompt_lens=prompt_len, gen_len=gen_len, batches=batch, warmup=warmup, repeat=repeat)
    dev = resolve_device(device) if world is None else rank_device(device)
    options = runtime_options(pins_file=pins_file)
    if tune:
        if dev.type != "cuda":
            raise InputError("--tune times the GPU kernels' configs: it needs a CUDA device", "run it on the GPU")
        options = options.replace(pins=False)
    modes = [m for m in mode.split(",") if m]
    if modes == ["auto"]:
        modes = ["graphs"] if dev.type == "cuda" else ["eager"]
    if stages:
        modes = ["eager", "graphs", "compile"]
    bad = [m for m in modes if m not in ("eager", "graphs", "compile", "aot")]
    if bad:
        raise typer.BadParameter(f"--mode {','.join(bad)}: use eager, graphs, compile or aot")
    on_off = {"on": True, "off": False}
    kernel_list = comma_choices("--kernels", kernels, on_off, "on, off or on,off")
    pdl_list = comma_choices("--pdl", pdl, on_off, "on, off or off,on")
    inputs_list = comma_choices("--quant-inputs", quant_inputs, {k: k for k in QUANT_INPUTS},
                                 f"{', '.join(QUANT_INPUTS)} or a comma list of them")
    kv_list = comma_choices("--kv-dtype", kv_dtype, {k: k for k in KV_DTYPES}, f"{', '.join(KV_DTYPES)} or a comma list of them")
    if output:
        from llamactl.folder.artifact import check_writable_file

        check_writable_file(Path(output), "--output")
    if profile and Path(profile).exists() and not Path(profile).is_dir():
        raise InputError(f"--profile {profile} is a file, not a folder", "name a folder for the traces (made if missing)")
    if quality and eval_tokens > 0:
        from llamactl.quality import check_eval_file

        check_eval_file(eval_file)
    if world and draft is not None:
        raise InputError("--draft runs generate's loop on one process", "drop --tp")
    if world and "compile" in modes:
        raise InputError("--mode compile with --tp is not supported yet", "use --mode graphs or eager")
    targets = bt.load_targets(models or [], synthetic, dev, dtype, synthetic_quant,
                              ui.warn if "compile" in modes else None, options, trust_cache, world)
    dt = targets[0].model.dtype
    hf = bt.hf_stages(targets[0], dev, dt) if stages else []
    ui.log(f"benchmarking {len(targets)} model(s) on {dev} ({str(dt).replace('torch.', '')})")
    busy = busy_cpu() if dev.type == "cpu" else None
    if busy:
        ui.warn(f"the machine is busy ({busy}): the copy bandwidth, and so each row's fraction of the ceiling, "
                "will read low; compare rows of this run only")
    runs = sum(len(core.variants(modes, kernel_list, pdl_list, dev, inputs_list, core.is_quantized(t.model), kv=kv_list))
               for t in targets)
    total = len(trial.batches) * len(trial.prompt_lens) * (len(hf) + runs)
    with ui.progress("bench", total) as advance:
        def measured(row: dict) -> None:
            ui.log(report.row_line(row), markup=False)
            advance(1)

        try:
            def so_far(partial: dict) -> None:  # -o holds every finished row, whatever stops the run
                if output and not (world and world.rank):
                    _write_result(partial, fmt, output)

            result = core.run(targets, trial, modes, hf, dev, dt, on_result=measured,
                              profile_dir=Path(profile) if profile else None, kernels=kernel_list, pdl=pdl_list,
                              inputs=inputs_list, options=options, warn=ui.warn, on_partial=so_far, kv=kv_list)
        except KeyboardInterrupt as e:  # stopped: the finished rows are not lost
            partial = getattr(e, "partial", None)
            if output and partial and partial["results"] and not (world and world.rank):
                _emit_result(partial, fmt, output, "interrupted")
                ui.warn(f"stopped after {len(partial['results'])} of {total} rows (the file is marked interrupted)")
                e.written = output
            raise
    if tune:
        from llamactl.bench.tune import write_pins

        n = write_pins(Path(tune), dev, " ".join(["llamactl", "bench", *sys.argv[2:]]))
        ui.log(f"wrote {n} pinned configs to {tune} (run them with --pins-file {tune}, or copy them into "
               "llamactl/kernels/configs/ for this GPU)")
    if draft is not None:
        from llamactl.bench import speculation

        for t in targets:
            for row in speculation.measure(t, draft, speculate, trial, options, ui.log):
                ui.log(report.row_line(row), markup=False)
                result["results"].append(row)
    if quality:
        bt.add_quality(result["results"], targets, reference, eval_file, eval_tokens, dev, ui.progress, options,
                       [k for k in kv_list if k in ("int8", "fp8")])
    report.add_speedups(result["results"])
    env = result["env"]
    if world and world.rank:
        return  # rank 0 reports for the group
    _emit_result(result, fmt, output,
                 f"{env['device_name']} | torch {env['torch']} | copy {env['copy_bandwidth_gbs']} GB/s")
    failed = [r for r in result["results"] if r.get("failed")]
    if failed:
        raise InputError(f"{len(failed)} of {len(result['results'])} rows failed (the others are measured"
                         f"{' and in ' + output if output else ''}): {failed[0]['stage']}: {failed[0]['skipped']}",
                         "see each failed row's reason in the table")


def _write_result(result: dict, fmt: str, output: str) -> None:
    """A bench result in --format to -o's file (atomically)."""
    from llamactl.bench import report
    from llamactl.folder.artifact import atomic_write_text

    text = {"json": report.to_json, "csv": report.to_csv, "markdown": report.to_markdown}.get(fmt)
    atomic_write_text(Path(output), (text or report.to_markdown)(result))


def _emit_result(result: dict, fmt: str, output: str | None, title: str) -> None:
    """A bench result on stdout in --format (a table titled `title`), and in -o's file too."""
    from llamactl.bench import report

    text = {"json": report.to_json, "csv": report.to_csv, "markdown": report.to_markdown}.get(fmt)
    if output:
        _write_result(result, fmt, output)
    if text:
        ui.emit_text(text(result))
    else:
        headers, body = report.rows(result["results"])
        ui.table(title, headers, body)


def _load_test(load, serve_model: str | None, synthetic: str | None, synthetic_quant: str | None, device: str,
               dtype: str, mode: str | None, fmt: str, output: str | None) -> None:
    """bench --url / --serve: run the load test (starting and stopping a server for --serve)."""
    from llamactl.bench import loadtest, report
    from llamactl.serve.run import check_libraries

    loadtest.check_client()
    if serve_model:
        check_libraries()
    if output:
        from llamactl.folder.artifact import check_writable_file

        check_writable_file(Path(output), "--output")
    with ui.progress("load test", len(load.concurrency)) as advance:
        def measured(row: dict) -> None:
            ui.log(report.row_line(row), markup=False)
            advance(1)

        if serve_model:
            from llamactl.serve.spawn import spawned

            room = 2 * (load.shared_prefix + (load.prompt_max or load.prompt_len)) + (load.gen_max or load.gen_len)
            room = 4096 if load.dataset else room  # a word may be more than one token
            with spawned(serve_model, max(load.concurrency), room, device, dtype, synthetic, synthetic_quant,
                         load.api_key, ui.log, mode) as url:
                load.url = url
                result = loadtest.run(load, measured)
        else:
            result = loadtest.run(load, measured)
    _emit_result(result, fmt, output, f"load test of {result['env']['url']}")
