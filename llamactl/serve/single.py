"""One prompt through the serving engine on the calling thread: `generate --draft` (and its tests)
decode this way, so that speculative decoding is written once, in the engine (serve.engine:
prompt lookup, or a draft model whose K/V share the target's KV blocks)."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from llamactl.errors import CheckpointError, InputError
from llamactl.layers.plan import Plan
from llamactl.options import RuntimeOptions
from llamactl.runtime import kv_format
from llamactl.runtime.generate import Result, Step, peak_memory_bytes
from llamactl.runtime.kv_cache import PagedCache
from llamactl.runtime.settings import Sampling
from llamactl.runtime.speculate import Tally
from llamactl.runtime.step import attention_backend, sync
from llamactl.runtime.textstream import TextStream
from llamactl.serve.engine import Engine, KvOptions
from llamactl.serve.plan import Params
from llamactl.serve.runner import BLOCK_SIZE


def speculative_generate(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                         stop_ids: set[int], ignore_eos: bool, options: RuntimeOptions | None,
                         draft: "str | torch.nn.Module", speculate: int) -> Iterator[Plan | Step | Result]:
    """runtime.generate.generate's events (the Plan, Steps, one Result) for one prompt decoded by
    an engine of one row that speculates on every step: draft "ngram" (prompt lookup) or a draft
    model with the same tokenizer, up to `speculate` proposals a verify step. Greedy output is
    plain decoding's; sampled output is distributed as plain sampling's (the engine's per-row
    draws: a seed gives other tokens than generate's own loop)."""
    ctx = model.args.max_position_embeddings
    n = len(prompt_ids)
    if n == 0:
        raise InputError("the prompt is empty after tokenization", "pass some text with --prompt")
    if n >= ctx:
        raise InputError(f"the prompt has {n} tokens; the model's context is {ctx}", "shorten the prompt")
    max_new_tokens = min(max_new_tokens, ctx - n)
    drafter = None if draft == "ngram" else draft
    fmt = kv_format.resolve((options or RuntimeOptions()).kv_dtype, model.dtype, model.device)
    per = PagedCache.block_bytes(model, BLOCK_SIZE, fmt) + (PagedCache.block_bytes(drafter, BLOCK_SIZE) if drafter else 0)
    blocks = -(-(n + max_new_tokens) // BLOCK_SIZE) + 1  # a block to spare for the rounding of the memory
    eng = Engine(model, set() if ignore_eos else stop_ids, max_batch=1, max_queue=1, max_seq=n + max_new_tokens,
                 options=options, kv=KvOptions(memory_gib=blocks * per / 2**30, prefix_cache=False),
                 gather_s=0.0, speculate=(speculate, 1), draft=drafter)
    yield eng.decoder.plan
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    events, out, stream = [], [], TextStream(tokenizer)
    sync(device)
    t0 = time.perf_counter()
    req = eng.submit(list(prompt_ids), Params(max_new_tokens, sampling, ignore_eos=ignore_eos), events.append)
    t_first, reason = None, "length"
    while not req.finished:
        eng.iterate()
        for ev in events:
            if ev.kind == "token":
                if t_first is None:  # the prompt's forward: a broken model is an error, not text
                    t_first = ev.time
                    if not bool(getattr(eng.decoder, "prefill_finite", True)):
                        raise CheckpointError("the model's logits hold NaN or Inf after the prompt: its weights are "
                                              "broken", "check the folder's weights, or re-create it")
                out.append(ev.token)
                yield Step(ev.token, stream.add(ev.token))
            elif ev.kind == "done":
                if ev.reason == "error":
                    raise RuntimeError(ev.error)
                reason = "eos" if ev.reason == "stop" else ev.reason
        events.clear()
    sync(device)
    t_end = time.perf_counter()
    tail = stream.finish()
    if tail:
        yield Step(-1, tail)
    t = eng.times
    tally = Tally(t.verify_steps, t.spec_proposed, t.spec_accepted)
    ttft = (t_first or t_end) - t0
    made = len(out) - 1  # tokens after the first
    yield Result(
        text=tokenizer.decode(out, skip_special_tokens=True), token_ids=out, prompt_tokens=n, stop_reason=reason,
        ttft_s=ttft, prefill_tok_s=n / ttft if ttft > 0 else 0.0, compile_s=0.0,
        decode_tok_s=made / (t_end - t_first) if made > 0 and t_first and t_end > t_first else 0.0,
        peak_mem_bytes=peak_memory_bytes(device), device=str(device), dtype=str(model.dtype).replace("torch.", ""),
        extra={"mode": eng.mode, "attention_backend": attention_backend(model, 1, eng.max_seq, device),
               "gemv": eng.decoder.plan.label, "kv_dtype": eng.runner.cache.fmt.name, "plan": eng.decoder.plan.as_dict(),
               "speculation": {"draft": draft if isinstance(draft, str) else "model", "k": speculate,
                               **tally.as_dict(), "plain_steps": t.decode_steps}})
