"""The serving engine on its own (no HTTP): continuous batching over the paged cache on the
embedded trained model (CPU float32), each request's tokens against `llamactl generate`'s; the
GPU's ways (a step ahead, prompt chunks packed in one forward, the gather wait) forced on the CPU."""

from __future__ import annotations

import time

import pytest

from llamactl.runtime import generate as gen
from llamactl.runtime.settings import Sampling

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "Hello", "In 1905, Albert Einstein",
           "A list of fruits: apple,", "The quick brown fox", "Water boils at"]


def reference(embedded, prompt: str, n: int) -> str:
    """What `llamactl generate --temperature 0 -n N` prints for the prompt (the same core)."""
    art, model, tok = embedded
    events = gen.generate(model, tok, tok(prompt).input_ids, n, gen.Sampling(temperature=0), gen.eos_ids(model, tok, art))
    return next(e for e in events if isinstance(e, gen.Result)).text


@pytest.fixture
def prefills_together(monkeypatch) -> list[int]:
    """The chunks of each packed prefill forward (Decoder.prefill_packed), in order."""
    from llamactl.runtime.step import Decoder

    calls, packed = [], Decoder.prefill_packed
    monkeypatch.setattr(Decoder, "prefill_packed", lambda self, chunks, rows, starts, decode=None, **kw:
                        calls.append(len(chunks)) or packed(self, chunks, rows, starts, decode, **kw))
    return calls


def _run_engine(model, eos, requests, max_batch=4, prefill_chunk=512, overlap=None, kv=None, engine=None,
                logprobs: list[list] | None = None):
    """requests: [(prompt ids, Params)] submitted together -> each one's (tokens, finish reason).
    kv: the KV pool (engine.KvOptions); engine: one made already (not stopped after); logprobs:
    a list per request that gets each token event's logprob."""
    from llamactl.serve.engine import Engine

    eng = engine or Engine(model, eos, max_batch=max_batch, max_queue=16, max_seq=128, prefill_chunk=prefill_chunk,
                           overlap=overlap, kv=kv).start()
    out = [([], None) for _ in requests]

    def cb(i):
        def on(ev):
            if ev.kind == "token":
                out[i][0].append(ev.token)
                if logprobs is not None:
                    logprobs[i].append(ev.logprob)
            else:
                out[i] = (out[i][0], ev.reason)
        return on

    reqs = [eng.submit(ids, p, cb(i)) for i, (ids, p) in enumerate(requests)]
    deadline = time.time() + 120
    while not all(r.finished for r in reqs) and time.time() < deadline:
        time.sleep(0.01)
    if engine is None:
        eng.stop()
    return out


def test_engine_rows_give_the_tokens_they_give_alone(embedded):
    """Rows of different prompt lengths, greedy and sampled with seeds, joining a batch in chunks
    of 4 prompt tokens, each produce exactly the tokens they produce alone (CPU float32)."""
    from llamactl.serve.engine import Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    reqs = [(tok(p).input_ids, Params(6 + 2 * i, Sampling(temperature=0.0 if i % 2 == 0 else 0.9, top_k=0 if i % 3 else 40,
                                                          top_p=1.0 if i % 4 else 0.9, seed=i)))
            for i, p in enumerate(PROMPTS[:6])]
    together = _run_engine(model, eos, reqs, max_batch=3, prefill_chunk=4)  # 6 requests, 3 slots: some wait
    for i, r in enumerate(reqs):
        alone = _run_engine(model, eos, [r], max_batch=3)[0]
        assert together[i] == alone, (i, together[i], alone)
        assert alone[1] in ("length", "stop") and len(alone[0]) <= r[1].max_tokens
    for i in (0, 2, 4):  # greedy rows: the text `llamactl generate` prints
        assert tok.decode(together[i][0], skip_special_tokens=True) == reference(embedded, PROMPTS[i], reqs[i][1].max_tokens)
    sampled = _run_engine(model, eos, [(reqs[1][0], Params(7, Sampling(temperature=0.9, seed=12345)))])[0]
    assert sampled != together[1]  # another seed, other tokens


