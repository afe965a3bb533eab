"""Decoding loop over the runtime's static KV cache. Yields steps; never prints."""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from llamactl.errors import CheckpointError, InputError
from llamactl.layers.plan import Plan
from llamactl.options import RuntimeOptions
from llamactl.runtime.settings import Sampling
from llamactl.runtime.speculate import ModelDraft, NgramDraft, Tally, keep
from llamactl.runtime.step import Decoder, attention_backend, sync
from llamactl.runtime.textstream import TextStream


@dataclass
class Step:
    """One generated token and the text it completed (may be empty mid-character)."""

    token_id: int
    text: str


@dataclass
class Result:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    stop_reason: str  # "eos" or "length"
    ttft_s: float
    prefill_tok_s: float
    compile_s: float  # compiling and warming the decode step (mode compile), outside TTFT and decode tok/s
    decode_tok_s: float
    peak_mem_bytes: int
    device: str
    dtype: str
    extra: dict = field(default_factory=dict)


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, V] -> next token ids [B]. Greedy when temperature is 0.

    Sampling uses the Gumbel-max trick (argmax of logits/T plus Gumbel noise draws exactly from
    softmax(logits/T)), with fixed shapes and no host synchronisation, so it can run inside a CUDA
    graph. Without a generator it draws from the default one (seeded by torch.manual_seed), which
    is the one CUDA graphs know how to advance between replays.
    """
    if s.greedy:
        return logits.argmax(dim=-1)
    logits = shaped(logits, s)
    u = torch.rand(logits.shape, device=logits.device, generator=generator).clamp_(min=1e-20, max=1 - 1e-7)
    return (logits - torch.log(-torch.log(u))).argmax(dim=-1)


def shaped(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [B, V] as the sampler draws from them (float, over temperature, top-k and top-p cut to
    -inf): their softmax is the distribution a token is drawn from. temperature > 0."""
    logits = logits.float() / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > s.top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024



def encode_prompt(tokenizer, prompt: str, chat: bool) -> tuple[list[int], bool]:
    """Token ids for the prompt; with chat, through the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        except Exception as e:  # a template is a program of the folder's: it can fail any way
            raise InputError(f"the tokenizer's chat template failed ({type(e).__name__}: {str(e)[:160]})",
                             "fix chat_template in tokenizer_config.json, or run without --chat")
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids), True
    return tokenizer(prompt).input_ids, False


def eos_ids(model, tokenizer, art=None) -> set[int]:
    ids = set(model.args.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if art is not None and (art.path / "generation_config.json").is_file():
        import json

        eos = json.loads((art.path / "generation_config.json").read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    return ids


class _TokenReader:
    """Reads a device token [1] on the host without waiting for work queued after it: on CUDA the
    copy goes to pinned memory and an event marks its end; elsewhere it is a plain read."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = torch.empty(1, dtype=torch.long, pin_memory=self.cuda)
        self.done = torch.cuda.Event() if self.cuda else None
        self.token: torch.Tensor | None = None

    def queue(self, token: torch.Tensor) -> None:
        self.host.copy_(token.view(-1)[:1], non_blocking=self.cuda)  # ordered before later steps on the stream
        if self.cuda:
            self.done.record()

    def wait(self) -> int:
        if self.cuda:
            self.done.synchronize()
        return int(self.host[0])


