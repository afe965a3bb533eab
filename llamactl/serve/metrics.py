"""The server's Prometheus metrics, in a registry of its own (not the process-wide default)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a few ms (an H200 decode step) to the tens of seconds a queued request may wait
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0)
_STEP = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        Gauge("llamactl_requests_running", "Requests in a slot of the batch (prefilling or decoding).",
              registry=r).set_function(lambda: engine.running)
        Gauge("llamactl_requests_waiting", "Requests queued for a free slot.", registry=r).set_function(
            lambda: engine.waiting)
        Gauge("llamactl_batch_slots", "Slots of the running batch (--max-batch).", registry=r).set(engine.max_batch)
        self.prompt_tokens = Counter("llamactl_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generated_tokens = Counter("llamactl_generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("llamactl_requests_finished", "Requests ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("llamactl_requests_rejected", "Requests answered with an error before running.",
                                ["status"], registry=r)
        self.ttft = Histogram("llamactl_time_to_first_token_seconds", "Arrival to the first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("llamactl_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_STEP, registry=r)
        for field, help_ in (("prefill_s", "Seconds in prefill forwards (each with its host read)."),
                             ("prefill_forwards", "Prefill forwards run."),
                             ("prefill_tokens", "Prompt tokens prefilled."),
                             ("prefill_max_s", "The slowest prefill forward, seconds."),
                             ("decode_s", "Seconds in decode steps (each with its host read)."),
                             ("decode_steps", "Decode steps run."),
                             ("decode_rows", "Tokens the decode steps gave to requests."),
                             ("mixed_rows", "Of those, tokens of rows that decoded in a prefill forward (a mixed step)."),
                             ("verify_s", "Seconds in speculative verify steps (each with its host read)."),
                             ("verify_steps", "Speculative verify steps run."),
                             ("spec_proposed", "Proposed tokens the verify steps checked."),
                             ("spec_accepted", "Of those, tokens kept (the acceptance rate: accepted / proposed)."),
                             ("emit_s", "Seconds handing tokens to callers on the engine's thread."),
                             ("read_wait_s", "Seconds the engine's thread waited for a launched step's tokens "
                                             "(the device still computing: the rest of its time is the host's)."),
                             ("grammar_s", "Seconds in grammars' matchers on the engine's thread (following "
                                           "tokens, making masks)."),
                             ("grammar_cpu_s", "Of those, the engine thread's CPU seconds (the rest: waiting "
                                               "for the GIL, and for the mask fill's threads)."),
                             ("masked_steps", "Decode steps launched in two parts for grammars' rows (forward, "
                                              "then the draw once the masks are made)."),
                             ("masked_host_s", "Their host part, seconds: from the forward's launch to the draw's."),
                             ("gather_s", "Seconds waiting, from idle, for a burst's other requests."),
                             ("preemptions", "Requests whose KV blocks were taken back mid-generation (recomputed)."),
                             ("kernel_first_uses", "Kernel variants compiled or loaded after the warm-up (a step "
                                                   "waited for each: a shape the warm-up did not run).")):
            name = "llamactl_engine_" + field.removesuffix("_s") + ("_seconds" if field.endswith("_s") else "")
            Gauge(name, help_, registry=r).set_function(lambda f=field: getattr(engine.times, f))
        pool, cache = engine.scheduler.pool, engine.runner.cache
        Gauge("llamactl_kv_cache_tokens", "Positions the KV pool holds, by what it stores (--kv-dtype).", ["dtype"],
              registry=r).labels(cache.fmt.name).set(cache.tokens)
        Gauge("llamactl_kv_cache_bytes", "Bytes of the KV pool (an 8-bit cache's scales included).",
              registry=r).set(cache.nbytes)
        for name, help_, fn in (
                ("llamactl_kv_blocks_total", "KV blocks of the pool (each --block-size positions).", lambda: pool.blocks - 1),
                ("llamactl_kv_blocks_used", "KV blocks held by running requests.", lambda: pool.used),
                ("llamactl_kv_blocks_free", "KV blocks free or cached and unreferenced.", lambda: pool.available),
                ("llamactl_kv_blocks_cached", "KV blocks named by a prefix (held or idle).", lambda: pool.cached),
                ("llamactl_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                 lambda: pool.queried_tokens),
                ("llamactl_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not computed).",
                 lambda: pool.hit_tokens),
                ("llamactl_kv_blocks_evicted", "Cached blocks whose prefix was dropped for new ones.", lambda: pool.evicted)):
            Gauge(name, help_, registry=r).set_function(fn)
        # /metrics is answered on the event loop's thread, so this is that thread's CPU: parsing,
        # routing, detokenizing and writing every request's events (the engine's thread is apart)
        Gauge("llamactl_http_thread_cpu_seconds", "CPU seconds of the thread serving HTTP (uvicorn's event loop).",
              registry=r).set_function(time.thread_time)
        Gauge("llamactl_engine_thread_cpu_seconds", "CPU seconds of the engine's thread (its step loop).",
              registry=r).set_function(engine.thread_cpu_s)
        self.e2e = Histogram("llamactl_request_latency_seconds", "Arrival to the last token.", buckets=_LATENCY,
                             registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