def test_an_engine_a_step_ahead_gives_the_same_tokens(embedded):
    """The GPU's loop (each step launched before the last one's tokens are read), forced on the
    CPU: the same tokens and finish reasons as one step at a time, with a row that meets EOS while
    its next step is in flight (that token dropped) and its slot taken by a waiting request."""
    from llamactl.serve.engine import Params

    art, model, tok = embedded
    reqs = [(tok(p).input_ids, Params(9, Sampling(temperature=0.0 if i % 2 == 0 else 0.8, seed=i)))
            for i, p in enumerate(PROMPTS[:5])]
    plain = _run_engine(model, set(), reqs[:1], max_batch=2, overlap=False)[0][0]
    eos = {plain[3]}  # the first row stops at its 4th token (or before, if it came earlier)
    one = _run_engine(model, eos, reqs, max_batch=2, prefill_chunk=4, overlap=False)
    ahead = _run_engine(model, eos, reqs, max_batch=2, prefill_chunk=4, overlap=True)
    assert ahead == one
    assert one[0] == (plain[: plain.index(plain[3])], "stop")
    assert all(reason == "length" and len(t) == 9 for t, reason in one[1:] if plain[3] not in t)


def test_engine_refuses_what_does_not_fit_and_a_full_queue(embedded):
    from llamactl.serve.engine import Engine, Params, QueueFull, Rejected

    art, model, tok = embedded
    eng = Engine(model, set(), max_batch=1, max_queue=1, max_seq=64)  # not started: nothing leaves the queue
    with pytest.raises(Rejected, match="exceed this server's context of 64"):
        eng.submit([1] * 10, Params(60), lambda ev: None)
    with pytest.raises(Rejected, match="the prompt has 64 tokens"):
        eng.submit([1] * 64, Params(1), lambda ev: None)
    for _ in range(2):  # one for the free row, one waiting for a row
        eng.submit([1, 2], Params(4), lambda ev: None)
    with pytest.raises(QueueFull):
        eng.submit([1, 2], Params(4), lambda ev: None)


def test_packed_chunks_cut_mid_prompt_give_the_same_tokens(embedded, prefills_together):
    """The GPU's packed prefill (forced on the CPU) with a budget of 8 tokens a step: prompts cut
    into chunks packed with other prompts' chunks, after their earlier chunks in the cache, give
    the tokens of prompts prefilled whole, one at a time (float32); so do they where the decoding
    rows' step rides in those forwards (mixed steps)."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    out = {}
    for packed, mix in ((False, False), (True, False), (True, True)):
        eng = Engine(model, set(), max_batch=4, max_queue=4, max_seq=96, prefill_chunk=8, mix=mix)
        eng.scheduler.batch_prefill = packed
        got = [[], [], [], []]
        on = [(lambda i: lambda ev: ev.kind == "token" and got[i].append(ev.token))(i) for i in range(4)]
        with eng.scheduler.cv:
            running = [eng.submit(tok(p).input_ids, Params(30, Sampling(temperature=0)), on[i])
                       for i, p in enumerate(PROMPTS[:2])]
        eng.start()
        while len(got[0]) < 2:
            time.sleep(0.005)
        with eng.scheduler.cv:  # two join two decoding rows: 8 tokens a step, packed
            reqs = [eng.submit(tok(p).input_ids, Params(10, Sampling(temperature=0)), on[i + 2])
                    for i, p in enumerate(PROMPTS[4:6])]
        while not all(r.finished for r in [*running, *reqs]):
            time.sleep(0.01)
        eng.stop()
        out[packed, mix] = got
        # every token but each request's first (its prefill's) from a decode row
        assert (eng.times.mixed_rows > 0) == mix and eng.times.decode_rows == 2 * 29 + 2 * 9
    assert out[False, False] == out[True, False] == out[True, True] and all(len(g) == 10 for g in out[True, True][2:])
    assert prefills_together[0] == 2 and prefills_together.count(2) >= 4  # the two joined, then the joiners' chunks


def test_prompts_joining_together_prefill_in_one_forward(embedded, prefills_together):
    """Where the engine prefills the prompts that joined at once in one packed forward (the GPU's
    way; forced here on the CPU), every request gets the tokens it gets prefilled alone."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    calls = prefills_together
    out = {}
    for batched in (False, True):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=96, prefill_chunk=64)
        eng.scheduler.batch_prefill = batched
        got = [[] for _ in range(4)]
        reqs = [eng.submit(tok(p).input_ids, Params(8, Sampling(temperature=0 if i % 2 else 0.7, seed=i)),
                           (lambda i: lambda ev: ev.kind == "token" and got[i].append(ev.token))(i))
                for i, p in enumerate(PROMPTS[:4])]
        eng.start()  # all four are queued before the loop starts: they join together
        while not all(r.finished for r in reqs):
            time.sleep(0.01)
        eng.stop()
        out[batched] = got
    assert calls == [4] and out[True] == out[False]


