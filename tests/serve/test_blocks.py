"""The KV block pool alone (no torch): reference counts, prefix names, LRU eviction; and the
scheduler's use of it: packed rows, prefix hits, admission by blocks, preemption."""

from __future__ import annotations

from llamactl.serve.blocks import BlockPool, chain
from llamactl.serve.plan import Params
from llamactl.serve.scheduler import Scheduler, buckets
from test_scheduler import FakeClock, FakeCondition
from llamactl.runtime.settings import Sampling


def test_chain_names_full_blocks_by_everything_before_them():
    a, b = chain(list(range(10)), 4), chain(list(range(10)), 4, salt=b"other model")
    assert len(a) == 2 and a != b and a[0] != b[0]
    assert chain([9] + list(range(1, 10)), 4)[1] != a[1]  # same tokens in block 1, another block 0
    assert chain(list(range(12)), 4, parent=a[1], start=8)[0] == chain(list(range(12)), 4)[2]


def test_pool_keeps_named_blocks_and_evicts_the_least_recently_used():
    pool = BlockPool(5, 4)
    x, y = pool.allocate(2), pool.allocate(2)
    assert 0 not in x + y and pool.available == 0
    names = chain(list(range(8)), 4)
    pool.name(x[0], names[0]), pool.name(x[1], names[1])
    pool.release(x)
    pool.release(y)
    assert pool.available == 4 and pool.cached == 2
    assert pool.match(names) == x and pool.match(chain([7] * 8, 4)) == []
    pool.hold(x[:1])  # a sequence reuses the first block; the second stays idle
    got = pool.allocate(3)  # 2 free + the idle named one
    assert x[1] in got and pool.evicted == 1 and pool.match(names) == x[:1]
    unnamed = BlockPool(5, 4, prefix_cache=False)
    b = unnamed.allocate(1)
    unnamed.name(b[0], names[0])
    assert unnamed.match(names) == [] and unnamed.cached == 0


def _sched(blocks, max_batch=4, block_size=4, max_seq=64):
    s = Scheduler(max_batch, 8, max_seq, 512, False, 0.0, clock=FakeClock(), pool=BlockPool(blocks, block_size))
    s.cv = FakeCondition(s.clock)
    return s


def _submit(s, ids, max_tokens=8):
    return s.submit(ids, Params(max_tokens, Sampling(temperature=0.0)), lambda ev: None)


def test_a_request_reuses_the_cached_full_blocks_of_its_prefix():
    s = _sched(40)
    first = _submit(s, list(range(1, 14)))  # 13 tokens: 3 full blocks of 4
    s.schedule(busy=False)
    s.release(first)
    again = _submit(s, list(range(1, 13)) + [99, 98])
    plan = s.schedule(busy=False)
    (p,) = plan.prefills
    assert again.cached == 12 and p.starts == [12] and [len(c) for c in p.ids] == [2]
    assert again.blocks[:3] == first_blocks(s, again) and s.pool.hit_tokens == 12
    whole = _submit(s, list(range(1, 13)))  # all 12 tokens cached: the last block is computed again
    (p,) = s.schedule(busy=True).prefills
    assert whole.cached == 8 and p.starts == [8] and [len(c) for c in p.ids] == [4]


def first_blocks(s, r):
    return [s.pool.match(r.names)[i] for i in range(3)]


def test_rows_are_packed_and_a_step_runs_the_smallest_bucket():
    s = _sched(100, max_batch=8)
    reqs = [_submit(s, [i * 100 + j for j in range(3)]) for i in range(8)]
    s.schedule(busy=False)
    for r in reqs[:6]:
        r.cancel()
    plan = s.schedule(busy=True)
    assert plan.moves == [(7, 0), (6, 1)] and reqs[7].slot == 0 and reqs[6].slot == 1
    assert plan.tables[6] == [] and plan.tables[7] == []  # the rows left point at the null block
    step = s.decode()
    assert step.rows == 2 and step.at == [0, 1] and step.requests == [reqs[7], reqs[6]]
    assert buckets(256)[:8] == [1, 2, 4, 8, 16, 32, 64, 96] and buckets(256)[-1] == 256


def test_admission_waits_for_blocks_and_the_newest_is_preempted_when_they_run_out():
    s = _sched(9, max_batch=4)  # 8 blocks of 4 tokens
    a, b = _submit(s, list(range(7)), max_tokens=20), _submit(s, list(range(50, 57)), max_tokens=20)
    c = _submit(s, list(range(80, 95)))  # 4 blocks: not while a and b hold 4 and 1 must stay free
    s.schedule(busy=False)
    assert a.slot is not None and b.slot is not None and c.slot is None and s.waiting == 1
    for _ in range(12):  # a and b grow a block each every 4 tokens: 8 blocks last until b is preempted
        s.decode()
        for r in (a, b):
            r.tokens.append(1)
        if s.times.preemptions:
            break
    assert s.times.preemptions == 1 and b.slot is None and s.queue[0] is b and a.slot == 0
    assert "KV blocks" in s.fits(20, 20)  # 10 blocks can never fit 8


def test_a_measured_pool_takes_the_fraction_left_beside_the_warm_up_peak():
    from llamactl.serve.runner import MARGIN_BYTES, blocks_left

    gib = 1 << 30
    # an 80 GiB card: 16 GiB in use without a pool, a warm-up that took 14 GiB at its peak
    got = blocks_left(total=80 * gib, used=16 * gib, warm_up=14 * gib, fraction=0.9, block_bytes=gib // 2)
    assert got == int((72 * gib - 30 * gib - MARGIN_BYTES) // (gib // 2)) + 1
    assert blocks_left(80 * gib, 26 * gib, 14 * gib, 0.9, gib // 2) == got - 20  # 10 GiB more in use
    assert blocks_left(80 * gib, 16 * gib, 60 * gib, 0.9, gib // 2) < 2  # the runner refuses fewer than 2


def test_only_one_gpu_without_kv_memory_measures_its_pool():
    from llamactl.serve.engine import KvOptions, measured_fraction

    assert measured_fraction(KvOptions(), gpu=True, tensor_parallel=False) == 0.9
    assert measured_fraction(KvOptions(gpu_fraction=0.5), True, False) == 0.5
    assert measured_fraction(KvOptions(memory_gib=16), True, False) is None
    assert measured_fraction(KvOptions(), False, False) is None and measured_fraction(KvOptions(), True, True) is None


def test_a_burst_sharing_a_prefix_prefills_it_once():
    s = _sched(60, max_batch=4)
    shared = list(range(1, 13))  # 3 full blocks of 4
    reqs = [_submit(s, shared + [50 + i, 60 + i]) for i in range(3)]
    other = _submit(s, [7, 8, 9])
    first = s.schedule(busy=False)
    assert first.joined == reqs[:1]  # the others wait for its blocks
    (p,) = first.prefills
    assert [len(c) for c in p.ids] == [14]
    second = s.schedule(busy=True)
    assert second.joined == reqs[1:] + [other]
    assert [r.cached for r in reqs[1:]] == [12, 12] and s.pool.hit_tokens == 24
    assert sorted(len(c) for p in second.prefills for c in p.ids) == [2, 2, 3]
    off = Scheduler(4, 8, 64, 512, False, 0.0, clock=FakeClock(), pool=BlockPool(60, 4, prefix_cache=False))
    off.cv = FakeCondition(off.clock)
    burst = [_submit(off, shared + [50 + i]) for i in range(3)]
    assert off.schedule(busy=False).joined == burst  # nothing to reuse: nobody waits
