"""GPU-only checks of the serving engine (run on the GPU machine, `pytest -m gpu`): served rows against
each alone and against generate, a pool sized by fraction, paged prefix hits and preemption, prefill
graphs, grammar rows a step ahead, and speculation's verify steps in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from llamactl.folder.artifact import open_artifact
from llamactl.runtime.load import load_model
from llamactl.runtime.settings import Sampling
from test_gpu import untuned  # noqa: F401 (autouse: the GEMVs at their fixed block sizes)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _greedy_tokens(eng, prompts, which, n) -> dict[int, list[int]]:
    """Start a warmed-up engine, submit prompts[i] for i in which together (n greedy tokens each),
    stop it once they end -> their tokens."""
    import time

    from llamactl.serve.engine import Params

    eng.start()
    out = {i: [] for i in which}
    reqs = [eng.submit(prompts[i], Params(n, Sampling(temperature=0)),
                       (lambda i: lambda ev: ev.kind == "token" and out[i].append(ev.token))(i)) for i in which]
    deadline = time.time() + 120
    while not all(r.finished for r in reqs) and time.time() < deadline:
        time.sleep(0.01)
    eng.stop()
    return out


def test_served_rows_give_the_tokens_they_give_alone_on_the_gpu(trained_model):
    """The serving engine (CUDA graphs per batch bucket, llamactl's attention per row, bf16): each
    greedy request among others against the same request alone (which steps at batch 1: other
    GEMVs, other bf16 rounding) and against batch-1 `generate`. Tokens agree up to the first
    near-tie; the agreement is printed (the kernels' tolerance, measured)."""
    from conftest import greedy_alone
    from llamactl.serve.engine import Engine, KvOptions

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)
    prompts = [list(range(10, 15)), list(range(100, 109)), list(range(300, 313)), list(range(7, 40))]
    n = 12

    def run(which):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128, prefill_chunk=8, kv=KvOptions(memory_gib=1))
        assert eng.mode == "graphs"
        eng.warm_up()
        assert not eng.decoder.prefill_graphs.failed  # every short prefill replays a graph
        return _greedy_tokens(eng, prompts, which, n)

    together = run(range(4))
    alone = [run([i])[i] for i in range(4)]
    want = [greedy_alone(model, torch.tensor(p, device="cuda"), n, "graphs") for p in prompts]

    def agree(a, b):
        return sum(x == y for x, y in zip(a, b)) / n

    print("served together vs alone:", [agree(together[i], alone[i]) for i in range(4)],
          "vs generate:", [agree(together[i], want[i]) for i in range(4)])
    assert all(together[i][:3] == alone[i][:3] == want[i][:3] for i in range(4))
    assert sum(agree(together[i], want[i]) for i in range(4)) / 4 >= 0.6


def test_a_pool_sized_by_fraction_leaves_the_warmed_up_server_its_margin(trained_model):
    """No --kv-memory on a GPU: the engine warms up over a probe pool, measures its peak, and
    builds the pool that fits in the fraction beside it; after the second warm-up and a mixed
    burst the card still has the margin free, and the tokens are the fixed pool's."""
    from llamactl.serve.engine import Engine, KvOptions
    from llamactl.serve.runner import MARGIN_BYTES, PROBE_BLOCKS

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)
    prompts = [list(range(10, 15)), list(range(100, 109)), list(range(300, 313)), list(range(7, 40))]
    free, total = torch.cuda.mem_get_info()
    fraction = (total - free) / total + 0.05  # what is in use now and 5% of the card more
    eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128, kv=KvOptions(gpu_fraction=fraction))
    eng.warm_up()
    pool = eng.runner.cache.nbytes
    assert eng.runner.cache.blocks > PROBE_BLOCKS and eng.scheduler.pool.blocks == eng.runner.cache.blocks
    measured = _greedy_tokens(eng, prompts, range(4), 12)
    torch.cuda.synchronize()
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= fraction * total - MARGIN_BYTES / 2, (used, pool)
    fixed = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128, kv=KvOptions(memory_gib=1))
    fixed.warm_up()
    assert _greedy_tokens(fixed, prompts, range(4), 12) == measured