def test_a_burst_is_prefilled_in_one_forward_while_a_row_decodes(embedded, prefills_together):
    """Three prompts arriving while one row decodes (more starting than decoding) go through one
    forward on the GPU's path (forced on the CPU; the decoding row's step in it too), not
    prefill_chunk tokens a step, and each one gets the greedy tokens it gets alone."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    calls = prefills_together
    eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=96, prefill_chunk=4, mix=True)
    eng.scheduler.batch_prefill = True
    got = [[] for _ in range(4)]

    def on(i):
        return lambda ev: ev.kind == "token" and got[i].append(ev.token)

    eng.start()
    first = eng.submit(tok(PROMPTS[0]).input_ids, Params(30, Sampling(temperature=0)), on(0))
    while len(got[0]) < 2:
        time.sleep(0.005)
    with eng.scheduler.cv:  # the loop admits all three at its next step boundary
        burst = [eng.submit(tok(p).input_ids, Params(8, Sampling(temperature=0)), on(i + 1))
                 for i, p in enumerate(PROMPTS[1:4])]
    while not all(r.finished for r in [first, *burst]):
        time.sleep(0.01)
    eng.stop()
    assert calls == [3] and eng.times.mixed_rows >= 1
    for i in range(1, 4):
        assert tok.decode(got[i], skip_special_tokens=True) == reference(embedded, PROMPTS[i], 8)


@pytest.mark.parametrize("gather_s", [0.0, 0.2])
def test_requests_arriving_together_from_idle_are_gathered(embedded, prefills_together, gather_s):
    """From idle, the engine waits while requests keep arriving (each within gather_s of the last)
    and prefills them in one forward (the GPU's path, forced on the CPU); without the wait the first
    is prefilled alone. Either way each gets the greedy tokens it gets alone."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    calls = prefills_together
    eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=96, prefill_chunk=64, gather_s=gather_s)
    eng.scheduler.batch_prefill = True
    got = [[] for _ in range(3)]
    eng.start()
    reqs = []
    for i, p in enumerate(PROMPTS[1:4]):  # 20 ms apart: within the 200 ms window, not at once
        reqs.append(eng.submit(tok(p).input_ids, Params(6, Sampling(temperature=0)),
                               (lambda i: lambda ev: ev.kind == "token" and got[i].append(ev.token))(i)))
        time.sleep(0.02)
    while not all(r.finished for r in reqs):
        time.sleep(0.01)
    eng.stop()
    if gather_s:
        assert calls == [3] and eng.times.gather_s >= 0.04
    else:
        assert 3 not in calls and eng.times.gather_s == 0.0
    for i in range(3):
        assert tok.decode(got[i], skip_special_tokens=True) == reference(embedded, PROMPTS[i + 1], 6)


