"""The serving engine's sampling features on their own (no HTTP), on the embedded trained model
(CPU float32): log-probabilities (of the drawn tokens and of an echoed prompt), penalties, logit
bias and min_tokens, each against the runtime's logits or a reference over whole forwards."""

from __future__ import annotations

import time

from llamactl.runtime import generate as gen
from llamactl.runtime.settings import Sampling
from test_engine import PROMPTS, _run_engine


def test_logprobs_are_the_log_softmax_of_the_runtimes_logits(embedded):
    """Rows asking for log-probabilities (greedy, and sampled at temperature 0.7) decoding beside a
    row that does not, joining in chunks: each token's value is the log-softmax of the logits the
    runtime computes at its position (over the row's temperature), and its alternatives are the
    true top k, likeliest first (CPU float32, to 1e-5)."""
    import torch

    from llamactl.serve.engine import Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    reqs = [(tok(PROMPTS[0]).input_ids, Params(6, Sampling(temperature=0.0), logprobs=5)),
            (tok(PROMPTS[1]).input_ids, Params(6, Sampling(temperature=0.7, seed=3), logprobs=2)),
            (tok(PROMPTS[2]).input_ids, Params(6, Sampling(temperature=0.0)))]
    lps = [[], [], []]
    out = _run_engine(model, eos, reqs, max_batch=3, prefill_chunk=4, logprobs=lps)
    assert lps[2] == [None] * len(out[2][0])  # asked for none
    for (ids, p), (toks, _), got in zip(reqs[:2], out[:2], lps[:2]):
        seq = torch.tensor([ids + toks])
        with torch.inference_mode():
            logits = model(seq, torch.arange(seq.shape[1]))[0].double()  # [S, V]
        t = p.sampling.temperature or 1.0
        want = torch.log_softmax(logits / t, -1)[len(ids) - 1 : len(ids) - 1 + len(toks)]  # the draw at each token
        assert len(got) == len(toks)
        for i, (token, (value, alts)) in enumerate(zip(toks, got)):
            assert abs(value - want[i, token].item()) < 1e-5, (i, value, want[i, token].item())
            top = want[i].topk(p.logprobs)
            assert [a for a, _ in alts] == top.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(alts, top.values.tolist())) < 1e-5


def _adjusted_greedy(model, ids: list[int], n: int, s) -> list[int]:
    """The greedy tokens after ids with Sampling s's penalties and bias applied as OpenAI and vLLM
    define them, each step a whole forward (the reference for the engine's on-device ones)."""
    import torch

    out = []
    for _ in range(n):
        seq = torch.tensor([ids + out])
        with torch.inference_mode():
            x = model(seq, torch.arange(seq.shape[1]))[0, -1].double()  # [V]
        for tid, b in s.logit_bias:
            x[tid] += b
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).double() if out else 0 * x
        x = x - s.presence_penalty * (counts > 0) - s.frequency_penalty * counts
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids + out)] = True
        x = torch.where(seen, torch.where(x > 0, x / s.repetition_penalty, x * s.repetition_penalty), x)
        out.append(int(x.argmax()))
    return out


def test_penalties_and_logit_bias_give_the_reference_tokens_and_leave_other_rows_alone(embedded):
    """Greedy rows with presence, frequency and repetition penalties, or a logit bias, decoding
    beside a row without any (joining in chunks of 4): each gives the tokens of the reference that
    applies them to a whole forward's logits; the plain row gives the tokens it gives alone; a +100
    bias makes its token every token."""
    from llamactl.serve.engine import Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    plain = Sampling(temperature=0.0)
    pen = Sampling(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3)
    bias = Sampling(temperature=0.0, logit_bias=((tok(" the").input_ids[-1], 100.0),))
    reqs = [(tok(PROMPTS[0]).input_ids, Params(10, pen, ignore_eos=True)),
            (tok(PROMPTS[1]).input_ids, Params(10, plain, ignore_eos=True)),
            (tok(PROMPTS[3]).input_ids, Params(6, bias, ignore_eos=True))]
    out = _run_engine(model, eos, reqs, max_batch=3, prefill_chunk=4)
    assert out[0][0] == _adjusted_greedy(model, reqs[0][0], 10, pen)
    assert out[0][0] != _adjusted_greedy(model, reqs[0][0], 10, plain)  # the penalties changed something
    assert out[1][0] == _run_engine(model, eos, [reqs[1]], max_batch=3)[0][0]
    assert out[2][0] == [bias.logit_bias[0][0]] * 6


