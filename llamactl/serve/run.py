"""`llamactl serve` from start to stop: load, build the engine and the app, bind, serve."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from llamactl.errors import InputError
from llamactl.folder.artifact import open_artifact, resolve_model_path
from llamactl.options import RuntimeOptions
from llamactl.runtime import chat
from llamactl.serve.protocol import MAX_BODY
from llamactl.serve.server import bind, http_stack, serve as serve_app


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int | None = None  # None: DEFAULT_MAX_BATCH on a GPU, CPU_MAX_BATCH on the CPU
    max_queue: int = 64
    max_seq: int | None = None  # None: the model's context, at most DEFAULT_MAX_SEQ
    prefill_chunk: int | None = None  # None: the engine's default for the device
    gather_ms: float | None = None  # None: the engine's default for the device (Engine._gather)
    drain_s: float = 30.0
    api_key: str | None = None
    model_name: str | None = None  # None: the model folder's name
    mode: str | None = None  # the decode step (decode.MODES); None: graphs on CUDA, eager on the CPU
    prefill_graphs: bool = True  # short prefills replay CUDA graphs where the steps do
    kv_memory_gib: float | None = None  # the KV pool; None: gpu_memory_fraction of the card
    gpu_memory_fraction: float | None = None  # None: runner.GPU_MEMORY_FRACTION
    block_size: int = 16
    prefix_cache: bool = True
    mixed_steps: bool = True  # on a GPU, decode rows ride in the prefill forwards (scheduler.mix)
    draft: str | None = None  # speculative decoding: "ngram" (prompt lookup), a folder, self-int4/8; None: off
    speculate: int = 4  # proposals a row checks in one step, at most
    speculate_rows: int = 8  # speculation while at most this many rows run
    chat_template: str | None = None  # a built-in's name or a Jinja file (runtime.chat); None: the model's
    max_request_bytes: int = MAX_BODY


DEFAULT_MAX_SEQ = 4096  # positions a sequence may reach by default
# running sequences at most: on a GPU high enough that the KV memory decides, not the cap; on the
# CPU a step of many rows takes long
DEFAULT_MAX_BATCH, CPU_MAX_BATCH = 256, 8
# The engine's thread and the event loop share the GIL: with Python's default 5 ms switch interval a
# step waits for the loop's SSE work up to 5 ms. 0.5 ms gave 839 against 713 output tok/s at 8
# streams and 1,650 against 1,281 at 32 on an H200 (docs/bench/README.md).
GIL_SWITCH_S = 5e-4


def check_libraries() -> None:
    """InputError naming the missing package when the serving libraries are not installed."""
    from importlib.util import find_spec

    missing = [name for name, mod in (("starlette", "starlette"), ("uvicorn", "uvicorn"),
                                      ("prometheus-client", "prometheus_client")) if find_spec(mod) is None]
    if missing:
        raise InputError(f"serving needs {', '.join(missing)}, which is not installed",
                         "pip install 'llamactl[serve]'")


def _synthetic(shape: str, quant: str | None, device: str, dtype: str, options: RuntimeOptions, world=None):
    """(name, model, tokenizer, eos ids, device) for random weights of a named shape: the embedded
    model's tokenizer writes the prompts (its ids fit every shape's vocabulary), no EOS."""
    from llamactl.folder.checkpoint import load_tokenizer
    from llamactl.layers.plan import linear_kernels
    from llamactl.runtime.load import resolve_device
    from llamactl.runtime.synthetic import synthetic_dtype, synthetic_model

    dev = resolve_device(device) if world is None else _rank_device(device)
    kernels = linear_kernels(dev, options)
    label, model = synthetic_model(shape, quant or "none", dev, synthetic_dtype(dtype, dev, kernels), kernels, world)
    tok = load_tokenizer(open_artifact(resolve_model_path(None)))
    return label.replace(":", "-").replace(" ", "-"), model, tok, set(), dev


def _rank_device(device: str):
    import torch

    from llamactl.runtime.load import resolve_device

    dev = resolve_device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev


def _warm_up(engine) -> None:
    """Capture (and with --mode compile, compile) every batch bucket's step before serving; a
    failed compile is one line that names the way out."""
    import torch

    try:
        engine.warm_up()
    except torch.OutOfMemoryError as e:
        raise InputError("the GPU ran out of memory while the server warmed up (its CUDA graphs and largest forward "
                         "beside the KV cache)", "pass a smaller --kv-memory, a lower --gpu-memory-fraction or a "
                         "smaller --max-batch") from e
    except Exception as e:
        if engine.mode != "compile":
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise InputError(f"torch.compile of the decode step failed ({type(e).__name__}: {first})",
                         "serve with --mode graphs, the default on CUDA") from e


def _watch_first_uses(engine, log: Callable[[str], None]) -> None:
    """Count (engine.times, /metrics) each kernel variant first used after the warm-up, and name each
    kernel the first time: a step waited for its compile."""
    from llamactl.kernels.compiles import watch

    named: set[str] = set()

    def first_use(name: str, variant: str) -> None:
        engine.times.kernel_first_uses += 1
        if name not in named:
            named.add(name)
            log(f"note: kernel {name} compiled while serving (the warm-up did not run this variant; the step "
                f"waited for it): {variant}")

    watch(first_use)


def run(model: str | None, device: str, dtype: str, allow_pickle: bool, options: RuntimeOptions,
        serve: ServeOptions, log: Callable[[str], None], warn: Callable[[str], None],
        synthetic: str | None = None, synthetic_quant: str | None = None, world=None) -> tuple[str | None, int]:
    """Serve until SIGTERM or Ctrl-C; returns the signal's name and how many streams were cut when
    the drain time ended (serve.server.serve). synthetic: random weights of
    that shape instead of `model` (load tests). world: tensor parallelism (tp.World): rank 0
    serves HTTP and schedules; the other ranks load their shards and follow its steps."""
    check_libraries()  # before anything that imports them: a missing package is one line
    from llamactl.runtime.generate import eos_ids
    from llamactl.runtime.load import load
    from llamactl.serve.api import Service, build_app
    from llamactl.serve.engine import Engine

    leader = world is None or world.rank == 0
    sock = bind(serve.host, serve.port) if leader else None  # before loading: a busy port fails at once
    sys.setswitchinterval(GIL_SWITCH_S)  # this process serves and nothing else
    engine = None
    try:
        if synthetic:
            label, m, tok, eos, dev = _synthetic(synthetic, synthetic_quant, device, dtype, options, world)
        else:
            art, m, tok, dev = load(model, device, dtype, allow_pickle, options, world=world)
            label, eos = art.path.name, eos_ids(m, tok, art)
        ctx = m.args.max_position_embeddings
        if serve.max_seq is not None and serve.max_seq > ctx:
            raise InputError(f"--max-seq {serve.max_seq} is longer than the model's context ({ctx})",
                             f"use --max-seq {ctx} or less")
        from llamactl.serve.engine import KvOptions

        drafter = None
        if serve.draft not in (None, "ngram"):
            from llamactl.quantize.draft import load_draft

            drafter = load_draft(serve.draft, None if synthetic else art.path, tok, m, allow_pickle, options, log)

        kv = KvOptions(serve.kv_memory_gib, serve.gpu_memory_fraction, serve.block_size, serve.prefix_cache)
        max_batch = serve.max_batch or (DEFAULT_MAX_BATCH if m.device.type == "cuda" else CPU_MAX_BATCH)
        engine = Engine(m, eos, max_batch, serve.max_queue,
                        serve.max_seq or min(ctx, DEFAULT_MAX_SEQ), serve.mode, options, serve.prefill_chunk, world,
                        gather_s=None if serve.gather_ms is None else serve.gather_ms / 1000,
                        prefill_graphs=serve.prefill_graphs, kv=kv, mix=None if serve.mixed_steps else False,
                        speculate=(serve.speculate, serve.speculate_rows) if serve.draft else (0, 0), draft=drafter)
        for w in engine.decoder.plan.warnings:
            warn(w)
        if leader:
            log(f"warming up: {engine.warm_up_plan()}")
        started = time.perf_counter()
        _warm_up(engine)
        warm_s = time.perf_counter() - started
        for (rows, width), why in engine.decoder.verify_failed.items():
            warn(f"verify steps of {rows} rows x {width} tokens run eagerly: their CUDA graph failed ({why})")
        if leader and m.device.type == "cuda":
            _watch_first_uses(engine, log)
        if not leader:
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then says stop
            engine.follow()
            return "rank 0 stopped", 0
        name = serve.model_name or label
        template = chat.apply(tok, serve.chat_template)
        app = build_app(Service(engine, tok, name, m.args.vocab_size, serve.api_key, serve.max_request_bytes))
        cache = engine.runner.cache

        def ready(url: str) -> None:
            from llamactl.ui import human_bytes

            tp = f", tensor-parallel over {world.size} ({world.backend})" if world else ""
            graphs = engine.decoder.prefill_graphs
            prefills = f", {graphs.summary()}" if graphs is not None else ""
            log(f"serving {name} on {url} ({dev}{tp}, {str(m.dtype).replace('torch.', '')}, {engine.mode}{prefills}, gemv "
                f"{engine.decoder.plan.label}): KV cache {human_bytes(cache.nbytes)} {cache.fmt.name}, {cache.blocks - 1} blocks of "
                f"{cache.block_size} ({cache.tokens} tokens: {cache.tokens // engine.max_seq} sequences of "
                f"--max-seq {engine.max_seq}), prefix cache {'on' if serve.prefix_cache else 'off'}; up to "
                f"{engine.max_batch} running, queue {serve.max_queue}, chat template {template or 'none'}, HTTP {' on '.join(http_stack())}, "
                f"warmed up in {warm_s:.0f} s" + (", API key required" if serve.api_key else ""))

        stopped_by = serve_app(app, sock, serve.drain_s, ready, engine.run, engine.stop,
                               lambda: engine.running + engine.waiting)
    finally:
        if sock is not None:
            sock.close()
        if engine is not None and leader:
            engine.stop()
            engine.stop_followers()
    return stopped_by