@torch.inference_mode()
def generate(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
             stop_ids: set[int] | None = None, ignore_eos: bool = False, mode: str | None = None,
             buckets: list[int] | None = None, options: RuntimeOptions | None = None,
             draft: "str | torch.nn.Module | None" = None, speculate: int = 4) -> Iterator[Plan | Step | Result]:
    """Prefill the prompt, then decode one token per step; yields the Plan of what runs, Steps,
    then one Result.

    mode: a Decoder mode (eager, graphs, compile); None picks graphs on CUDA for greedy decoding,
    eager otherwise. options: the runtime's choices (RuntimeOptions()'s defaults when None).
    draft: speculative decoding with proposals from prompt lookup ("ngram") or a draft model (a
    LlamaModel with the same tokenizer), checking up to `speculate` a step (eager verify steps;
    Result.extra["speculation"] says what it did).
    Raises InputError when the prompt and new tokens do not fit the context.
    """

    ctx = model.args.max_position_embeddings
    n = len(prompt_ids)
    if n == 0:
        raise InputError("the prompt is empty after tokenization", "pass some text with --prompt")
    if n >= ctx:
        raise InputError(f"the prompt has {n} tokens; the model's context is {ctx}", "shorten the prompt")
    max_new_tokens = min(max_new_tokens, ctx - n)
    device = model.device
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)  # seeds the CPU and every CUDA device's default generator
    if mode is None:
        mode = "graphs" if device.type == "cuda" else "eager"
    sampler = None if sampling.greedy else (lambda logits: sample(logits, sampling))
    dec = Decoder(model, 1, n + max_new_tokens, mode, sample=sampler, buckets=buckets, options=options)
    yield dec.plan
    stop_ids = set() if ignore_eos else (stop_ids or set())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    out: list[int] = []
    stream = TextStream(tokenizer)
    sync(device)
    t0 = time.perf_counter()
    token = dec.prefill(torch.tensor([prompt_ids], device=device))  # [1]
    sync(device)
    if not bool(dec.prefill_finite):  # a broken model is an error, not text
        raise CheckpointError("the model's logits hold NaN or Inf after the prompt: its weights are broken",
                              "check the folder's weights, or re-create it")
    t_first = t_prefilled = time.perf_counter()
    compile_s = 0.0
    if mode in ("compile", "aot") and max_new_tokens > 1:
        # compile (or load) the step now, so that decode tok/s counts decoding only; the warm-up
        # writes position n's K/V as the first real step does, and the random state is put back
        rng = torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
        dec.step(token, n)
        sync(device)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        compile_s = time.perf_counter() - t_first
        t_first = time.perf_counter()
    stop_reason = "length"
    steps = 0  # decode steps whose token was read (the EOS one included)
    reader = _TokenReader(device)
    tally = None
    if draft is not None:
        drafter = NgramDraft() if draft == "ngram" else ModelDraft(draft, dec.max_seq, mode if mode != "aot" else "eager")
        stop_reason, steps, tally = yield from _speculative(dec, drafter, prompt_ids, int(token.view(-1)[0]),
                                                            max_new_tokens, stop_ids, stream, out, sampling, speculate)
    while draft is None:
        # Queue the read of this token, then the step that makes the next one, then wait for the
        # read only: detokenizing and printing overlap the device's next step.
        reader.queue(token)
        ahead = dec.step(token, n + steps) if len(out) + 1 < max_new_tokens else None
        tid = reader.wait()
        if tid in stop_ids:
            stop_reason = "eos"
            break
        out.append(tid)
        yield Step(tid, stream.add(tid))
        if ahead is None:
            break
        token = ahead
        steps += 1
    sync(device)
    t_end = time.perf_counter()
    tail = stream.finish()
    if tail:
        yield Step(-1, tail)
    final = tokenizer.decode(out, skip_special_tokens=True)
    ttft = t_prefilled - t0
    yield Result(
        text=final,
        token_ids=out,
        prompt_tokens=n,
        stop_reason=stop_reason,
        ttft_s=ttft,
        prefill_tok_s=n / ttft if ttft > 0 else 0.0,
        compile_s=compile_s,
        decode_tok_s=steps / (t_end - t_first) if steps and t_end > t_first else 0.0,
        peak_mem_bytes=peak_memory_bytes(device),
        device=str(device),
        dtype=str(model.dtype).replace("torch.", ""),
        extra={"mode": mode, "attention_backend": attention_backend(model, 1, dec.max_seq, device), "gemv": dec.plan.label,
               "kv_dtype": dec.cache.fmt.name,
               "plan": dec.plan.as_dict(),
               **({"speculation": {"draft": draft if isinstance(draft, str) else "model", "k": speculate,
                                   **tally.as_dict()}} if tally else {}),
               **({"aot_cache": "loaded" if dec.aot_cached else "built"} if dec.aot_cached is not None else {})},
    )


def _speculative(dec, drafter, prompt_ids: list[int], first: int, max_new_tokens: int, stop_ids: set[int], stream,
                 out: list[int], sampling: Sampling, k: int):
    """generate's loop with speculative decoding (runtime.speculate): each verify step checks the
    drafter's proposals after the last token, and hands out the tokens it keeps. Yields Steps
    (appending to `out`); returns (stop reason, tokens made after the first, Tally)."""
    tally = Tally()
    drafter.extend(list(prompt_ids))
    last, pos, new = first, len(prompt_ids), [first]  # `last` sits at pos, its K/V not computed yet
    while True:
        for t in new:
            if t in stop_ids:
                return "eos", tally.accepted + tally.verify_steps, tally
            out.append(t)
            drafter.extend([t])
            yield Step(t, stream.add(t))
            if len(out) >= max_new_tokens:
                return "length", tally.accepted + tally.verify_steps, tally
        proposal = drafter.propose(min(k, max_new_tokens - len(out) - 1))
        logits = dec.verify([last] + proposal, pos)  # [1 + len(proposal), V]
        new = keep(proposal, sample(logits, sampling).tolist())
        tally.verify_steps += 1
        tally.proposed += len(proposal)
        tally.accepted += len(new) - 1
        pos += len(new)
        last = new[-1]