def test_a_lone_request_is_not_held_for_others_after_a_burst_of_one(embedded, prefills_together):
    """The gather wait is for bursts: after a burst of one request (from idle, none other before
    the engine is idle again, within the span) the next request is prefilled at once; a burst of
    several turns the wait on again, so the burst after it is prefilled in one forward. Each gets
    the greedy tokens it gets alone."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    calls = prefills_together
    eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=96, prefill_chunk=64, gather_s=0.2)
    eng.scheduler.batch_prefill = True
    eng.start()

    outputs = []  # (prompt, tokens), checked once the engine has stopped (reference() sets the model's caches)

    def burst(prompts, apart=0.02, n=4):
        got, reqs = [[] for _ in prompts], []
        for i, p in enumerate(prompts):
            reqs.append(eng.submit(tok(p).input_ids, Params(n, Sampling(temperature=0)),
                                   (lambda i: lambda ev: ev.kind == "token" and got[i].append(ev.token))(i)))
            time.sleep(apart)
        while not all(r.finished for r in reqs):
            time.sleep(0.01)
        outputs.extend((p, n, g) for p, g in zip(prompts, got))

    burst(PROMPTS[:1])  # the first request: waited for (no burst seen yet)
    waited = eng.times.gather_s
    assert waited >= 0.15
    burst(PROMPTS[1:2])  # after a burst of one: not held
    assert eng.times.gather_s - waited < 0.05
    burst(PROMPTS[1:4], apart=0.03, n=40)  # its first one goes at once, the others join it: the burst counts three
    assert 3 not in calls
    burst(PROMPTS[1:4])  # so this one is gathered: one forward
    eng.stop()
    assert calls[-1] == 3 and eng.times.gather_s - waited >= 0.04
    for p, n, got in outputs:
        assert tok.decode(got, skip_special_tokens=True) == reference(embedded, p, n)


class _EagerGraph:
    """A CUDA graph's stand-in on the CPU: replay() runs the captured function again, into the
    tensors its first run returned (as a graph's replay rewrites its outputs)."""

    def __init__(self, fn, args):
        self.fn, self.args, self.replays = fn, args, 0
        self.out = fn(*args)

    def replay(self):
        self.replays += 1
        for o, n in zip(self.out, self.fn(*self.args)):
            o.copy_(n)


def _eager_capture(fn, args, pool=None):
    g = _EagerGraph(fn, args)
    return g, g.out


def test_prefill_graph_buckets():
    """Rows pad to a power of two, lengths to the next of LENGTHS, within the token budget."""
    from llamactl.runtime.graphs import PrefillGraphs

    g = PrefillGraphs(None, max_rows=32, max_seq=512, device=None, tokens=2048)
    assert g.bucket(1, 1) == (1, 64) and g.bucket(3, 17) == (4, 64) and g.bucket(5, 130) == (8, 192)
    assert g.bucket(32, 64) == (32, 64) and g.bucket(33, 16) is None  # more rows than the cache's
    assert g.bucket(16, 129) is None and g.bucket(1, 513) is None  # over the budget, over max_seq
    assert all(k * s <= 2048 and s <= 512 for k, s in g.shapes()) and (8, 256) in g.shapes()


def test_prefill_graphs_are_captured_for_a_cache_of_any_rows(embedded):
    """A cache of 3 rows: the bucket of 4 rows is captured too (its last row written twice)."""
    import torch

    from llamactl.runtime.step import Decoder
    from llamactl.runtime.graphs import PrefillGraphs

    art, model, tok = embedded
    d = Decoder(model, 3, 64)
    d.prefill_graphs = PrefillGraphs(d._prefill_slots, 3, d.max_seq, d.device, capture=_eager_capture)
    assert d.prefill_graphs.capture_all() == 3 and sorted(d.prefill_graphs._graphs) == [(1, 64), (2, 64), (4, 64)]
    assert d.prefill_graphs.summary() == "3 prefill graphs"
    assert d.prefill_slots(torch.tensor([[5, 6, 7]] * 3), [2, 0, 1], [3, 2, 3]).tolist() == \
        d._prefill_slots(torch.tensor([[5, 6, 7]] * 3), torch.tensor([2, 0, 1]), torch.tensor([3, 2, 3]))[0].tolist()


def test_prefill_graphs_give_the_tokens_of_eager_prefills(embedded, prefills_together):
    """Prompts joining together (padded to a bucket of rows: the last one repeated into its slot)
    and lone prompts (Decoder.prefill at position 0) through the prefill graphs' path, each
    graph run by an eager stand-in on the CPU: every request gets the tokens of eager prefills,
    greedy and sampled."""
    from llamactl.runtime.graphs import PrefillGraphs
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    out, replays = {}, {}
    for graphs in (False, True):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=96, prefill_chunk=64)
        eng.scheduler.batch_prefill = True
        if graphs:
            d = eng.decoder
            d.prefill_graphs = PrefillGraphs(d._prefill_slots, 4, d.max_seq, d.device, capture=_eager_capture)
        got = [[] for _ in range(4)]
        reqs = [eng.submit(tok(p).input_ids, Params(8, Sampling(temperature=0 if i % 2 else 0.7, seed=i)),
                           (lambda i: lambda ev: ev.kind == "token" and got[i].append(ev.token))(i))
                for i, p in enumerate(PROMPTS[:3])]
        eng.start()  # three queued before the loop starts: one forward of three rows (a bucket of 4)
        while not all(r.finished for r in reqs):
            time.sleep(0.01)
        late = eng.submit(tok(PROMPTS[3]).input_ids, Params(8, Sampling(temperature=0)),  # alone: one row
                          lambda ev: ev.kind == "token" and got[3].append(ev.token))
        while not late.finished:
            time.sleep(0.01)
        eng.stop()
        out[graphs] = got
        if graphs:
            replays = {k: g.replays for k, (_, g, _) in eng.decoder.prefill_graphs._graphs.items()}
    assert out[True] == out[False] and all(len(g) == 8 for g in out[True])
    assert replays == {(4, 64): 1, (1, 64): 1}


