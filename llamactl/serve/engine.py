"""The serving engine: one thread runs the step loop over a scheduler (serve.scheduler: which
requests, which tokens) and a runner (serve.runner: the model calls), and hands tokens out.

Requests wait in a bounded first-come queue and join the running batch at a step boundary: a free
row of the cache takes the prompt, prefilled in chunks (at most `prefill_chunk` prompt tokens an
iteration while other rows decode, so a long prompt delays them by one chunk a step). Every row
then decodes at its own position with its own sampling settings (llamactl.runtime.sampling.RowSampling),
so a request's tokens do not depend on the other rows. A request leaves at EOS, at its token
limit, or when cancelled (a stop string its caller found, a client gone), freeing its row.

On a GPU the loop runs one step ahead of its host work (`overlap`): it launches step N+1, whose
input tokens are step N's outputs already on the device, before it reads step N's tokens and hands
them out, so the scheduling, the callbacks and the HTTP side's work run while the device computes.
What the host cannot know at launch is a row's EOS (or a cancel): such a row is computed one step
more, and that token is dropped. Positions and token counts are known ahead, so no row ever runs
past its token limit.

No tokenizer here: callers tokenize and detokenize on their own threads. Events go back through
each request's `on_event`, called on the engine's thread.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from llamactl.errors import InputError
from llamactl.options import RuntimeOptions
from llamactl.runtime import kv_format
from llamactl.runtime.speculate import NgramDraft, keep
from llamactl.serve.blocks import BlockPool
from llamactl.serve.runner import BLOCK_SIZE, GPU_MEMORY_FRACTION, PROBE_BLOCKS, Runner, blocks_left, kv_blocks
from llamactl.serve.plan import Event, Params, Request
from llamactl.serve.scheduler import (BATCH_PREFILL_TOKENS, EngineTimes, QueueFull, Rejected,  # noqa: F401
                                      Scheduler)
from llamactl.runtime.tp import smallest
from llamactl.serve.grammar import Matcher
from llamactl.serve.staging import Launched

# Prompt tokens prefilled a step while others decode, by default: a 2,048-token chunk costs the
# running streams one longer step on a GPU and gave 32 streams more throughput than 512
# (docs/results.md); a CPU takes seconds for that many
PREFILL_CHUNK_GPU, PREFILL_CHUNK_CPU = 2048, 512
GATHER_GPU_S = 0.010  # the gather window from idle on a GPU (Scheduler._gather; docs/results.md)


@dataclass(frozen=True)
class KvOptions:
    """The KV pool: memory_gib of blocks, else gpu_fraction of the card (runner.kv_blocks);
    block_size positions a block; prefix_cache: reuse cached prefixes."""

    memory_gib: float | None = None
    gpu_fraction: float | None = None
    block_size: int = BLOCK_SIZE
    prefix_cache: bool = True


def measured_fraction(kv: KvOptions, gpu: bool, tensor_parallel: bool) -> float | None:
    """The fraction of the card a pool fills once warm_up has measured what the rest takes (one
    GPU and no --kv-memory: a probe pool until then), or None where the pool is sized up front
    (--kv-memory; the CPU; tensor parallelism, whose ranks agree on one size first)."""
    if not gpu or kv.memory_gib is not None or tensor_parallel:
        return None
    return kv.gpu_fraction or GPU_MEMORY_FRACTION


def _model_salt(model) -> bytes:
    """What tells one model's K/V from another's in block names: its shape and a few weights."""
    emb = model.model.embed_tokens
    w = emb.weight if hasattr(emb, "weight") else emb.qweight
    return repr((model.args, w.reshape(-1)[:16].float().cpu().tolist())).encode()


class Engine:
    """The step loop over one model. run() runs the loop on the calling thread, start() on a
    thread of its own; submit() from any thread; stop() ends it (requests still in it are
    cancelled).

    On a CPU the loop belongs on the thread that loaded the model: torch's CPU threads (an OpenMP
    team) belong to the thread that first ran a parallel op, and a second thread's team beside
    them made every op of a small model's step several times slower on 2 cores (the teams
    outnumber the cores). `llamactl serve` runs the loop on its main thread and the HTTP server on
    another."""

    def __init__(self, model, eos_ids: set[int], max_batch: int = 8, max_queue: int = 64,
                 max_seq: int | None = None, mode: str | None = None, options: RuntimeOptions | None = None,
                 prefill_chunk: int | None = None, world=None, overlap: bool | None = None,
                 gather_s: float | None = None, prefill_graphs: bool = True, kv: "KvOptions | None" = None,
                 mix: bool | None = None, speculate: tuple[int, int] = (0, 0), draft=None):
        """gather_s: from idle, wait this long after each arrival for the next (None: GATHER_GPU_S
        on a GPU, 0 on the CPU).
        overlap: launch each decode step before handing out the last one's tokens (None: on a
        GPU; on the CPU the step runs on this thread, so nothing would overlap).
        world: tensor parallelism (tp.World): rank 0's engine schedules, the other ranks' engines
        only follow() its runner's actions. kv: the KV pool's size and the prefix cache.
        mix: a step's decode rows go through its prefill forward (None: on a GPU; Scheduler.mix).
        speculate: (k, rows): while at most `rows` rows run and none is prefilling, each proposes
        up to k tokens, checked in one forward: by prompt lookup (runtime.speculate.NgramDraft),
        or where `draft` (a model with the target's tokenizer) is given, by its greedy decoding
        (runtime.speculate.PagedDraft; one process only)."""
        if draft is not None and world is not None:
            raise InputError("a draft model speculates on one process", "drop --tp, or pass --draft ngram")
        gpu = model.device.type == "cuda"
        ctx = model.args.max_position_embeddings
        self.device, self.max_batch = model.device, max_batch
        self.eos_ids = set(eos_ids)
        self.mode = mode or ("graphs" if gpu else "eager")
        kv = kv or KvOptions()
        max_seq = min(max_seq or ctx, ctx)
        chunk = prefill_chunk or (PREFILL_CHUNK_GPU if gpu else PREFILL_CHUNK_CPU)
        fmt = kv_format.resolve((options or RuntimeOptions()).kv_dtype, model.dtype, model.device)
        self._measure = measured_fraction(kv, gpu, world is not None)  # None: the pool sized here
        if self._measure is None:
            blocks = kv_blocks(model, max_batch, max_seq, kv.block_size, kv.memory_gib, kv.gpu_fraction,
                               max(chunk, BATCH_PREFILL_TOKENS), fmt, draft)
        else:
            blocks = PROBE_BLOCKS
        if world is not None:  # every rank holds the pool of the rank with the least memory
            blocks = smallest(blocks, world)

        def build(blocks: int) -> tuple[Runner, BlockPool]:
            runner = Runner(model, max_batch, max_seq, self.mode, options, world, prefill_graphs, blocks=blocks,
                            block_size=kv.block_size, fmt=fmt, draft=draft)
            # blocks are named by their tokens and the model (its shape and weights' first values)
            return runner, BlockPool(blocks, kv.block_size, kv.prefix_cache, _model_salt(model))

        self._build = build
        self.runner, pool = build(blocks)
        self.max_seq = self.runner.max_seq
        self.times = EngineTimes()
        self.scheduler = Scheduler(max_batch, max_queue, self.max_seq, chunk, gpu,
                                   (GATHER_GPU_S if gpu else 0.0) if gather_s is None else gather_s, self.times,
                                   pool=pool, mix=mix, speculate=speculate, model_draft=draft is not None)
        self.overlap = gpu if overlap is None else overlap
        self._inflight: Launched | None = None  # the step whose tokens are not read yet
        self._drafts: dict[int, NgramDraft] = {}  # a speculating request's prompt lookup, by its id
        self._matchers: dict = {}  # a request's place in its grammar (serve.grammar.Matcher), by its id
        self._masks: dict = {}  # masks to send before the next forward: request id -> (request, its Matcher or None: all allowed)
        self._last_read = 0.0
        self.failure: str | None = None  # set when a step failed: the engine then takes nothing
        self._thread = threading.Thread(target=self.run, name="llamactl-engine", daemon=True)
        self._loop_thread: int | None = None  # the step loop's thread (thread_cpu_s)

    # -- for callers (any thread) --------------------------------------------------------------

    @property
    def decoder(self):
        return self.runner.decoder

    @property
    def running(self) -> int:
        return self.scheduler.running

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a prompt of prompt_len tokens and max_tokens new ones do not fit, or None."""
        return self.scheduler.fits(prompt_len, max_tokens)

    def submit(self, prompt: list[int], params: Params, on_event: Callable[[Event], None]) -> Request:
        """Queue a request; raises QueueFull, or Rejected when it cannot be taken at all."""
        return self.scheduler.submit(prompt, params, on_event)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is left and end the loop."""
        self.scheduler.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def warm_up_plan(self) -> str:
        """What warm_up runs, said before it starts (on a GPU's first start it takes minutes)."""
        return self.runner.warm_up_plan(self.scheduler)

    def warm_up(self) -> None:
        """Every shape the scheduler will ask for, run (or captured) once before the first request.
        A pool sized by a fraction of the GPU: warmed up over the probe pool first, the peak
        measured, then the pool that fits beside it built and warmed up again (the compiler caches
        make the second quick)."""
        if self._measure is None:
            self.runner.warm_up(self.scheduler)
            return
        dev = self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_reserved(dev)  # the probe pool's among them
        self.runner.warm_up(self.scheduler)
        warm_up = torch.cuda.max_memory_reserved(dev) - before
        per = self.runner.block_bytes
        self.runner = None  # its pool and graphs freed before the real pool is taken
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)  # what is not freed counts as used: never twice too little
        self.runner, pool = self._build(blocks_left(total, total - free, warm_up, self._measure, per))
        self.scheduler.use_pool(pool)
        self.runner.warm_up(self.scheduler)

    def follow(self) -> None:
        """Ranks above 0 of a tensor-parallel server: run rank 0's model actions until it stops."""
        self.runner.follow()

    def stop_followers(self) -> None:
        self.runner.stop_followers()

    # -- the step loop (the engine's thread) ----------------------------------------------------

    def thread_cpu_s(self) -> float:
        """CPU seconds of the engine's thread so far, from any thread (0 before it starts or where
        the platform has no per-thread clocks)."""
        ident = self._loop_thread
        if ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # the thread has ended
            return 0.0

    def run(self) -> None:
        """The step loop on this thread, until stop() (from another thread) ends it; a failed
        step ends it too, after every request in it got the error (the engine then takes none)."""
        self._loop_thread = threading.get_ident()  # (the main thread of `serve`, or start()'s)
        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
            self.runner.stop_followers()
        except BaseException as e:  # a failed step breaks the batch: every request gets the error
            try:
                self.runner.stop_followers()
            except Exception:  # a follower gone already: its launcher stops the rest
                pass
            self.failure = f"{type(e).__name__}: {str(e)[:200]}"
            left = self.scheduler.fail(self.failure)
            self._inflight = None
            for r in left:
                self._finish(r, "error", self.failure)

    def _iteration(self) -> bool:
        """The scheduler's plan: rows joined, rows cancelled, prefills; then one decode step, read a
        step later where overlapped. False when stopped."""
        plan = self.scheduler.schedule(busy=self._inflight is not None)
        if plan is None:
            return False
        self.runner.arrange(plan.moves, plan.tables)
        for r in plan.joined:
            self.runner.set_sampling(r.slot, r.params)
        # their penalties and biases (a row that has none resets what its slot's last request left)
        adjusting = [r for r in plan.joined if r.params.sampling.adjusts_logits or self.runner.rows.penalty is not None]
        if adjusting:
            self.runner.adjust_rows([r.slot for r in adjusting], [r.params.sampling for r in adjusting],
                                    [r.tokens for r in adjusting], [r.tokens[r.prompt_len :] for r in adjusting],
                                    [sorted((set() if r.params.ignore_eos else self.eos_ids) | r.params.stop_ids)
                                     for r in adjusting])
        running = [r for r in self.scheduler.slots if r is not None]
        self._follow_grammars(plan.joined)
        constrained = any(r.params.grammar is not None for r in running)
        self.runner.set_flags(logprobs=any(r.params.logprobs is not None for r in running),
                              adjusted=any(r.params.sampling.adjusts_logits for r in running), masked=constrained)
        for r in plan.cancelled:
            self._finish(r, "cancelled")
        if plan.speculate:  # proposals follow every token: the step in flight is read first
            self._collect(self._inflight)
            self._inflight = None
            self._speculate()
            return True
        step, launched = plan.decode, None
        if constrained and self.overlap and not plan.prefills:
            # a grammar's rows: this step's forward runs while the last step's tokens are read and
            # the masks made from them; then its draw (a step ahead, as unconstrained steps are)
            step = step if self.scheduler.mixing else self.scheduler.decode()
            launched_at = self.runner.launch_forward(step) if step is not None else 0.0
            self._collect(self._inflight)
            self._send_masks()
            if step is not None:
                self.times.masked_steps += 1
                self.times.masked_host_s += time.perf_counter() - launched_at
            self._inflight = self.runner.launch_draw(step, launched_at) if step is not None else None
            return True
        if constrained:  # a prefill's draws (and a mixed step's rows) need the masks of every token so far
            self._collect(self._inflight)
            self._inflight = None
        for work in plan.prefills:
            self._send_masks()
            t0 = time.perf_counter()
            if step is not None:  # the decode rows ride in the prefill forward (scheduler.mix)
                first, launched = self.runner.mixed(work, step)
                step = None
            else:
                first = self.runner.prefill(work)
            now = time.perf_counter()
            self.times.prefilled(now - t0, work.tokens)
            for r, sc in zip(work.requests, self.runner.scores):
                if sc is not None and len(r.prompt_scores) == sc[0]:  # (a recomputed chunk was scored already)
                    r.prompt_scores.extend(sc[1])
            asked = [r for r, end in zip(work.requests, work.ends) if end and r.params.logprobs is not None]
            lps = dict(zip((r.id for r in asked), self.runner.logprobs_of([r.slot for r in asked]))) if asked else {}
            for r, tok, end in zip(work.requests, first or [], work.ends):
                if end:
                    self._emit(r, tok, now, lps.get(r.id))
        if not self.scheduler.mixing:
            step = self.scheduler.decode()
        if step is not None:
            self._send_masks()
            launched = self.runner.launch(step)
        if self.overlap and not constrained:
            self._collect(self._inflight)
            self._inflight = launched
        else:  # (a grammar's next mask needs each token before the next step: no step ahead)
            self._collect(self._inflight)
            self._inflight = None
            self._collect(launched)
        return True

    def _follow_grammars(self, joined: list[Request]) -> None:
        """Joining requests' matchers (a rejoined one's replaying its tokens so far) and their
        first masks; a joining request without a grammar clears its row's mask."""
        for r in joined:
            if r.params.grammar is not None:
                m = self._matchers[r.id] = Matcher(r.params.grammar, self.runner.rows.ids.numel())
                for tok in r.tokens[r.prompt_len :]:
                    m.accept(tok)
                self._masks[r.id] = (r, m)
            elif self.runner.rows.mask is not None:
                self._masks[r.id] = (r, None)

    def _send_masks(self) -> None:
        """The bitmasks of the matchers that moved since the last forward, made in one batch and sent
        to the device (their requests' rows now)."""
        live = [(r, m) for r, m in self._masks.values() if r.slot is not None and not r.finished]
        self._masks.clear()
        if live:
            clear = [r.slot for r, m in live if m is None]
            rows = [(r.slot, m) for r, m in live if m is not None]
            self.runner.set_masks(clear, None)
            if rows:
                with self._grammar_time():
                    masks = Matcher.masks([m for _, m in rows])
                self.runner.set_masks([s for s, _ in rows], masks)

    def _speculate(self) -> None:
        """One verify step of the running rows, each with its proposals (a plain decode step where
        none has any); each row keeps the proposals that equal the tokens drawn at their
        positions, and the token drawn after the last of them."""
        sched = self.scheduler
        rows = [r for r in sched.slots
                if r is not None and not r.finished and r.params.speculate and r.launched >= r.spec_after]
        proposals = self._drafted(rows) if self.runner.draft is not None else self._looked_up(rows)
        if not any(proposals.values()):  # a plain step (run a step ahead where the loop overlaps)
            step = sched.decode()
            launched = self.runner.launch(step) if step is not None else None
            if self.overlap:
                self._inflight = launched
            else:
                self._collect(launched)
            return
        v = sched.verify(proposals)
        if v is None:
            return
        t0 = time.perf_counter()
        drawn = self.runner.verify(v, sched.bucket())
        now = time.perf_counter()
        self.times.verify_steps += 1
        self.times.verify_s += now - t0
        slots, last = [], []  # the rows still running, and the token each feeds its next step
        for r, chunk, toks in zip(v.requests, v.chunks, drawn):
            new = keep(chunk[1:], toks)
            if r.id in proposals and self.runner.draft is not None:  # its draft K/V: the last token's, the kept proposals'
                r.drafted = r.pos + 1 + min(len(new) - 1, len(chunk) - 2)
            sched.verified(r, len(new) - 1, len(chunk) - 1)
            for tok in new:
                if not r.finished:
                    self.times.decode_rows += 1
                    self._emit(r, tok, now)
            if r.slot is not None:
                slots.append(r.slot)
                last.append(new[-1])
        self.runner.set_last(slots, last)

    def _looked_up(self, rows: list[Request]) -> dict[int, list[int]]:
        """Prompt-lookup proposals of rows (a row that has none rests)."""
        proposals = {}
        for r in rows:
            draft = self._drafts.setdefault(r.id, NgramDraft())
            draft.extend(r.tokens[len(draft.tokens) :])
            proposals[r.id] = draft.propose(r.spec_k or self.scheduler.spec_k)
            if not proposals[r.id]:
                self.scheduler.rest(r)
        return proposals

    def _drafted(self, rows: list[Request]) -> dict[int, list[int]]:
        """The draft model's proposals for rows: their blocks for them first (preempting where the
        pool is out), then each row's tokens its draft K/V lack and its proposals."""
        sched = self.scheduler
        ks = {r.id: min(r.spec_k or sched.spec_k, r.params.max_tokens - r.launched - 1) for r in rows}
        live, tables = sched.reserve([r for r in rows if ks[r.id] > 0], ks)
        self.runner.arrange([], tables)
        if not live:
            return {}
        running = [r for r in sched.slots if r is not None]
        idle = [(r.slot, r.tokens[-1], r.pos) for r in running if r not in live]
        toks = self.runner.propose([r.slot for r in live], [r.tokens[r.drafted :] for r in live],
                                   [r.drafted for r in live], [ks[r.id] for r in live], sched.bucket(), idle)
        return {r.id: t for r, t in zip(live, toks)}

    def _collect(self, step: Launched | None) -> None:
        """Read a launched step's tokens (the one host read a step) and hand them out; a row that
        finished meanwhile (EOS in the step before, cancelled) drops its token."""
        if step is None:
            return
        waited = time.perf_counter()
        tokens = step.tokens()
        lps = step.logprobs()
        now = time.perf_counter()
        self.times.read_wait_s += now - waited
        if not step.mixed:  # a mixed step's time is its prefill forward's
            self.times.decode_s += now - max(step.launched, self._last_read)
            self.times.decode_steps += 1
        self._last_read = now
        follow: list = []
        for r, row in zip(step.rows, step.at):
            if not r.finished:
                self.times.decode_rows += 1
                self.times.mixed_rows += step.mixed
                self._emit(r, tokens[row], now, lps[row] if lps is not None else None, follow)
        if follow:
            self._follow(follow)
        self.times.emit_s += time.perf_counter() - now

    def _emit(self, r: Request, token: int, now: float, lp: tuple | None = None, follow: list | None = None) -> None:
        """Hand r its token (or end it); follow: where a list, a grammar's row leaves its matcher's
        step to _follow (one call for the step's rows) instead of taking it here."""
        if r.params.prompt_logprobs is not None and r.generated == 0:  # the prompt's, before its first token
            self._send(r, Event("prompt", time=now, prompt=tuple(r.prompt_scores)))
        if (token in self.eos_ids and not r.params.ignore_eos) or token in r.params.stop_ids:
            self._release(r, "stop")
            return
        r.tokens.append(token)
        k = r.params.logprobs
        logprob = None if k is None or lp is None else (lp[0], tuple(lp[1][:k]))
        self._send(r, Event("token", token=token, time=now, logprob=logprob))
        m = self._matchers.get(r.id)
        if m is not None and follow is not None:
            follow.append((r, m, token))
            return
        if m is not None:
            m.accept(token)
        self._ended(r, m)

    def _follow(self, follow: list[tuple[Request, Matcher, int]]) -> None:
        """A step's grammar rows' tokens into their matchers in one call, then each row ended or its
        next mask due."""
        with self._grammar_time():
            Matcher.accept_many([m for _, m, _ in follow], [t for _, _, t in follow])
        for r, m, _ in follow:
            if not r.finished:
                self._ended(r, m)

    @contextlib.contextmanager
    def _grammar_time(self):
        """The block's wall and CPU time into times.grammar_s and grammar_cpu_s."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.times.grammar_s += time.perf_counter() - t0
            self.times.grammar_cpu_s += time.thread_time() - c0

    def _ended(self, r: Request, m: Matcher | None) -> None:
        """r's end after a token: its grammar's (a stop token accepted: with ignore_eos too) or its
        length; else, where it follows a grammar, its next mask is due."""
        if m is not None and m.done:
            self._release(r, "stop")
            return
        if m is not None:
            self._masks[r.id] = (r, m)
        if r.generated >= r.params.max_tokens:
            self._release(r, "length")

    def _release(self, r: Request, reason: str) -> None:
        self.scheduler.release(r)
        self._finish(r, reason)

    def _finish(self, r: Request, reason: str, error: str = "") -> None:
        self._drafts.pop(r.id, None)
        self._matchers.pop(r.id, None)
        if not r.finished:
            r.finished = True
            self._send(r, Event("done", reason=reason, time=time.perf_counter(), error=error))

    @staticmethod
    def _send(r: Request, ev: Event) -> None:
        try:
            r.on_event(ev)
        except Exception:  # one caller's broken callback must not stop the others' steps
            r.cancel()