def test_paged_prefix_hits_and_preemption_on_the_gpu(trained_model):
    """The paged cache on the GPU (its decode kernel in CUDA graphs, prefills packed and through the
    table): requests sharing a 48-token prefix, in a pool too small for all of them (preemptions),
    against each alone in a fresh pool (a whole prompt: a prefill graph), in float32, where the
    kernels' sums differ by rounding only: the tokens agree (printed). In bf16 these synthetic
    prompts meet near-ties within three tokens (one of four parted at the first on an H200)."""
    from llamactl.serve.engine import Engine, KvOptions

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.float32)
    shared = list(range(500, 548))
    prompts = [shared + list(range(10 + 30 * i, 15 + 30 * i + i)) for i in range(4)]
    n = 24
    a = model.args
    token_bytes = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 4

    def run(which, blocks):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128,
                     kv=KvOptions(memory_gib=blocks * 16 * token_bytes / 2**30))
        eng.warm_up()
        return _greedy_tokens(eng, prompts, which, n), eng

    together, eng = run(range(4), 9)  # 11 blocks wanted at the end (the prefix's 3 shared, 2 each), 9 there
    alone = [run([i], 64)[0][i] for i in range(4)]
    agree = [sum(x == y for x, y in zip(together[i], alone[i])) / n for i in range(4)]
    print("paged, prefix hits and preemptions vs alone:", agree, "preemptions", eng.times.preemptions,
          "hit tokens", eng.scheduler.pool.hit_tokens)
    assert eng.times.preemptions > 0 and eng.scheduler.pool.hit_tokens > 0  # a preempted one reuses its blocks
    assert all(len(together[i]) == n and together[i][:8] == alone[i][:8] for i in range(4))
    assert sum(agree) / 4 >= 0.9


def test_prefill_graphs_give_the_tokens_of_eager_prefills_on_the_gpu(trained_model):
    """The serving engine's short prefills replayed from CUDA graphs (rows padded to a bucket by
    repeating the last prompt, lengths padded to 64) against eager prefills (other padding, so
    other bf16 rounding): greedy tokens agree up to the first near-tie (printed), and the graphs
    ran."""
    import time

    from llamactl.serve.engine import Engine, KvOptions, Params

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.bfloat16)
    prompts = [list(range(10, 15)), list(range(100, 109)), list(range(300, 313)), list(range(7, 40))]
    n = 12

    def run(graphs):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128, prefill_graphs=graphs,
                     kv=KvOptions(memory_gib=1))
        eng.warm_up()
        eng.start()
        out = {i: [] for i in range(4)}
        on = lambda i: lambda ev: ev.kind == "token" and out[i].append(ev.token)  # noqa: E731
        reqs = [eng.submit(prompts[i], Params(n, Sampling(temperature=0)), on(i)) for i in range(3)]
        deadline = time.time() + 120
        while not all(r.finished for r in reqs) and time.time() < deadline:
            time.sleep(0.01)
        reqs.append(eng.submit(prompts[3], Params(n, Sampling(temperature=0)), on(3)))  # alone
        while not reqs[-1].finished and time.time() < deadline:
            time.sleep(0.01)
        eng.stop()
        return out, eng.decoder.prefill_graphs

    eager, none = run(False)
    graphed, graphs = run(True)
    assert none is None and len(graphs) == len(graphs.shapes()) == 6 and not graphs.failed  # rows 1, 2, 4 x 64, 128
    agree = [sum(a == b for a, b in zip(graphed[i], eager[i])) / n for i in range(4)]
    print("prefill graphs vs eager prefills:", agree)
    assert all(graphed[i][:3] == eager[i][:3] for i in range(4)) and sum(agree) / 4 >= 0.6


