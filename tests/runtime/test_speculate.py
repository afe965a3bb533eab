"""Speculative decoding (runtime.speculate): prompt-lookup proposals, greedy output equal to plain
decoding's token for token, and sampled tokens distributed as plain sampling draws them."""

from __future__ import annotations

import pytest
import torch

from llamactl.runtime import generate as gen
from llamactl.runtime.speculate import NgramDraft, keep

PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fib(n):\n",
           "The cat sat on the mat. The cat sat on the", "Hello"]


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    d = NgramDraft(max_n=3)
    d.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert d.propose(3) == [4, 5, 9]  # the longest suffix first: "1 2 3" (at the start), not "2 3" (later)
    d2 = NgramDraft(max_n=2)
    d2.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    assert d2.propose(3) == [7, 8, 1]  # "2 3": its latest earlier occurrence
    d.extend([4])
    assert d.propose(2) == [5, 9]  # "1 2 3 4" -> 5 9
    p = NgramDraft()
    p.extend([7, 1, 2, 1, 2])
    assert p.propose(5) == [1, 2, 1, 2, 1]  # "1 2" last seen just before: its period goes on
    assert NgramDraft().propose(4) == [] and d.propose(0) == []
    e = NgramDraft()
    e.extend([5, 6])
    assert e.propose(4) == []  # no suffix seen before


@pytest.mark.slow
def test_greedy_speculation_gives_plain_decodings_tokens(embedded):
    """The embedded trained model, CPU float32: every prompt's greedy tokens with --draft ngram (K 1
    and 5) equal plain decoding's, and copying prompts keep proposals."""
    art, model, tok = embedded
    kept = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        plain = list(gen.generate(model, tok, ids, 32, gen.Sampling(temperature=0), set(), True))[-1]
        for k in (1, 5):
            spec = list(gen.generate(model, tok, ids, 32, gen.Sampling(temperature=0), set(), True, draft="ngram",
                                     speculate=k))[-1]
            assert spec.token_ids == plain.token_ids, (prompt, k)
            s = spec.extra["speculation"]
            assert s["accepted"] + s["verify_steps"] == len(spec.token_ids) - 1
            kept += s["accepted"]
    assert kept > 0


def test_sampled_acceptance_keeps_the_models_distribution():
    """keep() over the sampler's draws (gen.sample at temperature 0.7) with a fixed proposal: the
    first token handed out is distributed as the model's p, and so is the second, given the
    first (chi-square over 8,000 draws against the 0.1% critical value), whatever the proposal;
    a proposal equal to the draw is kept."""
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    logits = torch.log(torch.stack([p, q])) * 0.7  # [2, V]: after the last token, after the proposal
    s = gen.Sampling(temperature=0.7)
    n = 8000
    for proposal in (0, 3):
        first, second, kept = torch.zeros(5), torch.zeros(5), 0
        for _ in range(n):
            new = keep([proposal], gen.sample(logits, s).tolist())
            first[new[0]] += 1
            if len(new) == 2:
                assert new[0] == proposal
                second[new[1]] += 1
                kept += 1
        chi2 = float(((first - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 18.5, (proposal, first.tolist())  # 4 degrees of freedom, p = 0.001
        assert abs(kept / n - float(p[proposal])) < 0.03
        live = q > 0
        chi2 = float(((second[live] - kept * q[live]) ** 2 / (kept * q[live])).sum())
        assert chi2 < 16.3 and second[~live].sum() == 0, (proposal, second.tolist())  # 3 degrees of freedom



@pytest.mark.slow
def test_a_draft_model_gives_plain_decodings_tokens_and_a_foreign_tokenizer_is_refused(embedded, tmp_path, tiny_gqa):
    """--draft FOLDER: the embedded model's own 4-bit RTN copy drafts for it; greedy output equals
    plain decoding's and most proposals are kept; a model with another tokenizer, or a larger
    vocabulary, is one line."""
    from typer.testing import CliRunner

    from llamactl.cli.app import app
    from llamactl.runtime.load import DEFAULT_MODEL, load

    runner = CliRunner()
    q = tmp_path / "int4"
    r = runner.invoke(app, ["quantize", str(DEFAULT_MODEL), "-o", str(q), "--method", "rtn", "--group-size", "64",
                            "--eval-tokens", "0", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    art, model, tok = embedded
    _, draft, _, _ = load(str(q), "cpu", "float32")
    ids = tok(PROMPTS[1]).input_ids
    plain = list(gen.generate(model, tok, ids, 24, gen.Sampling(temperature=0), set(), True))[-1]
    spec = list(gen.generate(model, tok, ids, 24, gen.Sampling(temperature=0), set(), True, draft=draft))[-1]
    s = spec.extra["speculation"]
    assert spec.token_ids == plain.token_ids and s["draft"] == "model" and s["acceptance"] > 0.5, s
    import json
    import shutil

    args = ["generate", "-p", PROMPTS[1], "-n", "12", "--temperature", "0", "--ignore-eos", "--json", "--device", "cpu"]
    plain_cli = json.loads(runner.invoke(app, args).stdout)
    r = runner.invoke(app, args + ["--draft", "self-int4"])  # the copy made on the fly
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == plain_cli["token_ids"] and "round-to-nearest copy" in r.stderr

    other = tmp_path / "other"  # the random model, its tokenizer's ids 300 and 301 swapped
    shutil.copytree(tiny_gqa, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    r = runner.invoke(app, ["generate", "-p", "x", "-n", "2", "--draft", str(other)])
    assert r.exit_code == 1 and "its tokenizer is not the model's" in r.stderr
    from conftest import make_hf_model

    padded = make_hf_model(tmp_path / "padded", vocab=8256)  # the same tokenizer, a head of 64 more rows
    r = runner.invoke(app, ["generate", "-p", "x", "-n", "2", "--draft", str(padded)])
    assert r.exit_code == 1 and "its vocabulary has 8256 rows, the model's 8192" in r.stderr
