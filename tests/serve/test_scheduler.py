"""The scheduler alone: no model, no torch, a fake clock. Admission into rows, prefill budgets and
chunks, the decode plan, cancellation, the gather wait."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llamactl.serve.plan import Params
from llamactl.serve.scheduler import GATHER_SPAN, QueueFull, Rejected, Scheduler
from llamactl.runtime.settings import Sampling


class FakeClock:
    """time.perf_counter's stand-in; a wait on FakeCondition moves it on."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCondition:
    """threading.Condition's stand-in for the engine's thread alone: wait(t) advances the clock by
    t and runs what `arrivals` schedules for that time (requests arriving while it waits)."""

    def __init__(self, clock: FakeClock):
        self.clock, self.arrivals, self.waits = clock, [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def notify(self):
        pass

    def wait(self, timeout=None):
        assert timeout is not None, "the scheduler would block forever"
        self.waits.append(timeout)
        end = self.clock.now + timeout
        while self.arrivals and self.arrivals[0][0] <= end:
            at, fn = self.arrivals.pop(0)
            self.clock.now = at
            fn()
            return  # notified
        self.clock.now = end


def make(max_batch=4, max_queue=8, max_seq=64, chunk=512, gpu=False, gather_s=0.0, mix=False):
    clock = FakeClock()
    s = Scheduler(max_batch, max_queue, max_seq, chunk, gpu, gather_s, clock=clock, mix=mix)
    s.cv = FakeCondition(clock)
    return s, clock


_first = iter(range(1000, 10**9, 10**4))


def submit(s, n=5, max_tokens=4, temperature=0.0, tokens=None):
    """A request of n tokens of its own (no prefix shared with another's), or of `tokens`."""
    first = next(_first)
    ids = tokens if tokens is not None else list(range(first, first + n))
    return s.submit(ids, Params(max_tokens, Sampling(temperature=temperature)), lambda ev: None)


def test_the_scheduler_imports_no_torch():
    code = "import sys, llamactl.serve.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_admission_fills_free_rows_first_come_and_the_rest_wait():
    s, _ = make(max_batch=2)
    reqs = [submit(s, n) for n in (3, 5, 7)]
    plan = s.schedule(busy=False)
    assert plan.joined == reqs[:2] and [r.slot for r in reqs[:2]] == [0, 1] and s.waiting == 1
    # no row decodes: every joined prompt whole, one forward each on the CPU (not batch_prefill)
    assert [(p.requests, p.starts, [len(c) for c in p.ids], p.ends) for p in plan.prefills] == \
        [([reqs[0]], [0], [3], [True]), ([reqs[1]], [0], [5], [True])]
    assert all(r.decoding and r.launched == 1 and r.computed == r.prompt_len for r in reqs[:2])
    step = s.decode()
    assert (step.requests, step.rows, step.positions, step.greedy) == (reqs[:2], 2, [3, 5], True)
    assert [r.launched for r in reqs[:2]] == [2, 2] and reqs[0].pos == 4


def test_a_prompt_joining_decoding_rows_is_chunked_within_the_budget():
    s, _ = make(chunk=4)
    first = submit(s, 3, max_tokens=20)
    s.schedule(busy=False)
    s.decode()
    long = submit(s, 10)
    chunks = []
    for _ in range(3):
        plan = s.schedule(busy=True)
        chunks += [(p.starts[0], [t - long.tokens[0] + 1 for t in p.ids[0]], p.ends[0]) for p in plan.prefills]
        step = s.decode()
        assert step.requests == ([first, long] if long.decoding else [first])
        if long.decoding:  # its first step feeds the prefill's token, at the position after the prompt
            assert step.rows == 2 and step.positions[long.slot] == long.prompt_len
    assert chunks == [(0, [1, 2, 3, 4], False), (4, [5, 6, 7, 8], False), (8, [9, 10], True)]


def test_gpu_packs_a_steps_chunks_into_one_forward_within_the_budget():
    """On a GPU the prompts that joined go through one forward, packed unpadded; while rows decode
    (and no more are starting than decoding) the chunks stop at prefill_chunk tokens, the last
    one cut mid-prompt and finished the next step."""
    s, _ = make(max_seq=256, chunk=32, gpu=True)
    a, b = submit(s, 5), submit(s, 20)
    (p,) = s.schedule(busy=False).prefills
    assert (p.requests, [len(c) for c in p.ids], p.starts, p.ends, p.whole) == ([a, b], [5, 20], [0, 0], [True] * 2, True)
    c, d = submit(s, 20), submit(s, 20)
    s.decode()
    s.schedule(busy=True)  # two starting, two decoding: 32 tokens this step
    (p,) = s.schedule(busy=True).prefills
    assert (p.requests, [len(x) for x in p.ids], p.starts, p.ends) == ([d], [8], [12], [True])
    assert c.decoding and d.decoding and not p.whole


def test_a_mixed_step_plans_the_rows_decoding_already_and_its_tables_go_with_the_plan():
    """Where the scheduler mixes (a GPU), schedule() plans the decode step before the prefills: of
    the rows decoding already (a prompt whose last chunk is in this step's forward decodes from the
    next), the blocks they grew and the joiners' tables all in the plan's tables."""
    s, _ = make(max_seq=256, chunk=8, gpu=True, mix=True, max_batch=4)
    a = submit(s, 16, max_tokens=40)
    first = s.schedule(busy=False)
    assert first.decode is None and first.prefills[0].requests == [a]  # nothing decoded before it
    b = submit(s, 12)
    plan = s.schedule(busy=True)  # a decodes at 16 (a new block), b's first 8 tokens
    assert plan.decode.requests == [a] and plan.decode.positions[a.slot] == 16 and plan.decode.tables == {}
    assert plan.prefills[0].requests == [b] and plan.tables[a.slot] == a.blocks and plan.tables[b.slot] == b.blocks
    plan = s.schedule(busy=True)  # b's last 4 tokens: b decodes from the next step on
    assert plan.decode.requests == [a] and plan.prefills[0].ends == [True] and b.decoding
    plan = s.schedule(busy=True)
    assert plan.decode.requests == [a, b] and plan.prefills == [] and plan.decode.positions[b.slot] == 12


def test_decode_steps_the_smallest_bucket_holding_every_row_and_stops_at_max_tokens():
    s, _ = make(max_batch=8)
    reqs = [submit(s, 2, max_tokens=2, temperature=0.5 * (i == 2)) for i in range(3)]
    s.schedule(busy=False)
    step = s.decode()
    assert step.rows == 4 and step.positions == [2, 2, 2, 0] and not step.greedy
    assert s.decode() is None  # each has both tokens launched: the prefill's and this step's
    s.release(reqs[0])
    s.release(reqs[1])
    assert s.running == 1 and reqs[2].slot == 2


def test_cancelled_requests_leave_the_queue_and_their_rows():
    s, _ = make(max_batch=1)
    running, queued = submit(s), submit(s)
    s.schedule(busy=False)
    queued.cancel()
    running.cancel()
    plan = s.schedule(busy=True)
    assert set(plan.cancelled) == {queued, running} and s.running == 0 and s.waiting == 0 and plan.prefills == []


def test_what_does_not_fit_is_rejected_and_a_full_queue_refused():
    s, _ = make(max_batch=1, max_queue=1, max_seq=16)
    with pytest.raises(Rejected, match="the prompt has 16 tokens; this server's context is 16"):
        submit(s, 16)
    with pytest.raises(Rejected, match=r"\+ max_tokens 12 exceed this server's context of 16"):
        submit(s, 5, max_tokens=12)
    with pytest.raises(Rejected, match="the prompt is empty"):
        s.submit([], Params(1), lambda ev: None)
    submit(s)  # for the free row
    submit(s)  # waiting for a row
    with pytest.raises(QueueFull):
        submit(s)
    s.stop()
    with pytest.raises(Rejected, match="is stopping"):
        submit(s)
    plan = s.schedule(busy=False)  # stopping cancelled both: the engine finishes them
    assert len(plan.cancelled) == 2 and all(r.cancelled for r in plan.cancelled) and plan.joined == []
    assert s.schedule(busy=False) is None
    s2, _ = make()
    left = [submit(s2), submit(s2)]
    s2.schedule(busy=False)
    left.append(submit(s2))
    assert s2.fail("RuntimeError: boom") == [left[2], left[0], left[1]] and s2.running == s2.waiting == 0
    with pytest.raises(Rejected, match="failed: RuntimeError: boom"):
        submit(s2)


def test_from_idle_a_burst_is_gathered_while_arrivals_keep_coming():
    gather = 0.010
    s, clock = make(max_batch=8, gpu=True, gather_s=gather)
    submit(s)
    # three more, 8 ms apart (each within the window of the last), then nothing
    s.cv.arrivals = [(0.008 * i, lambda: submit(s)) for i in (1, 2, 3)]
    plan = s.schedule(busy=False)
    (p,) = plan.prefills
    assert len(p.requests) == 4 and s.times.gather_s == pytest.approx(0.034)  # the last arrival + 10 ms
    assert clock.now <= GATHER_SPAN * gather


def test_a_lone_request_turns_the_next_gather_off():
    s, clock = make(gpu=True, gather_s=0.010)
    r = submit(s, max_tokens=1)
    s.schedule(busy=False)  # waits the window for others that do not come: a burst of one
    assert s.times.gather_s == pytest.approx(0.010)
    s.release(r)
    clock.now = 1.0
    submit(s)
    s.schedule(busy=False)
    assert s.times.gather_s == pytest.approx(0.010)  # not held this time


def test_max_queue_counts_only_requests_waiting_for_a_row():
    """--max-queue 0: an idle server takes as many requests as it has free rows, and refuses the next."""
    s, _ = make(max_batch=2, max_queue=0)
    a, b = submit(s), submit(s)
    with pytest.raises(QueueFull, match="0 requests running and 2 waiting"):
        submit(s)
    s.schedule(busy=False)
    with pytest.raises(QueueFull, match="2 requests running and 0 waiting"):
        submit(s)
    s.release(a)
    submit(s)