def test_min_tokens_holds_the_stop_tokens_back(embedded):
    """A bias of +100 on EOS ends a row at once; with min_tokens 3 the row makes 3 other tokens
    first, then stops at EOS."""
    from llamactl.serve.engine import Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    ids, end = tok(PROMPTS[0]).input_ids, min(eos)
    eager = Sampling(temperature=0.0, logit_bias=((end, 100.0),))
    assert _run_engine(model, eos, [(ids, Params(10, eager))])[0] == ([], "stop")
    held = Sampling(temperature=0.0, logit_bias=((end, 100.0),), min_tokens=3)
    toks, reason = _run_engine(model, eos, [(ids, Params(10, held))])[0]
    assert len(toks) == 3 and end not in toks and reason == "stop"


def test_prompt_logprobs_come_from_the_prefill_and_equal_the_runtimes(embedded):
    """A request asking for its prompt's log-probabilities (echo), prefilled in chunks of 4 beside
    a request that does not: a "prompt" event before its first token with each prompt token's
    log-probability after the first and its top 3, the log-softmax of the runtime's logits at the
    position before (CPU float32, 1e-5); the same prompt again (cached blocks) is scored too."""
    import torch

    from llamactl.serve.engine import Engine, Params

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    ids = tok("The model folder holds the weights and a manifest of how it was made.").input_ids
    seq = torch.tensor([ids])
    with torch.inference_mode():
        want = torch.log_softmax(model(seq, torch.arange(seq.shape[1]))[0].double(), -1)  # [S, V]
    eng = Engine(model, eos, max_batch=2, max_queue=16, max_seq=128, prefill_chunk=4).start()
    try:
        for _ in range(2):  # the second time its blocks are cached: still every position computed
            seen = []
            req = eng.submit(ids, Params(3, Sampling(temperature=0.0), prompt_logprobs=3), seen.append)
            eng.submit(tok(PROMPTS[1]).input_ids, Params(3, Sampling(temperature=0.0)), lambda ev: None)
            deadline = time.time() + 60
            while not req.finished and time.time() < deadline:
                time.sleep(0.01)
            assert seen[0].kind == "prompt" and seen[1].kind == "token"
            scores = seen[0].prompt
            assert len(scores) == len(ids) - 1
            for i, (value, alts) in enumerate(scores):
                assert abs(value - want[i, ids[i + 1]].item()) < 1e-5, i
                assert [a for a, _ in alts] == want[i].topk(3).indices.tolist()
    finally:
        eng.stop()


def test_grammar_rows_a_step_ahead_give_the_tokens_of_steps_read_one_by_one(embedded, monkeypatch):
    """Requests held to a regular expression and a JSON schema (greedy and sampled) decoding beside
    one that follows none: with the GPU's step ahead (each step's forward launched before the last
    step's tokens are read and the masks made from them; its draw after) every request gets the
    tokens it gets when each step is read before the next, and the constrained texts match."""
    import json
    import re

    import pytest

    pytest.importorskip("xgrammar")
    from llamactl.serve.engine import Params
    from llamactl.serve.grammar import Grammars

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    grammars = Grammars(tok, model.args.vocab_size, eos)
    code = grammars.compile(("regex", "[A-Z]{2}-[0-9]{3}", "guided_regex"))
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["n", "ok"], "additionalProperties": False})
    obj = grammars.compile(("json", schema, "response_format"))
    reqs = [(tok(PROMPTS[0]).input_ids, Params(12, Sampling(temperature=0.0), grammar=code)),
            (tok(PROMPTS[1]).input_ids, Params(24, Sampling(temperature=0.9, seed=2), grammar=obj)),
            (tok(PROMPTS[2]).input_ids, Params(10, Sampling(temperature=0.0))),
            (tok(PROMPTS[3]).input_ids, Params(24, Sampling(temperature=0.0), grammar=obj))]
    from llamactl.serve.runner import Runner

    forwards, launch_forward = [], Runner.launch_forward
    monkeypatch.setattr(Runner, "launch_forward", lambda self, step: forwards.append(step) or launch_forward(self, step))
    ahead = _run_engine(model, eos, reqs, max_batch=4, prefill_chunk=4, overlap=True)
    assert len(forwards) > 10  # the steps ahead: forward, then the last step's tokens read, then the draw
    apart = _run_engine(model, eos, reqs, max_batch=4, prefill_chunk=4, overlap=False)
    assert ahead == apart
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", tok.decode(ahead[0][0], skip_special_tokens=True))
    for i in (1, 3):
        if ahead[i][1] == "stop":  # (a long document may end by length)
            assert set(json.loads(tok.decode(ahead[i][0], skip_special_tokens=True))) == {"n", "ok"}


