"""The serving engine: one thread owns the model and its slotted KV cache and runs the step loop.

Requests wait in a bounded first-come queue and join the running batch at a step boundary: a free
slot of the cache takes the prompt, prefilled in chunks (at most `prefill_chunk` prompt tokens an
iteration while other rows decode, so a long prompt delays them by one chunk a step). Every row
then decodes at its own position with its own sampling settings (llamactl.runtime.sampling.RowSampling),
so a request's tokens do not depend on the other rows. A request leaves at EOS, at its token
limit, or when cancelled (a stop string its caller found, a client gone), freeing its slot.

On a GPU the loop runs one step ahead of its host work (`overlap`): it launches step N+1, whose
input tokens are step N's outputs already on the device, before it reads step N's tokens and hands
them out, so the scheduling, the callbacks and the HTTP side's work run while the device computes.
What the host cannot know at launch is a row's EOS (or a cancel): such a row is computed one step
more, and that token is dropped. Positions and token counts are known ahead, so no row ever runs
past its token limit.

No tokenizer here: callers tokenize and detokenize on their own threads. Events go back through
each request's `on_event`, called on the engine's thread. The next steps fit in this loop: a
paged KV cache replaces the fixed cache row a slot owns (`Request.slot` becomes a block table,
`_admit` checks free blocks instead of free slots), and speculative decoding replaces `_launch`
with one that proposes and verifies several tokens a row (`_collect` emits each).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from llamactl.runtime.step import Decoder
from llamactl.options import RuntimeOptions
from llamactl.runtime.sampling import RowSampling
from llamactl.serve.staging import Launched, Staging


@dataclass(frozen=True)
class Params:
    """What one request asks for. temperature 0: greedy; top_k 0: off; top_p 1: off."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class Event:
    """kind "token" (a generated token id) or "done" (reason: "stop" at EOS, "length",
    "cancelled" or "error" with `error`); time: time.perf_counter() when it was emitted."""

    kind: str
    token: int = -1
    reason: str = ""
    time: float = 0.0
    error: str = ""