def test_a_failed_prefill_capture_leaves_its_bucket_eager(embedded):
    """A bucket whose capture raises is prefilled eagerly from then on (the same tokens), and the
    serving line's summary names it."""
    import torch

    from llamactl.runtime.step import Decoder
    from llamactl.runtime.graphs import PrefillGraphs

    def capture(fn, args, pool=None):
        if args[0].shape[0] == 2:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")
        return _eager_capture(fn, args, pool)

    art, model, tok = embedded
    d = Decoder(model, 3, 64)
    d.prefill_graphs = PrefillGraphs(d._prefill_slots, 3, d.max_seq, d.device, capture=capture)
    assert d.prefill_graphs.capture_all() == 2 and d.prefill_graphs.bucket(2, 10) is None
    ids, at, n = torch.tensor([[5, 6, 7], [9, 3, 1]]), [1, 2], [3, 2]
    want = d._prefill_slots(ids, torch.tensor(at), torch.tensor(n))[0].tolist()
    assert d.prefill_slots(ids, at, n).tolist() == want and list(d.prefill_graphs.failed) == [(2, 64)]
    assert d.prefill_graphs.summary() == ("2 prefill graphs; 2 x 64 eager (RuntimeError: CUDA error: operation "
                                          "failed due to a previous error during capture)")


def test_prefix_hits_and_preemption_give_the_tokens_of_a_fresh_run(embedded):
    """The paged cache's reuse and recompute, token for token (CPU float32): requests sharing a
    long prefix reuse its cached blocks (prefilling only their own tokens); a pool too small for
    all rows preempts the newest mid-generation, which prefills its tokens so far again and goes on;
    both a step ahead too."""
    from llamactl.serve.engine import Engine, KvOptions, Params

    art, model, tok = embedded
    eos = set()
    shared = tok(" ".join(PROMPTS)).input_ids[:40]
    reqs = [(shared + tok(p).input_ids, Params(12, Sampling(temperature=0.0 if i % 2 else 0.7, seed=i)))
            for i, p in enumerate(PROMPTS[:4])]
    alone = [_run_engine(model, eos, [r], kv=KvOptions(prefix_cache=False))[0] for r in reqs]
    eng = Engine(model, eos, max_batch=4, max_queue=16, max_seq=128, kv=KvOptions(block_size=8)).start()
    try:
        assert _run_engine(model, eos, reqs[:1], engine=eng) == alone[:1]
        assert _run_engine(model, eos, reqs[1:], engine=eng) == alone[1:]
        pool = eng.scheduler.pool
        assert pool.hit_tokens >= 3 * 40 // 8 * 8 and pool.queried_tokens == sum(len(r[0]) for r in reqs)
    finally:
        eng.stop()
    # 4 rows of ~60 tokens in 12 blocks of 8 (their 40 shared tokens in 5 blocks, computed once):
    # they cannot all run to the end
    for overlap in (False, True):
        small = Engine(model, eos, max_batch=4, max_queue=16, max_seq=128, overlap=overlap,
                       kv=KvOptions(memory_gib=12 * 8 * _token_bytes(model) / 2**30, block_size=8)).start()
        try:
            assert small.scheduler.pool.blocks == 13
            assert _run_engine(model, eos, reqs, engine=small) == alone
            assert small.times.preemptions > 0
        finally:
            small.stop()