def test_grammar_rows_a_step_ahead_give_the_tokens_of_eager_steps_on_the_gpu(trained_model):
    """The engine in CUDA graphs, a step ahead, with requests held to a regular expression (their
    forward captured alone, their draw after the masks) beside plain ones: every request's tokens
    are those of the eager engine that reads each step first (float32: no near-ties)."""
    import re
    import time

    pytest.importorskip("xgrammar")
    from llamactl.serve.engine import Engine, KvOptions, Params
    from llamactl.folder.checkpoint import load_tokenizer
    from llamactl.serve.grammar import Grammars

    art = open_artifact(trained_model)
    model, tok = load_model(art, torch.device("cuda"), torch.float32), load_tokenizer(art)
    from llamactl.runtime.generate import eos_ids

    eos = eos_ids(model, tok, art)
    code = Grammars(tok, model.args.vocab_size, eos).compile(("regex", "[a-z]{3,6}( [a-z]{3,6}){3}", "guided_regex"))
    prompts = [list(range(10, 15)), list(range(100, 109)), list(range(300, 313))]
    params = [Params(16, Sampling(temperature=0), grammar=code), Params(16, Sampling(temperature=0)),
              Params(16, Sampling(temperature=0.8, seed=2), grammar=code)]

    def run(mode: str, overlap: bool) -> list[list[int]]:
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=128, mode=mode, overlap=overlap,
                     kv=KvOptions(memory_gib=1)).start()
        out = [[] for _ in prompts]
        reqs = [eng.submit(p, q, (lambda i: lambda ev: ev.kind == "token" and out[i].append(ev.token))(i))
                for i, (p, q) in enumerate(zip(prompts, params))]
        deadline = time.time() + 120
        while not all(r.finished for r in reqs) and time.time() < deadline:
            time.sleep(0.01)
        eng.stop()
        assert eng.failure is None, eng.failure
        return out

    ahead, apart = run("graphs", True), run("eager", False)
    assert ahead == apart
    for i in (0, 2):
        assert re.fullmatch("[a-z]{3,6}( [a-z]{3,6}){3}", tok.decode(ahead[i], skip_special_tokens=True))


def test_verify_steps_in_cuda_graphs_give_the_tokens_of_plain_decoding(trained_model):
    """Speculation on the GPU with its verify steps replayed from CUDA graphs (runtime.ragged.uniform:
    rows padded to the longest chunk; a free row in the bucket), float32: greedy tokens of four
    requests with prompt-lookup proposals and with the model drafting for itself agree with plain
    decoding's up to rounding (printed), graphs of kind "verify" were captured, and the model's
    own draft had its proposals kept."""
    from llamactl.serve.engine import Engine, KvOptions

    model = load_model(open_artifact(trained_model), torch.device("cuda"), torch.float32)
    counting = list(range(300, 340)) * 2
    prompts = [counting[: 40 + 7 * i] for i in range(3)]
    n = 32

    def run(spec, draft=None):
        eng = Engine(model, set(), max_batch=4, max_queue=8, max_seq=256, speculate=spec, draft=draft,
                     kv=KvOptions(memory_gib=1))  # (by fraction, the engines before hold the card)
        eng.warm_up()
        return _greedy_tokens(eng, prompts, range(3), n), eng

    plain, _ = run((0, 0))
    for draft in (None, model):
        got, eng = run((4, 8), draft)
        agree = [sum(x == y for x, y in zip(got[i], plain[i])) / n for i in range(3)]
        kinds = {k[0] for k, graph in eng.decoder._graphs.items() if graph is not None}
        print("verify graphs", draft is not None, agree, eng.times.verify_steps, eng.times.spec_proposed,
              eng.times.spec_accepted, sorted(map(str, kinds)), eng.decoder.verify_failed)
        assert "verify" in kinds and eng.times.verify_steps > 0 and sum(agree) / 3 >= 0.9
        assert all(got[i][:8] == plain[i][:8] for i in range(3))
        if draft is not None:
            assert eng.times.spec_accepted >= 0.8 * eng.times.spec_proposed
