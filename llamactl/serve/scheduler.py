"""The serving scheduler: the queue, admission by rows and KV blocks, prefix reuse, prefill
budgets, preemption, the gather wait, and each step's plan (the requests and plans it hands out:
serve.plan). It never touches a tensor (no torch here): the runner turns a plan into model calls
(serve.runner), the engine runs the loop (serve.engine).

A step is the prefills the scheduler plans (`schedule`: whole prompts joining together, or chunks
within a token budget while other rows decode), then one decode step of every row that then
decodes (`decode`). Where it mixes (a GPU), the decode step is planned first, of the rows decoding
already, and rides in the prefill forward when there is one (a mixed step: the weights read once).

A request holds its token ids (prompt, then output), how many of them have their K/V computed,
and the KV blocks that hold them (serve.blocks; a table row of the paged cache,
runtime.kv_cache.PagedCache). While it runs it has a batch row (its slot): rows are kept packed
(a request leaving row 3 while row 7 runs moves row 7's table, settings and last token to row 3),
so a decode step of n requests runs the smallest bucket of rows >= n. Its prompt's longest cached
prefix of full blocks is reused, not computed. When a step needs a block and none is free, the
newest running request is preempted: its blocks go back (its full ones stay cached) and it waits
at the queue's head, to prefill everything it has so far again when blocks free up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from llamactl.serve.blocks import BlockPool, chain
from llamactl.serve.plan import Decode, Event, Params, Prefill, Request, StepPlan, Verify


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
    read_wait_s: float = 0.0  # waiting for a launched step's tokens (the device still computing them)
    grammar_s: float = 0.0  # in grammars' matchers (following tokens, making masks), wall time on this thread
    grammar_cpu_s: float = 0.0  # of it, this thread's CPU (the rest: waiting for the GIL, the fill's threads)
    masked_steps: int = 0  # decode steps launched in two parts (a grammar's rows: forward, then the draw)
    masked_host_s: float = 0.0  # their host part: from the forward's launch to the draw's (the last
    # step's tokens read and handed out, the matchers followed, the masks made and sent)
    gather_s: float = 0.0  # waiting, from idle, for a burst's other requests (Scheduler._gather)
    mixed_rows: int = 0  # of decode_rows, those a prefill forward carried (a mixed step: no decode step of its own)
    verify_steps: int = 0  # speculative steps (a row's last token and its proposals in one forward)
    verify_s: float = 0.0
    spec_proposed: int = 0  # proposals checked
    spec_accepted: int = 0  # of them, kept
    preemptions: int = 0  # requests whose blocks were taken back mid-generation (recomputed later)
    kernel_first_uses: int = 0  # kernel variants compiled or loaded after the warm-up (a step waited for each)

    def prefilled(self, seconds: float, tokens: int) -> None:
        self.prefill_s += seconds
        self.prefill_forwards += 1
        self.prefill_tokens += tokens
        self.prefill_max_s = max(self.prefill_max_s, seconds)


class QueueFull(Exception):
    """Every row is taken (by a running request or one queued for it) and --max-queue more wait."""


class Rejected(Exception):
    """The engine cannot take this request (stopping, failed, or it does not fit the context)."""


BATCH_PREFILL_TOKENS = 8192  # prompt tokens prefilled in one forward when no row decodes, or in a burst
# From idle, the scheduler waits while requests keep arriving, each within gather_s of the last, for
# at most GATHER_SPAN gather_s from the first (a burst then goes through one prefill forward: see
# Scheduler._gather; the window's measurements: docs/results.md). A burst of one (the requests that
# arrived within the span of the first, last time the engine went from idle) turns the next wait
# off: a lone client's request is not held for others that do not come; the first burst after it
# is then split once (its first request goes alone), the next gathered.
GATHER_SPAN = 10
IDLE_WAKE_S = 0.5  # an idle engine's wait wakes this often (a SIGTERM's handler runs on this thread)
SPEC_REST = 8  # tokens a row that found nothing to propose decodes plainly before it proposes again


def buckets(max_batch: int) -> list[int]:
    """Decode step sizes (rows): powers of two to 32, then every 32 (a step of n rows runs the
    smallest bucket >= n: at most 32 rows or 2x computed for nothing), and max_batch."""
    small = [2**i for i in range(6) if 2**i < max_batch]
    return sorted(set(small + list(range(32, max_batch, 32)) + [max_batch]))


class Scheduler:
    """The queue, the batch rows and the KV blocks. submit(), stop() and the counters from any
    thread; the rest on the engine's. gpu: a step's prompt chunks go through one forward, packed
    (on the CPU one at a time, so the float32 sums, and so the tokens, are those of `generate`),
    and mix (None: gpu) the step's decode rows with them. speculate: (k, rows): while no prompt is
    prefilling and at most `rows` rows run, a step checks up to k proposals a row (verify()).
    pool: the KV blocks (serve.blocks.BlockPool; its block count and size are the paged cache's)."""

    def __init__(self, max_batch: int, max_queue: int, max_seq: int, prefill_chunk: int, gpu: bool,
                 gather_s: float, times: EngineTimes | None = None, clock: Callable[[], float] = time.perf_counter,
                 pool: BlockPool | None = None, mix: bool | None = None, speculate: tuple[int, int] = (0, 0),
                 model_draft: bool = False):
        self.max_batch, self.max_queue, self.max_seq = max_batch, max_queue, max_seq
        self.prefill_chunk, self.gather_s, self.clock = prefill_chunk, gather_s, clock
        self.times = times or EngineTimes()
        # a pool as large as a fixed grid of max_batch rows of max_seq where none is given (tests)
        self.use_pool(pool or BlockPool(max_batch * -(-max_seq // 16) + 1, 16))
        self.batch_prefill = gpu  # a step's prompt chunks in one packed forward
        self.mix = gpu if mix is None else mix  # ... which carries the step's decode rows too (with batch_prefill)
        self.spec_k, self.spec_rows = speculate  # proposals a row at most, while at most spec_rows decode
        self.model_draft = model_draft  # a draft model proposes (verified()), not prompt lookup
        self.buckets = buckets(max_batch)
        self.slots: list[Request | None] = [None] * max_batch
        self.queue: deque[Request] = deque()
        self.cv = threading.Condition()
        self.stopping = False
        self.failure: str | None = None  # set when a step failed: nothing is taken then
        self._tables: dict[int, list[int]] = {}  # rows whose blocks changed since the last plan
        self._burst_start = 0.0  # the first arrival since the engine last went from idle
        self._burst_size = 2  # requests admitted that arrived within the span of it (2: gather the first time)

    # -- any thread --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def mixing(self) -> bool:
        """A step's decode step is planned with its plan, to ride in its packed prefill forward."""
        return self.mix and self.batch_prefill

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def use_pool(self, pool: BlockPool) -> None:
        """The KV blocks admission draws on from now (before any request: the engine's measured pool)."""
        self.pool = pool
        self.block_size = pool.block_size
        # blocks kept free at admission for the running requests' next tokens (fewer preemptions)
        self.watermark = max(1, pool.blocks // 100)

    def fits(self, prompt_len: int, max_tokens: int) -> str | None:
        """Why a prompt of prompt_len tokens and max_tokens new ones do not fit, or None."""
        if prompt_len < 1:
            return "the prompt is empty"
        if prompt_len >= self.max_seq:
            return f"the prompt has {prompt_len} tokens; this server's context is {self.max_seq}"
        if prompt_len + max_tokens > self.max_seq:
            return (f"the prompt's {prompt_len} tokens + max_tokens {max_tokens} exceed this server's context "
                    f"of {self.max_seq}")
        need = -(-(prompt_len + max_tokens) // self.block_size)
        if need > self.pool.blocks - 1:
            return (f"the prompt's {prompt_len} tokens + max_tokens {max_tokens} need {need} KV blocks; this "
                    f"server's cache holds {self.pool.blocks - 1} ({(self.pool.blocks - 1) * self.block_size} tokens)")
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
        """Wait for work, drop the cancelled, pack the rows, admit into free rows (after a gather
        wait from idle), plan this step's prefills; None once stopped with nothing left. busy: a
        step is in flight."""
        with self.cv:
            while not self.stopping and self._idle(busy):
                # never for good: a signal that came while this thread ran C code (its handler
                # pending, no EINTR to come) must find the loop back in Python within IDLE_WAKE_S
                self.cv.wait(IDLE_WAKE_S)
            if self.stopping and self._idle(busy):
                return None
            plan = StepPlan()
            if not any(self.slots) and not busy:  # from idle: a new burst
                alone = self._burst_size == 1  # the last one was one request
                self._burst_start, self._burst_size = self.queue[0].arrived, 0
                if self.gather_s and not alone:
                    self._gather()
            for r in [r for r in self.slots if r is not None and r.cancelled]:
                self._free_row(r)
                plan.cancelled.append(r)
            plan.moves = self._pack()
            plan.joined = self._admit(plan.cancelled)
        plan.speculate = self._speculating()
        if self.mixing and not plan.speculate:
            plan.decode = self.decode()
        plan.prefills = self._prefills()
        plan.tables, self._tables = self._tables, {}
        if plan.decode is not None:  # its rows' tables are set with the plan's
            plan.tables, plan.decode.tables = {**plan.decode.tables, **plan.tables}, {}
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

    def _pack(self) -> list[tuple[int, int]]:
        """Under self.cv: move the highest running rows into the free rows below them, so the
        running requests hold rows 0..n-1; returns the moves (src, dst)."""
        moves = []
        while True:
            hole = next((i for i, r in enumerate(self.slots) if r is None), None)
            top = max((i for i, r in enumerate(self.slots) if r is not None), default=-1)
            if hole is None or top < hole:
                return moves
            r = self.slots[top]
            self.slots[hole], self.slots[top], r.slot = r, None, hole
            moves.append((top, hole))
            self._tables[top] = []
            self._tables.pop(hole, None)  # the move brings its table

    def _admit(self, cancelled: list[Request]) -> list[Request]:
        # under self.cv: first come, first served, into the free rows, while the blocks last
        joined = []
        pending = None  # names of the prompt blocks running rows will compute and have not planned
        while self.queue:
            if self.queue[0].cancelled:
                cancelled.append(self.queue.popleft())
                continue
            free = next((i for i, r in enumerate(self.slots) if r is None), None)
            if free is None:
                break
            if pending is None:
                pending = {h for r in self.slots if r is not None for h in r.names[r.named:]}
            head = self.queue[0]
            hits = self._cached_prefix(head)
            if self._shares_pending(head, hits, pending) or not self._take_blocks(head, hits, busy=any(self.slots)):
                break
            r = self.queue.popleft()
            r.slot = free
            self.slots[free] = r
            self._tables[free] = list(r.blocks)
            pending.update(r.names[r.named:])
            joined.append(r)
            if r.arrived <= self._burst_start + GATHER_SPAN * self.gather_s:
                self._burst_size += 1
        return joined

    def _cached_prefix(self, r: Request) -> list[int]:
        """Name r's full blocks of everything it prefills (r.target, r.names; a preempted request
        prefills its output so far too) -> the cached blocks of its longest prefix, at least one
        token left to compute (none for a scored prompt: every position computed)."""
        r.target = len(r.tokens)
        r.names = chain(r.tokens, self.block_size, self.pool.salt)
        if r.params.prompt_logprobs is not None and len(r.prompt_scores) < r.prompt_len - 1:
            return []
        return self.pool.match(r.names[: (r.target - 1) // self.block_size])

    def _shares_pending(self, r: Request, hits: list[int], pending: set) -> bool:
        """Whether the first prompt block r would compute (after its cached `hits`) is one a
        running row computes and has not planned yet: r then waits for the next plan and reuses it
        (SGLang's in-batch prefix caching: a burst sharing a system prompt prefills it once, not
        once a request). A request that asks for prompt scores never waits."""
        if not pending or not self.pool.prefix_cache or r.params.prompt_logprobs is not None:
            return False
        full = (r.target - 1) // self.block_size
        return len(hits) < full and r.names[len(hits)] in pending

    def _take_blocks(self, r: Request, hits: list[int], busy: bool) -> bool:
        """Give r the blocks of everything it prefills: its cached prefix `hits` (_cached_prefix),
        new blocks for the rest; False (nothing taken) where the pool cannot spare them (keeping
        `watermark` free while others run)."""
        bs = self.block_size
        need = -(-r.target // bs) - len(hits)
        if need > self.pool.available - (self.watermark if busy else 0) - self._idle_in(hits):
            return False
        self.pool.hold(hits)
        self.pool.count(r.target, len(hits) * bs)
        r.blocks = hits + self.pool.allocate(need)
        r.named = len(hits)
        r.prefilled = len(hits) * bs
        if r.target == r.prompt_len:
            r.cached = r.prefilled
        return True

    def _idle_in(self, blocks: list[int]) -> int:
        """How many of these cached blocks are idle (counted in `available` until held)."""
        return sum(self.pool.idle(b) for b in blocks)

    def release(self, r: Request) -> None:
        """r finished or was cancelled: free its row and its blocks (or take it off the queue)."""
        with self.cv:
            if r.slot is not None and self.slots[r.slot] is r:
                self._free_row(r)
            elif r in self.queue:
                self.queue.remove(r)

    def _free_row(self, r: Request) -> None:
        """Its row free (its table the null block's), its blocks back: full blocks whose tokens are
        known and computed named first, so a later prompt that repeats them reuses them."""
        self.slots[r.slot] = None
        self._tables[r.slot] = []
        self._name_blocks(r, min(len(r.tokens) - 1, r.computed))
        self.pool.release(r.blocks)
        r.blocks, r.slot = [], None

    def _name_blocks(self, r: Request, upto: int) -> None:
        """Name r's full blocks of positions below upto (their K/V computed or on their way)."""
        full = min(upto // self.block_size, len(r.blocks))
        if full > len(r.names):  # blocks of its output: the chain goes on from its prompt's
            parent = r.names[-1] if r.names else None
            r.names += chain(r.tokens[: full * self.block_size], self.block_size, self.pool.salt, parent,
                             len(r.names) * self.block_size)
        for j in range(r.named, full):
            self.pool.name(r.blocks[j], r.names[j])
        r.named = max(r.named, full)

    def _prefills(self) -> list[Prefill]:
        """Prompt chunks, first come first, within this step's token budget: prefill_chunk tokens
        while rows decode (they wait for it), max(BATCH_PREFILL_TOKENS, prefill_chunk) where none
        do or more are starting than decoding (a burst: one forward for many is fairer than a
        chunk a step, which delays each one behind the others' chunks and the steps between).
        Where batch_prefill (a GPU) the chunks go through one forward, packed; else one forward
        each, whole prompts where no row decodes (the CPU: the float32 sums, and so the tokens,
        are those of `generate`). Each planned prompt token counts as computed from here (the
        runner runs the plan before anything reads it)."""
        decoding = sum(r is not None and r.decoding for r in self.slots)
        starting = sum(r is not None and r.prefilled == 0 for r in self.slots)
        if self.batch_prefill:
            burst = not decoding or starting > decoding
            budget = max(BATCH_PREFILL_TOKENS, self.prefill_chunk) if burst else self.prefill_chunk
        else:
            budget = self.prefill_chunk if decoding else None
        chunks = []
        for r in sorted((r for r in self.slots if r is not None and not r.decoding), key=lambda r: r.id):
            if budget is not None and budget <= 0:
                break
            n = r.target - r.prefilled if budget is None else min(budget, r.target - r.prefilled)
            chunks.append(Prefill([r], [r.tokens[r.prefilled : r.prefilled + n]], [r.prefilled],
                                  [r.prefilled + n == r.target]))
            self._planned(r, r.prefilled + n)
            if budget is not None:
                budget -= n
        if not self.batch_prefill or len(chunks) < 2:
            return chunks
        return [Prefill([r for c in chunks for r in c.requests], [c.ids[0] for c in chunks],
                        [c.starts[0] for c in chunks], [c.ends[0] for c in chunks])]

    def _planned(self, r: Request, upto: int) -> None:
        """r's tokens below upto are planned: its full blocks there are named now (a prompt that
        joins later reuses them; the stream runs this forward first), and at its target its first
        output token comes from this forward."""
        r.prefilled = upto
        self._name_blocks(r, upto)
        if upto == r.target:
            r.launched = r.target - r.prompt_len + 1

    def decode(self) -> Decode | None:
        """The decode step of the rows that still have tokens to compute, or None; gives each the
        block its new position needs (preempting the newest requests where the pool has none);
        counts their next tokens as launched."""
        with self.cv:
            live = self._grow([r for r in self.slots if r is not None and r.decoding
                               and r.launched < r.params.max_tokens])
        if not live:
            return None
        b = next(b for b in self.buckets if b > max(r.slot for r in live))
        pos = [0 if r is None else min(r.pos, self.max_seq - 1) for r in self.slots[:b]]
        greedy = all(r.params.sampling.greedy for r in self.slots[:b] if r is not None)
        kv_len = min(self.max_seq, -(-(max(pos) + 1) // 64) * 64)
        for r in live:
            r.launched += 1
        tables, self._tables = self._tables, {}
        return Decode(live, b, pos, kv_len, greedy, [r.slot for r in live], tables)

    def _speculating(self) -> bool:
        """Whether this step is a verify step: speculation on, no prompt prefilling, 1..spec_rows
        rows, one of them proposing again (spec_after), none asking for log-probabilities or
        adjusting its logits (a verify step records none, and counts no tokens)."""
        rows = [r for r in self.slots if r is not None]
        return (self.spec_k > 0 and 0 < len(rows) <= self.spec_rows and all(r.decoding for r in rows)
                and not any(r.params.logprobs is not None or r.params.sampling.adjusts_logits
                            or r.params.grammar is not None for r in rows)
                and any(r.params.speculate and r.launched >= r.spec_after for r in rows))

    def verify(self, proposals: dict[int, list[int]]) -> Verify | None:
        """The verify step of the rows that still have tokens to compute (every token they were
        given read): each one's last token, then proposals[its id] (cut to its token limit), with
        the blocks their positions need (preempting as decode() does); None where none is left."""
        with self.cv:
            live = [r for r in self.slots if r is not None and r.decoding and r.launched < r.params.max_tokens]
            drafts = {r.id: proposals.get(r.id, [])[: r.params.max_tokens - r.launched - 1] for r in live}
            live = self._grow(live, {r.id: len(drafts[r.id]) for r in live})
        if not live:
            return None
        tables, self._tables = self._tables, {}
        return Verify(live, [[r.tokens[-1]] + drafts[r.id] for r in live], [r.pos for r in live], tables)

    def reserve(self, rows: list[Request], ahead: dict[int, int]) -> tuple[list[Request], dict[int, list[int]]]:
        """Blocks for rows' next positions and ahead[its id] after them (a draft model's proposals,
        whose K/V it writes before the verify step), preempting as decode() does -> the rows still
        running and the table rows to set before the draft runs."""
        with self.cv:
            live = self._grow(rows, ahead)
        tables, self._tables = self._tables, {}
        return live, tables

    def bucket(self) -> int:
        """The batch bucket a step of the running rows runs (rows 0..b-1)."""
        top = max(r.slot for r in self.slots if r is not None)
        return next(b for b in self.buckets if b > top)

    def rest(self, r: Request) -> None:
        """r found nothing to propose: it decodes plainly for SPEC_REST tokens."""
        r.spec_after = r.launched + SPEC_REST

    def verified(self, r: Request, kept: int, proposed: int) -> None:
        """r's verify step kept `kept` of its `proposed` proposals (and added a token of its own):
        its next step proposes one more than it kept (at most spec_k); a row that proposed nothing,
        or had its one proposal refused, sits out SPEC_REST tokens (a verify step is read before
        the next is planned: plain steps run a step ahead). A draft model always proposes, two
        more than it kept: on the embedded model's int4 copy that took 78 target forwards for 256
        tokens where this rule took 96 (docs/decisions/2026-12-07-model-drafts.md)."""
        r.launched += kept + 1
        r.spec_k = min(self.spec_k, kept + (2 if self.model_draft else 1))
        if not self.model_draft and (not proposed or (proposed == 1 and not kept)):
            self.rest(r)
        self.times.spec_proposed += proposed
        self.times.spec_accepted += kept

    def _grow(self, live: list[Request], ahead: dict[int, int] | None = None) -> list[Request]:
        """Under self.cv: a block for each live row whose next position (and ahead[its id] after it)
        starts one; where the pool is out, the newest running request is preempted (possibly one
        of these) until it is not. Returns the rows still live."""
        for r in sorted(live, key=lambda r: r.id):
            if r.slot is None:  # preempted below for an older one
                continue
            while (r.pos + (ahead or {}).get(r.id, 0)) // self.block_size >= len(r.blocks):
                if self.pool.available:
                    r.blocks += self.pool.allocate(1)
                    self._tables[r.slot] = list(r.blocks)
                    continue
                self._preempt(max((x for x in self.slots if x is not None), key=lambda x: x.id))
                if r.slot is None:
                    break
        return [r for r in live if r.slot is not None]

    def _preempt(self, r: Request) -> None:
        """Under self.cv: r's row and blocks back; it waits at the queue's head to prefill all its
        tokens again (its full blocks stay cached, so most of that is a prefix hit)."""
        self._free_row(r)
        r.prefilled = r.launched = r.drafted = 0
        r.names, r.named = [], 0
        self.queue.appendleft(r)
        self.times.preemptions += 1