def _token_bytes(model) -> int:
    a = model.args
    return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 4  # float32 K and V


def test_speculating_rows_give_the_tokens_of_plain_decoding(embedded):
    """serve --draft ngram: while few rows run, each proposes the tokens that followed its last
    ones earlier in its text, checked in one forward; the kept tokens, greedy and sampled (the draw
    at a position is the sampler's hash of seed and position), are plain decoding's (CPU float32),
    and most proposals on a text that goes on as it began are kept."""
    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    counting = ", ".join(str(i) for i in range(1, 15)) + ","  # the model goes on counting: lookup finds it
    prompts = [tok(counting).input_ids, tok(PROMPTS[0]).input_ids]
    params = [Params(24, Sampling(temperature=0), ignore_eos=True),
              Params(24, Sampling(temperature=0.8, seed=7), ignore_eos=True)]
    out, times = {}, {}
    for spec in ((0, 0), (4, 8)):
        eng = Engine(model, set(), max_batch=4, max_queue=4, max_seq=128, speculate=spec)
        out[spec] = _run_engine(model, set(), list(zip(prompts, params)), engine=eng.start())
        eng.stop()
        times[spec] = eng.times
    assert out[0, 0] == out[4, 8] and all(len(t) == 24 and why == "length" for t, why in out[4, 8])
    t = times[4, 8]
    assert t.verify_steps > 0 and t.spec_accepted >= t.spec_proposed / 2 and t.decode_rows == 2 * 23
    assert times[0, 0].verify_steps == 0
    # its second token as EOS, met in its first verify step (the GPU's order, forced here: a row
    # whose prompt ends decodes from the next step): it ends there, as without speculation
    toks, at = out[0, 0][0][0], 1
    eos = {toks[at]}
    greedy = [(prompts[0], Params(24, Sampling(temperature=0)))]
    ended = {}
    for spec in ((0, 0), (4, 8)):
        eng = Engine(model, eos, max_batch=4, max_queue=4, max_seq=128, speculate=spec, mix=True)
        eng.scheduler.batch_prefill = True
        ended[spec] = _run_engine(model, eos, greedy, engine=eng.start())
        eng.stop()
        assert eng.failure is None
    assert ended[0, 0] == ended[4, 8] == [(toks[:at], "stop")] and eng.times.verify_steps > 0
    off = [Params(p.max_tokens, p.sampling, p.ignore_eos, speculate=False) for p in params]  # the requests' word
    eng = Engine(model, set(), max_batch=4, max_queue=4, max_seq=128, speculate=(4, 8))
    assert _run_engine(model, set(), list(zip(prompts, off)), engine=eng.start()) == out[0, 0]
    eng.stop()
    assert eng.times.verify_steps == 0


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_an_8bit_pool_gives_the_tokens_of_generate_with_that_cache(embedded, kv_dtype):
    """An engine whose KV pool is 8-bit (--kv-dtype): rows joining in chunks and decoding together
    give the greedy tokens `llamactl generate --kv-dtype` gives alone over its static cache (both
    attend over the K/V as the cache holds them), and a pool of the same bytes holds more."""
    from llamactl.options import RuntimeOptions
    from llamactl.serve.engine import Engine, KvOptions, Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    options = RuntimeOptions(kv_dtype=kv_dtype)
    reqs = [(tok(p).input_ids, Params(12, Sampling(temperature=0.0))) for p in PROMPTS[:4]]
    eng = Engine(model, eos, max_batch=2, max_queue=16, max_seq=128, prefill_chunk=4, options=options,
                 kv=KvOptions(memory_gib=1 / 1024)).start()
    try:
        assert eng.runner.cache.fmt.name == kv_dtype and eng.runner.cache.layers[0].k.element_size() == 1
        together = _run_engine(model, eos, reqs, engine=eng)
    finally:
        eng.stop()
    for (ids, p), (got, _) in zip(reqs, together):
        events = gen.generate(model, tok, ids, p.max_tokens, gen.Sampling(temperature=0), eos, options=options)
        assert got == next(e for e in events if isinstance(e, gen.Result)).token_ids
    sixteen = Engine(model, eos, max_batch=2, max_queue=16, max_seq=128, kv=KvOptions(memory_gib=1 / 1024))
    assert eng.runner.cache.tokens > 1.9 * sixteen.runner.cache.tokens  # a float32 model: 4 bytes a value to 1 (+ scale)