def test_captured_steps_give_the_engine_the_tokens_of_eager_ones(embedded, monkeypatch):
    """The engine's decode steps captured (a CUDA graph's stand-in on the CPU that freezes the
    sampler's flags at its capture, as a graph does) and run a step ahead, while requests with
    log-probabilities, penalties, a grammar and none join and leave over three rows: every
    request's tokens and log-probabilities are those of eager steps."""
    import pytest

    pytest.importorskip("xgrammar")
    from conftest import GraphStandIn
    from llamactl.runtime import step as step_mod
    from llamactl.serve.engine import Engine, Params
    from llamactl.serve.grammar import Grammars

    art, model, tok = embedded
    eos = gen.eos_ids(model, tok, art)
    code = Grammars(tok, model.args.vocab_size, eos).compile(("regex", "[a-z]{3,6}( [a-z]{3,6}){2}", "guided_regex"))
    reqs = [(tok(PROMPTS[0]).input_ids, Params(8, Sampling(temperature=0.0))),
            (tok(PROMPTS[1]).input_ids, Params(8, Sampling(temperature=0.8, seed=1), logprobs=2)),
            (tok(PROMPTS[2]).input_ids, Params(10, Sampling(temperature=0.0, frequency_penalty=1.2))),
            (tok(PROMPTS[3]).input_ids, Params(12, Sampling(temperature=0.7, seed=3), grammar=code)),
            (tok(PROMPTS[4]).input_ids, Params(6, Sampling(temperature=0.0, presence_penalty=0.8), logprobs=1))]

    def run(graphs: bool):
        eng = Engine(model, eos, max_batch=3, max_queue=8, max_seq=128, prefill_chunk=4, overlap=True)
        if graphs:
            stand_in = GraphStandIn(eng.runner.rows)
            monkeypatch.setattr(step_mod, "capture", stand_in)
            eng.decoder.use_graph = True
        lps = [[] for _ in reqs]
        return _run_engine(model, eos, reqs, engine=eng.start(), logprobs=lps), lps, eng

    eager, eager_lps, _ = run(False)
    captured, captured_lps, eng = run(True)
    eng.stop()
    assert len(eng.decoder._graphs) > 2  # steps of several kinds were captured and replayed
    assert captured == eager
    assert captured_lps == eager_lps


def test_a_model_without_eos_ids_still_follows_a_schema_to_its_end(embedded):
    """Random weights are served without EOS ids (serve --synthetic): the grammar takes the
    tokenizer's own stop token (xgrammar refuses an empty list; that was a 500 on every JSON
    request), and a document ends its request when the grammar does."""
    import json

    import pytest

    pytest.importorskip("xgrammar")
    from llamactl.serve.engine import Params
    from llamactl.serve.grammar import Grammars

    art, model, tok = embedded
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    obj = Grammars(tok, model.args.vocab_size, set()).compile(("json", schema, "response_format"))
    [(ids, why)] = _run_engine(model, set(), [(tok(PROMPTS[0]).input_ids, Params(40, Sampling(temperature=0.0),
                                                                               grammar=obj))])
    assert why == "stop" and json.loads(tok.decode(ids, skip_special_tokens=True)) in ({"ok": True}, {"ok": False})


def test_masks_filled_together_are_each_matchers_own(embedded):
    """Matcher.masks: the rows of one batch fill (xgrammar's threads) equal each matcher's alone,
    for matchers at different places in different grammars."""
    import json

    import pytest

    pytest.importorskip("xgrammar")
    import torch

    from llamactl.serve.grammar import Grammars, Matcher

    art, model, tok = embedded
    grammars = Grammars(tok, model.args.vocab_size, gen.eos_ids(model, tok, art))
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    codes = [grammars.compile(("json", schema, "response_format")), grammars.compile(("regex", "[a-z]{2,4}!", "r"))]
    matchers = [Matcher(codes[i % 2], model.args.vocab_size) for i in range(5)]
    for i, m in enumerate(matchers):  # walk each some allowed tokens into its grammar
        for _ in range(i):
            allowed = ((Matcher.masks([m])[0].view(-1, 1) >> torch.arange(32)) & 1).view(-1).nonzero().view(-1)
            assert m.accept(int(allowed[len(allowed) // 2]))
    together = Matcher.masks(matchers)
    assert together.shape == (5, -(-model.args.vocab_size // 32))
    for i, m in enumerate(matchers):
        assert torch.equal(together[i], Matcher.masks([m])[0]), i
    assert not torch.equal(together[0], together[2])  # (places differ: the check can fail)