@dataclass
class EngineTimes:
    """Where the step loop's time goes (seconds and counts since start; /metrics exports them).
    Each time includes its host read, so it is the device's work plus the launch overhead; a
    prompt chunk that is not a prompt's last has no read, and counts its launch alone."""

    prefill_s: float = 0.0
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    prefill_max_s: float = 0.0  # the slowest forward: a first shape's plan costs land here
    decode_s: float = 0.0  # from each step's launch (or the last read, if later) to its tokens' read
    decode_steps: int = 0
    decode_rows: int = 0  # summed over steps: rows that received a token
    emit_s: float = 0.0  # handing tokens to the callers (their callbacks run on this thread)
    gather_s: float = 0.0  # waiting, from idle, for a burst's other requests (Engine._gather)

    def prefilled(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefill_forwards += 1
        self.prefill_tokens += tokens
        self.prefill_max_s = max(self.prefill_max_s, seconds)


class QueueFull(Exception):
    """Every slot is busy and the queue holds --max-queue requests."""


class Rejected(Exception):
    """The engine cannot take this request (stopping, failed, or it does not fit the context)."""


_ids = itertools.count(1)
BATCH_PREFILL_TOKENS = 8192  # prompt tokens prefilled in one forward when no row decodes, or in a burst
# Prompt tokens prefilled a step while others decode, by default: on an H200 a 2,048-token chunk
# costs the running streams about 60 ms once, and gave 32 streams 2,660 output tok/s against 2,213
# with 512 (docs/bench/README.md); a CPU takes seconds for that many
PREFILL_CHUNK_GPU, PREFILL_CHUNK_CPU = 2048, 512
# From idle, the engine waits while requests keep arriving, each within gather_s of the last, for at
# most GATHER_SPAN gather_s from the first (a burst then goes through one prefill forward: see
# Engine._gather). On a GPU by default; on the CPU prompts are prefilled one at a time anyway. 10 ms:
# at 32 streams on an H200, 0, 2 and 5 ms split a wave's burst (p95 TTFT 440, 221, 205 ms), 10 and
# 20 took it whole (195 ms both), 20 costing a lone request 10 ms more (docs/bench/README.md).
# A burst of one (the requests that arrived within the span of the first, last time the engine
# went from idle) turns the next wait off: a lone client's request is not held for others that
# do not come (the window was a sixth of its time to the first token on an H200, docs/bench);
# the first burst after it is then split once (its first request goes alone), the next gathered.
GATHER_GPU_S, GATHER_SPAN = 0.010, 10


class Request:
    """One sequence in the engine. Its fields change on the engine's thread only."""

    def __init__(self, prompt: list[int], params: Params, on_event: Callable[[Event], None]):
        self.id = next(_ids)
        self.prompt, self.params, self.on_event = prompt, params, on_event
        self.arrived = time.perf_counter()
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens already in the cache
        self.pos = 0  # the position of the token fed to the next decode step
        self.generated = 0  # tokens handed out
        self.launched = 0  # tokens computed or in flight (prefill's first one included)
        self.cancelled = False
        self.finished = False

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step boundary (any thread)."""
        self.cancelled = True


class Engine:
    """The scheduler and step loop over one model. run() runs the loop on the calling thread,
    start() on a thread of its own; submit() from any thread; stop() ends it (requests still in
    it are cancelled).

    On a CPU the loop belongs on the thread that loaded the model: torch's CPU threads (an OpenMP
    team) belong to the thread that first ran a parallel op, and a second thread's team beside
    them made every op of a 17M-parameter model's step about 4x slower on 2 cores (the teams
    outnumber the cores, and libgomp then seems to sleep between parallel regions instead of
    spinning: a second thread whose team was the only one was not slowed). `llamactl serve` runs
    the loop on its main thread and the HTTP server on another."""

    def __init__(self, model, eos_ids: set[int], max_batch: int = 8, max_queue: int = 64,
                 max_seq: int | None = None, mode: str | None = None, options: RuntimeOptions | None = None,
                 prefill_chunk: int | None = None, world=None, overlap: bool | None = None,
                 gather_s: float | None = None, prefill_graphs: bool = True):
        """gather_s: from idle, wait this long after each arrival for the next (None: GATHER_GPU_S
        on a GPU, 0 on the CPU).
        overlap: launch each decode step before handing out the last one's tokens (None: on a
        GPU; on the CPU the step runs on this thread, so nothing would overlap).
        world: tensor parallelism (tp.World): rank 0's engine schedules and sends each model
        action to the other ranks, whose engines only follow() them (every rank computes the same
        tokens: the head is replicated).
        prefill_graphs: a whole prompt of few tokens, or a few joining together, replays a CUDA
        graph where the steps do (not under tensor parallelism: untried there)."""
        self.device = model.device
        self.eos_ids = set(eos_ids)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.prefill_chunk = prefill_chunk or (PREFILL_CHUNK_GPU if self.device.type == "cuda" else PREFILL_CHUNK_CPU)
        ctx = model.args.max_position_embeddings
        mode = mode or ("graphs" if self.device.type == "cuda" else "eager")
        self.rows = RowSampling.make([{}] * max_batch, self.device)
        self.decoder = Decoder(model, max_batch, min(max_seq or ctx, ctx), mode, options=options, rows=self.rows,
                               prefill_graphs=prefill_graphs and world is None)
        self.max_seq = self.decoder.max_seq
        self.mode = mode
        # A prompt chunk is padded to a multiple of pad_to on a GPU, so that few shapes meet the
        # libraries for the first time (a new row count cost cuBLAS 30 ms or more on an H200, the
        # first prefill of all 290 ms; cuDNN's attention, hundreds of ms, is not used): each such
        # length is prefilled once in warm_up. A burst's prompts are padded to their longest,
        # rounded to burst_pad_to only (its row count is new anyway, and 142-token prompts padded
        # to 192 cost a third more). On the CPU nothing is gained, and the float32 sums stay those
        # of an unpadded prefill (token for token equal to `generate`).
        gpu = self.device.type == "cuda"
        self.pad_to, self.burst_pad_to = (64, 16) if gpu else (1, 1)
        # prompts that join together are prefilled in one forward (on the CPU one at a time, so the
        # float32 sums, and so the tokens, are those of `generate`)
        self.batch_prefill = gpu
        # the decode step runs on slots 0..b-1 for the smallest bucket b holding every decoding row
        # (one CUDA graph each): a lone request steps at batch 1, not at max_batch
        self.buckets = sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self._tok = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # each row's last token
        self.overlap = gpu if overlap is None else overlap
        self.gather_s = (GATHER_GPU_S if gpu else 0.0) if gather_s is None else gather_s
        self._burst_start = 0.0  # the first arrival since the engine last went from idle
        self._burst_size = 2  # requests admitted that arrived within the span of it (2: gather the first time)
        self._staging = Staging(max_batch, self.device)
        self._inflight: Launched | None = None  # the step whose tokens are not read yet
        self._last_read = 0.0
        self._slots: list[Request | None] = [None] * max_batch
        self._queue: deque[Request] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.failure: str | None = None  # set when a step failed: the engine then takes nothing
        self.times = EngineTimes()
        self.world = world
        self._followers_stopped = False
        self._thread = threading.Thread(target=self.run, name="llamactl-engine", daemon=True)

    # -- for callers (any thread) --------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a prompt of prompt_len tokens and max_tokens new ones do not fit, or None."""
        if prompt_len < 1:
            return "the prompt is empty"
        if prompt_len >= self.max_seq:
            return f"the prompt has {prompt_len} tokens; this server's context is {self.max_seq}"
        if prompt_len + max_tokens > self.max_seq:
            return (f"the prompt's {prompt_len} tokens + max_tokens {max_tokens} exceed this server's context "
                    f"of {self.max_seq}")
        return None

    def submit(self, prompt: list[int], params: Params, on_event: Callable[[Event], None]) -> Request:
        """Queue a request; raises QueueFull, or Rejected when it cannot be taken at all."""
        why = self.fits(len(prompt), params.max_tokens)
        if why:
            raise Rejected(why)
        req = Request(list(prompt), params, on_event)
        with self._cv:
            if self.failure or self._stopping:
                raise Rejected(f"the engine {'failed: ' + self.failure if self.failure else 'is stopping'}")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{self.max_batch} requests running and {len(self._queue)} waiting")
            self._queue.append(req)
            self._cv.notify()
        return req

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is left and end the loop."""
        with self._cv:
            self._stopping = True
            for r in list(self._queue) + [r for r in self._slots if r is not None]:
                r.cancel()
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def warm_up_plan(self) -> str:
        """What warm_up runs, said before it starts (on a GPU's first start it takes minutes)."""
        steps = f"{2 * len(self.buckets)} decode steps ({', '.join(map(str, self.buckets))} rows, greedy and sampled)"
        if self.device.type != "cuda":
            return steps
        if self.mode == "eager":
            what = f"running {steps} once"
        else:
            graphs = self.decoder.prefill_graphs
            prefills = f" and {len(graphs.shapes())} short prefills" if graphs is not None else ""
            what = f"capturing {steps}{prefills} as CUDA graphs"
        return (f"{what}; the first start on a GPU also compiles and tunes its kernels (minutes; later starts reuse "
                "the compiler caches)")

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One decode step per batch bucket with every row free (captures the CUDA graphs before
        the first request; free rows write position 0, which a prefill overwrites before it is read)."""
        for greedy in (True, False):  # a graph each: argmax alone, or the per-row draw
            self.rows.greedy = greedy
            for b in self.buckets:
                self.decoder.step(self._tok[:b], torch.zeros(b, dtype=torch.long, device=self.device), 64)
        graphs = self.decoder.prefill_graphs
        if graphs is not None:  # the short prefills' graphs, into free rows
            graphs.capture_all()
        if self.device.type == "cuda":
            # eager prefills into free rows too: each padded length of one prompt chunk, and two
            # prompts together, so that the libraries' first calls with a shape (cuBLAS's plans,
            # Triton's compiles) land here and not in a request's time to its first token. Where a
            # graph takes a whole prompt of that length, the eager ones left are a later chunk's
            # (at a position past 0; none where the length fills the cache)
            for s in range(self.pad_to, min(self.prefill_chunk, self.max_seq) + 1, self.pad_to):
                start = 0 if graphs is None or graphs.bucket(1, s) is None else min(self.pad_to, self.max_seq - s)
                self.decoder.prefill(torch.zeros(1, s, dtype=torch.long), slot=0, start=start, valid=s)
            if self.batch_prefill and self.max_batch > 1:
                # two short prompts (eager where no graph takes them), and a burst of every slot
                # (2 x pad_to tokens each, at most BATCH_PREFILL_TOKENS): its first time through the
                # burst's kernels at thousands of tokens cost the first burst of 32 streams 240 ms
                # (docs/bench/README.md, 2026-12-04)
                s = min(self.pad_to, self.max_seq)
                if graphs is None or graphs.bucket(2, s) is None:
                    self.decoder.prefill_slots(torch.zeros(2, s, dtype=torch.long), [0, 1], [s, s])
                s = min(2 * self.pad_to, self.max_seq)
                k = max(2, min(self.max_batch, BATCH_PREFILL_TOKENS // s))
                self.decoder.prefill_slots(torch.zeros(k, s, dtype=torch.long), list(range(k)), [s] * k)
            torch.cuda.synchronize(self.device)

    # -- the step loop (the engine's thread) ----------------------------------------------------

    def run(self) -> None:
        """The step loop on this thread, until stop() (from another thread) ends it; a failed
        step ends it too, after every request in it got the error (the engine then takes none)."""
        try:
            with torch.inference_mode():
                while self._iteration():
                    pass
            self.stop_followers()
        except BaseException as e:  # a failed step breaks the batch: every request gets the error
            try:
                self.stop_followers()
            except Exception:  # a follower gone already: its launcher stops the rest
                pass
            self.failure = f"{type(e).__name__}: {str(e)[:200]}"
            with self._cv:
                left = list(self._queue) + [r for r in self._slots if r is not None]
                self._queue.clear()
                self._slots = [None] * self.max_batch
                self._inflight = None
            for r in left:
                self._finish(r, "error", self.failure)

    def stop_followers(self) -> None:
        """A tensor-parallel leader's last message (once): the other ranks' follow() returns."""
        if self.world is not None and self.world.rank == 0 and not self._followers_stopped:
            from llamactl.runtime.tp import send

            self._followers_stopped = True
            send(("stop",), self.world)

    def _iteration(self) -> bool:
        """Admit, drop the cancelled, one prefill budget, one decode step; False when stopped."""
        with self._cv:
            while not self._stopping and self._idle():
                self._cv.wait()
            if self._stopping and self._idle():
                return False
            if not any(self._slots) and self._inflight is None:  # from idle: a new burst
                alone = self._burst_size == 1  # the last one was one request
                self._burst_start, self._burst_size = self._queue[0].arrived, 0
                if self.gather_s and not alone:
                    self._gather()
            joined = self._admit()
        for r in joined:
            self._set_sampling(r)
        for r in [r for r in self._slots if r is not None and r.cancelled]:
            self._release(r, "cancelled")
        self._prefill()
        step = self._launch()
        if self.overlap:
            self._collect(self._inflight)
            self._inflight = step
        else:
            self._collect(step)
        return True

    def _idle(self) -> bool:
        """Nothing queued, in a slot or in flight (under self._cv)."""
        return not self._queue and not any(self._slots) and self._inflight is None

    def _gather(self) -> None:
        """Under self._cv, from idle with a request queued (unless the last burst was one request):
        wait while more arrive, each within gather_s of the last, for at most GATHER_SPAN gather_s
        from the first, or until the slots are full. The closed-loop clients of a load test (and
        many real ones) come back together when a batch ends, and their requests reach the engine over a few ms: the first prefilled
        alone (a forward bound by its launches, which also holds the GIL the HTTP side needs to
        take the others in) delayed all the others by that forward (docs/bench/README.md)."""
        t0 = time.perf_counter()
        end = self._queue[0].arrived + GATHER_SPAN * self.gather_s
        while not self._stopping and self._queue and len(self._queue) < self.max_batch:
            left = min(self._queue[-1].arrived + self.gather_s, end) - time.perf_counter()
            if left <= 0:
                break
            self._cv.wait(left)
        self.times.gather_s += time.perf_counter() - t0

    def _admit(self) -> list[Request]:
        # under self._cv: first come, first served, into the free slots
        joined = []
        while self._queue:
            if self._queue[0].cancelled:
                self._finish(self._queue.popleft(), "cancelled")
                continue
            free = next((i for i, r in enumerate(self._slots) if r is None), None)
            if free is None:
                break
            r = self._queue.popleft()
            r.slot = free
            self._slots[free] = r
            joined.append(r)
            if r.arrived <= self._burst_start + GATHER_SPAN * self.gather_s:
                self._burst_size += 1
        return joined

    def _set_sampling(self, r: Request) -> None:
        p = r.params
        self._do(("row", r.slot, p.temperature, p.top_k, p.top_p, p.seed))

    # -- model actions: run here, and on a tensor-parallel leader sent to the other ranks first -----

    def _do(self, action: tuple):
        if self.world is not None and self.world.rank == 0:
            from llamactl.runtime.tp import send

            send(action, self.world)
        return self._apply(action)

    def _apply(self, action: tuple):
        kind, *a = action
        if kind == "row":  # in place: a captured decode graph reads these same tensors
            i, t, k, p, seed = a
            self.rows.temperature[i], self.rows.top_k[i], self.rows.top_p[i], self.rows.seed[i] = t, k, p, seed
        elif kind == "prefill":  # one prompt chunk into its slot; the last one sets the row's token
            ids, slot, start, valid, last = a
            tok = self.decoder.prefill(torch.tensor([ids]), slot=slot, start=start, valid=valid)  # ids from the host
            if last:
                self._tok[slot] = tok[0]
            return tok  # [1]
        elif kind == "prefill_slots":  # whole prompts of one padded length, one a slot
            ids, slots, lens = a
            toks = self.decoder.prefill_slots(torch.tensor(ids), slots, lens)  # [k]
            self._tok[torch.tensor(slots, device=self.device)] = toks
            return toks
        elif kind == "step":  # one decode step of the first b rows
            b, pos, kv_len, greedy = a
            self.rows.greedy = greedy
            out = self.decoder.step(self._tok[:b], self._staging.positions(pos), kv_len)  # [b]
            self._tok[:b].copy_(out)
            return out
        else:
            raise ValueError(f"unknown engine action {kind!r}")

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks above 0 of a tensor-parallel server: run rank 0's model actions until it stops."""
        from llamactl.runtime.tp import receive

        while (action := receive(self.world))[0] != "stop":
            self._apply(action)

    def _prefill(self) -> None:
        """Prefill prompt chunks, first come first, within the budget; with no row decoding there
        is no one to delay, and every waiting prompt is prefilled. Where batch_prefill, the short
        prompts that just joined go first, together in one forward."""
        decoding = sum(r is not None and r.decoding for r in self._slots)
        starting = sum(r is not None and r.prefilled == 0 for r in self._slots)
        # Every waiting prompt at once where none decode, or where more are starting than decode (a
        # burst: one forward for all is fairer than a chunk a step, which delays each one behind
        # the others' chunks and the steps between); else at most prefill_chunk tokens a step.
        budget = None if starting > decoding and self.batch_prefill else self.prefill_chunk if decoding else None
        if self.batch_prefill:
            budget = self._prefill_together(budget)
        for r in sorted((r for r in self._slots if r is not None and not r.decoding), key=lambda r: r.id):
            while not r.decoding and (budget is None or budget > 0):
                n = len(r.prompt) - r.prefilled if budget is None else min(budget, len(r.prompt) - r.prefilled)
                chunk = r.prompt[r.prefilled : r.prefilled + n]
                padded = min(-(-n // self.pad_to) * self.pad_to, self.max_seq - r.prefilled)
                t0 = time.perf_counter()
                last = r.prefilled + n == len(r.prompt)
                tok = self._do(("prefill", chunk + [0] * (padded - n), r.slot, r.prefilled, n, last))  # [1]
                r.prefilled += n
                if budget is not None:
                    budget -= n
                if r.decoding:
                    r.pos, r.launched = len(r.prompt), 1
                    first = int(tok[0])  # the host read
                    self.times.prefilled(time.perf_counter() - t0, n)
                    self._emit(r, first, time.perf_counter())
                else:  # no host read here: its device time lands in the next read (no sync to time it)
                    self.times.prefilled(time.perf_counter() - t0, n)
            if budget is not None and budget <= 0:
                break

    def _prefill_together(self, budget: int | None) -> int | None:
        """The prompts that joined and fit the budget (each at most prefill_chunk tokens, together at
        most max(budget, prefill_chunk) or, with no budget, BATCH_PREFILL_TOKENS), padded to one
        length and prefilled in one forward; returns the budget left."""
        room = BATCH_PREFILL_TOKENS if budget is None else budget
        group: list[Request] = []
        for r in sorted((r for r in self._slots if r is not None and r.prefilled == 0), key=lambda r: r.id):
            if len(r.prompt) <= min(room, self.prefill_chunk if budget is not None else room):
                group.append(r)
                room -= len(r.prompt)
        if len(group) < 2:
            return budget
        t0 = time.perf_counter()
        s = min(-(-max(len(r.prompt) for r in group) // self.burst_pad_to) * self.burst_pad_to, self.max_seq)
        ids = [r.prompt + [0] * (s - len(r.prompt)) for r in group]  # [k, s]
        toks = self._do(("prefill_slots", ids, [r.slot for r in group], [len(r.prompt) for r in group]))  # [k]
        first = toks.tolist()  # the host read
        now = time.perf_counter()
        self.times.prefilled(now - t0, sum(len(r.prompt) for r in group))
        for r, t in zip(group, first):
            r.prefilled = r.pos = len(r.prompt)
            r.launched = 1
            self._emit(r, t, now)
        return None if budget is None else max(0, budget - sum(len(r.prompt) for r in group))

    def _launch(self) -> Launched | None:
        """Start one decode step of the rows that still have tokens to compute; nothing read back."""
        live = [r for r in self._slots if r is not None and r.decoding and r.launched < r.params.max_tokens]
        if not live:
            return None
        # A row not stepping steps too (one shape for all steps) at a position whose K/V nothing reads
        # before it is written again: 0 in a free slot, the next prompt position in a prefilling one,
        # the next one in a row whose last tokens are in flight.
        b = next(b for b in self.buckets if b > max(r.slot for r in live))
        pos = [0 if r is None else min(r.pos if r.decoding else r.prefilled, self.max_seq - 1) for r in self._slots[:b]]
        greedy = all(r.params.temperature == 0 for r in self._slots[:b] if r is not None)
        kv_len = min(self.max_seq, -(-(max(pos) + 1) // 64) * 64)  # eager SDPA: the cache rows in use
        t0 = time.perf_counter()
        out = self._do(("step", b, pos, kv_len, greedy))  # [b]
        for r in live:
            r.pos += 1
            r.launched += 1
        return self._staging.read_later(out, live, t0)

    def _collect(self, step: Launched | None) -> None:
        """Read a launched step's tokens (the one host read a step) and hand them out; a row that
        finished meanwhile (EOS in the step before, cancelled) drops its token."""
        if step is None:
            return
        tokens = step.tokens()
        now = time.perf_counter()
        self.times.decode_s += now - max(step.launched, self._last_read)
        self._last_read = now
        self.times.decode_steps += 1
        for r in step.rows:
            if not r.finished:
                self.times.decode_rows += 1
                self._emit(r, tokens[r.slot], now)
        self.times.emit_s += time.perf_counter() - now

    def _emit(self, r: Request, token: int, now: float) -> None:
        if token in self.eos_ids and not r.params.ignore_eos:
            self._release(r, "stop")
            return
        r.generated += 1
        self._send(r, Event("token", token=token, time=now))
        if r.generated >= r.params.max_tokens:
            self._release(r, "length")

    def _release(self, r: Request, reason: str) -> None:
        with self._cv:
            if r.slot is not None and self._slots[r.slot] is r:
                self._slots[r.slot] = None
        self._finish(r, reason)

    def _finish(self, r: Request, reason: str, error: str = "") -> None:
        if not r.finished:
            r.finished = True
            self._send(r, Event("done", reason=reason, time=time.perf_counter(), error=error))

    @staticmethod
    def _send(r: Request, ev: Event) -> None:
        try:
            r.on_event(ev)
        except Exception:  # one caller's broken callback must not stop the others' steps
            r.cancel()