def test_an_fp8_model_serves_the_tokens_generate_gives(tmp_path):
    """A `quantize --method fp8` folder (the embedded model) in the serving engine: rows joining in
    chunks and decoding together give the greedy tokens `llamactl generate` gives alone."""
    from typer.testing import CliRunner

    from llamactl.cli.app import app
    from llamactl.layers.fp8 import FP8Linear
    from llamactl.runtime.load import load
    from llamactl.serve.engine import Params

    out = tmp_path / "fp8"
    r = CliRunner().invoke(app, ["quantize", "embedded", "-o", str(out), "--method", "fp8", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    art, model, tok, _ = load(str(out), "cpu", "float32")
    assert any(isinstance(m, FP8Linear) for m in model.modules())
    eos = gen.eos_ids(model, tok, art)
    reqs = [(tok(p).input_ids, Params(8, Sampling(temperature=0.0))) for p in PROMPTS[:3]]
    together = _run_engine(model, eos, reqs, max_batch=2, prefill_chunk=4)
    for (ids, p), (got, _) in zip(reqs, together):
        events = gen.generate(model, tok, ids, p.max_tokens, gen.Sampling(temperature=0), eos)
        assert got == next(e for e in events if isinstance(e, gen.Result)).token_ids


def test_a_draft_models_proposals_give_the_tokens_of_plain_decoding(embedded, tiny_gqa):
    """serve --draft MODEL: a draft model's K/V in the same blocks as the target's, its proposals
    made for every speculating row in one catch-up forward and batched decode steps; the kept
    tokens, greedy and sampled, are plain decoding's (CPU float32), whether the draft agrees
    (the model itself: nearly every proposal kept) or not (a random model of another shape:
    few kept, the catch-up after each rejection exercised), with a pool so small that rows are
    preempted and come back (their draft K/V written again)."""
    from llamactl.runtime.load import load
    from llamactl.serve.engine import Engine, KvOptions, Params

    art, model, tok = embedded
    _, random_model, _, _ = load(str(tiny_gqa), "cpu", "float32")
    counting = ", ".join(str(i) for i in range(1, 15)) + ","
    prompts = [tok(counting).input_ids, tok(PROMPTS[0]).input_ids, tok(PROMPTS[1]).input_ids]
    params = [Params(24, Sampling(temperature=0), ignore_eos=True),
              Params(24, Sampling(temperature=0.8, seed=7), ignore_eos=True),
              Params(20, Sampling(temperature=0), ignore_eos=True)]
    plain = _run_engine(model, set(), list(zip(prompts, params)))
    greedy = [(ids, p) for ids, p in zip(prompts, params) if p.sampling.greedy]
    eng = Engine(model, set(), max_batch=4, max_queue=4, max_seq=128, speculate=(4, 8), draft=model).start()
    assert _run_engine(model, set(), greedy, engine=eng) == [o for o, (_, p) in zip(plain, zip(prompts, params))
                                                            if p.sampling.greedy]
    eng.stop()
    t = eng.times  # the model drafting for itself, greedily: every proposal kept
    assert t.spec_proposed > 20 and t.spec_accepted == t.spec_proposed, (t.spec_accepted, t.spec_proposed)
    small = KvOptions(memory_gib=9 * 8 * 2 * _token_bytes(model) / 2**30, block_size=8)  # 9 blocks, the draft's K/V too
    for draft, kv in ((model, None), (random_model, None), (model, small)):
        eng = Engine(model, set(), max_batch=4, max_queue=4, max_seq=128, speculate=(4, 8), draft=draft, kv=kv)
        eng.warm_up()
        got = _run_engine(model, set(), list(zip(prompts, params)), engine=eng.start())
        eng.stop()
        assert eng.failure is None and got == plain, (draft is model, kv)
        t = eng.times
        assert t.verify_steps > 0
        if kv is None:  # (a preempted row's prefill again makes a token of its own)
            assert t.decode_rows == sum(p.max_tokens - 1 for p in params)
        if kv is not None:
            assert t.preemptions > 0
