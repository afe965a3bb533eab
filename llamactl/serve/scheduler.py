"""The serving scheduler: requests, the queue, admission into cache rows, prefill budgets, the
gather wait, and each step's plan. It never touches a tensor (no torch here): the runner turns a
plan into model calls (serve.runner), the engine runs the loop (serve.engine).

A step is the prefills the scheduler plans (`schedule`: whole prompts joining together, or chunks
within a token budget while other rows decode), then one decode step of every row that then
decodes (`decode`). A request holds its token ids (prompt, then output) and how many of them have
their K/V computed; it owns one row of the cache (its slot) from admission to its last token.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


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
    gather_s: float = 0.0  # waiting, from idle, for a burst's other requests (Scheduler._gather)

    def prefilled(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefill_forwards += 1
        self.prefill_tokens += tokens
        self.prefill_max_s = max(self.prefill_max_s, seconds)


class QueueFull(Exception):
    """Every row is taken (by a running request or one queued for it) and --max-queue more wait."""


class Rejected(Exception):
    """The engine cannot take this request (stopping, failed, or it does not fit the context)."""


_ids = itertools.count(1)
BATCH_PREFILL_TOKENS = 8192  # prompt tokens prefilled in one forward when no row decodes, or in a burst
# From idle, the scheduler waits while requests keep arriving, each within gather_s of the last, for
# at most GATHER_SPAN gather_s from the first (a burst then goes through one prefill forward: see
# Scheduler._gather; the window's measurements: docs/results.md). A burst of one (the requests that
# arrived within the span of the first, last time the engine went from idle) turns the next wait
# off: a lone client's request is not held for others that do not come; the first burst after it
# is then split once (its first request goes alone), the next gathered.
GATHER_SPAN = 10


class Request:
    """One sequence: its token ids (prompt + output), its cache row, how far it is computed. Its
    fields change on the engine's thread only (cancel: any thread)."""

    def __init__(self, prompt: list[int], params: Params, on_event: Callable[[Event], None], arrived: float):
        self.id = next(_ids)
        self.tokens = list(prompt)  # prompt, then each token handed out
        self.prompt_len = len(prompt)
        self.params, self.on_event, self.arrived = params, on_event, arrived
        self.slot: int | None = None  # its row of the cache
        self.prefilled = 0  # prompt tokens whose K/V are computed (or queued)
        self.launched = 0  # output tokens computed or in flight (the prefill's first one included)
        self.cancelled = False
        self.finished = False

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def generated(self) -> int:
        """Output tokens handed out."""
        return len(self.tokens) - self.prompt_len

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt_len

    @property
    def pos(self) -> int:
        """The position of the token fed to its next decode step (its next prompt chunk's while prefilling)."""
        return self.prompt_len + self.launched - 1 if self.decoding else self.prefilled

    @property
    def computed(self) -> int:
        """Its tokens whose K/V are in the cache or on their way (prompt and output)."""
        return self.pos

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step boundary (any thread)."""
        self.cancelled = True


@dataclass
class Prefill:
    """One prefill forward: `requests`' tokens ids[i][:valid[i]] (then padding) at positions
    start.. of their slots; last: it ends their prompts, and its next tokens are read."""

    requests: list[Request]
    ids: list[list[int]]  # [k, s]
    start: int
    valid: list[int]
    last: bool

    @property
    def together(self) -> bool:
        """Several whole prompts in one forward (else one prompt's chunk)."""
        return len(self.requests) > 1

    @property
    def tokens(self) -> int:
        return sum(self.valid)


@dataclass
class Decode:
    """One decode step of cache rows 0..rows-1 (a batch bucket: one CUDA graph each), each at
    positions[i]; `requests` receive its tokens (at their slots); a free row or one still
    prefilling steps too, at a position whose K/V nothing reads before it is written again."""

    requests: list[Request]
    rows: int
    positions: list[int]
    kv_len: int  # every position is below it (an eager step's attention reads that much)
    greedy: bool  # no row samples


@dataclass
class StepPlan:
    joined: list[Request] = field(default_factory=list)  # admitted now: their rows' sampling settings
    cancelled: list[Request] = field(default_factory=list)  # dropped from their rows now
    prefills: list[Prefill] = field(default_factory=list)


class Scheduler:
    """The queue and the cache rows. submit(), stop() and the counters from any thread; the rest
    on the engine's. gpu: pad prompt chunks to few shapes and prefill joining prompts together
    (on the CPU one at a time, so the float32 sums, and so the tokens, are those of `generate`)."""

    def __init__(self, max_batch: int, max_queue: int, max_seq: int, prefill_chunk: int, gpu: bool,
                 gather_s: float, times: EngineTimes | None = None, clock: Callable[[], float] = time.perf_counter):
        self.max_batch, self.max_queue, self.max_seq = max_batch, max_queue, max_seq
        self.prefill_chunk, self.gather_s, self.clock = prefill_chunk, gather_s, clock
        self.times = times or EngineTimes()
        # A prompt chunk is padded to a multiple of pad_to on a GPU, so that few shapes meet the
        # libraries for the first time (each is prefilled once at warm-up); a burst's prompts are
        # padded to their longest, rounded to burst_pad_to only. On the CPU nothing is gained.
        self.pad_to, self.burst_pad_to = (64, 16) if gpu else (1, 1)
        self.batch_prefill = gpu
        # the decode step runs on rows 0..b-1 for the smallest bucket b holding every decoding row
        self.buckets = sorted({min(2**i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self.slots: list[Request | None] = [None] * max_batch
        self.queue: deque[Request] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.failure: str | None = None  # set when a step failed: nothing is taken then
        self._burst_start = 0.0  # the first arrival since the engine last went from idle
        self._burst_size = 2  # requests admitted that arrived within the span of it (2: gather the first time)

    # -- any thread --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def waiting(self) -> int:
        return len(self.queue)

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
        req = Request(prompt, params, on_event, self.clock())
        with self.cv:
            if self.failure or self.stopping:
                raise Rejected(f"the engine {'failed: ' + self.failure if self.failure else 'is stopping'}")
            free = sum(r is None for r in self.slots)  # rows the next step admits into: not waiting
            if len(self.queue) >= self.max_queue + free:
                raise QueueFull(f"{self.max_batch - free} requests running and {len(self.queue)} waiting")
            self.queue.append(req)
            self.cv.notify()
        return req

    def stop(self) -> None:
        """Cancel every request and end the loop once nothing is left."""
        with self.cv:
            self.stopping = True
            for r in list(self.queue) + [r for r in self.slots if r is not None]:
                r.cancel()
            self.cv.notify()

    def fail(self, why: str) -> list[Request]:
        """A step failed: take nothing more; returns every request still here, removed."""
        with self.cv:
            self.failure = why
            left = list(self.queue) + [r for r in self.slots if r is not None]
            self.queue.clear()
            self.slots = [None] * self.max_batch
        return left

    # -- the engine's thread -----------------------------------------------------------------

    def schedule(self, busy: bool) -> StepPlan | None:
        """Wait for work, admit into free rows (after a gather wait from idle), drop the cancelled,
        plan this step's prefills; None once stopped with nothing left. busy: a step is in flight."""
        with self.cv:
            while not self.stopping and self._idle(busy):
                self.cv.wait()
            if self.stopping and self._idle(busy):
                return None
            plan = StepPlan()
            if not any(self.slots) and not busy:  # from idle: a new burst
                alone = self._burst_size == 1  # the last one was one request
                self._burst_start, self._burst_size = self.queue[0].arrived, 0
                if self.gather_s and not alone:
                    self._gather()
            plan.joined = self._admit(plan.cancelled)
        for r in [r for r in self.slots if r is not None and r.cancelled]:
            self.release(r)
            plan.cancelled.append(r)
        plan.prefills = self._prefills()
        return plan

    def _idle(self, busy: bool) -> bool:
        """Nothing queued, in a row or in flight (under self.cv)."""
        return not self.queue and not any(self.slots) and not busy

    def _gather(self) -> None:
        """Under self.cv, from idle with a request queued (unless the last burst was one request):
        wait while more arrive, each within gather_s of the last, for at most GATHER_SPAN gather_s
        from the first, or until the rows are full. Closed-loop clients (a load test's, and many
        real ones) come back together when a batch ends, their requests over a few ms: the first
        prefilled alone would delay all the others by its forward."""
        t0 = self.clock()
        end = self.queue[0].arrived + GATHER_SPAN * self.gather_s
        while not self.stopping and self.queue and len(self.queue) < self.max_batch:
            left = min(self.queue[-1].arrived + self.gather_s, end) - self.clock()
            if left <= 0:
                break
            self.cv.wait(left)
        self.times.gather_s += self.clock() - t0

    def _admit(self, cancelled: list[Request]) -> list[Request]:
        # under self.cv: first come, first served, into the free rows
        joined = []
        while self.queue:
            if self.queue[0].cancelled:
                cancelled.append(self.queue.popleft())
                continue
            free = next((i for i, r in enumerate(self.slots) if r is None), None)
            if free is None:
                break
            r = self.queue.popleft()
            r.slot = free
            self.slots[free] = r
            joined.append(r)
            if r.arrived <= self._burst_start + GATHER_SPAN * self.gather_s:
                self._burst_size += 1
        return joined

    def release(self, r: Request) -> None:
        """Free r's row (it finished or was cancelled)."""
        with self.cv:
            if r.slot is not None and self.slots[r.slot] is r:
                self.slots[r.slot] = None

    def _prefills(self) -> list[Prefill]:
        """Prompt chunks, first come first, within the budget; with no row decoding there is no one
        to delay, and every waiting prompt is prefilled. Where batch_prefill, the short prompts
        that just joined go first, together in one forward. Each planned prompt token counts as
        computed from here (the runner runs the plan before anything reads it)."""
        decoding = sum(r is not None and r.decoding for r in self.slots)
        starting = sum(r is not None and r.prefilled == 0 for r in self.slots)
        # Every waiting prompt at once where none decode, or where more are starting than decode (a
        # burst: one forward for all is fairer than a chunk a step, which delays each one behind
        # the others' chunks and the steps between); else at most prefill_chunk tokens a step.
        budget = None if starting > decoding and self.batch_prefill else self.prefill_chunk if decoding else None
        out = []
        if self.batch_prefill:
            budget = self._together(budget, out)
        for r in sorted((r for r in self.slots if r is not None and not r.decoding), key=lambda r: r.id):
            if budget is not None and budget <= 0:
                break
            n = r.prompt_len - r.prefilled if budget is None else min(budget, r.prompt_len - r.prefilled)
            chunk = r.tokens[r.prefilled : r.prefilled + n]
            padded = min(-(-n // self.pad_to) * self.pad_to, self.max_seq - r.prefilled)
            last = r.prefilled + n == r.prompt_len
            out.append(Prefill([r], [chunk + [0] * (padded - n)], r.prefilled, [n], last))
            r.prefilled += n
            if last:
                r.launched = 1  # its first output token comes from this forward
            if budget is not None:
                budget -= n
        return out

    def _together(self, budget: int | None, out: list[Prefill]) -> int | None:
        """The prompts that joined and fit the budget (each at most prefill_chunk tokens, together at
        most max(budget, prefill_chunk) or, with no budget, BATCH_PREFILL_TOKENS), padded to one
        length for one forward; returns the budget left."""
        room = BATCH_PREFILL_TOKENS if budget is None else budget
        group: list[Request] = []
        for r in sorted((r for r in self.slots if r is not None and r.prefilled == 0), key=lambda r: r.id):
            if r.prompt_len <= min(room, self.prefill_chunk if budget is not None else room):
                group.append(r)
                room -= r.prompt_len
        if len(group) < 2:
            return budget
        s = min(-(-max(r.prompt_len for r in group) // self.burst_pad_to) * self.burst_pad_to, self.max_seq)
        out.append(Prefill(group, [r.prompt + [0] * (s - r.prompt_len) for r in group], 0,
                           [r.prompt_len for r in group], True))
        for r in group:
            r.prefilled, r.launched = r.prompt_len, 1
        return None if budget is None else max(0, budget - sum(r.prompt_len for r in group))

    def decode(self) -> Decode | None:
        """The decode step of the rows that still have tokens to compute, or None; counts their
        next tokens as launched."""
        live = [r for r in self.slots if r is not None and r.decoding and r.launched < r.params.max_tokens]
        if not live:
            return None
        b = next(b for b in self.buckets if b > max(r.slot for r in live))
        pos = [0 if r is None else min(r.pos, self.max_seq - 1) for r in self.slots[:b]]
        greedy = all(r.params.temperature == 0 for r in self.slots[:b] if r is not None)
        kv_len = min(self.max_seq, -(-(max(pos) + 1) // 64) * 64)
        for r in live:
            r.launched += 1
        return Decode(live, b, pos, kv_len, greedy)
