"""sampling.RowSampling: per-row settings whose draws do not depend on the batch or the slot."""

from __future__ import annotations

import pytest
import torch

from conftest import GraphStandIn
from llamactl.runtime.sampling import RowSampling, uniforms
from llamactl.runtime.settings import Sampling


def test_uniforms_are_uniform_and_independent_of_the_batch():
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([10, 10, 11])
    u = uniforms(seeds, pos, 50_000)
    assert u.shape == (3, 50_000) and 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert torch.equal(uniforms(seeds[1:2], pos[1:2], 50_000), u[1:2])  # the same draw alone
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[1], u[2])
    lag = torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]  # neighbours in the vocab
    assert abs(float(lag)) < 0.02


def test_row_settings_sample_as_asked():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    rs = RowSampling.make([Sampling(temperature=0), Sampling(temperature=1.0, top_k=1, seed=5),
                           Sampling(temperature=0.7, top_p=1e-6, seed=6), Sampling(temperature=1.0, seed=7)], "cpu")
    pos = torch.tensor([3, 3, 3, 3])
    out = rs.sample(logits, pos)
    best = logits.argmax(-1)
    assert out[0] == best[0] and out[1] == best[1] and out[2] == best[2]  # greedy, top-1, tiny top-p
    draws = torch.stack([rs.sample(logits, pos + i)[3] for i in range(400)])
    assert len(set(draws.tolist())) > 20  # the free row samples widely
    freq = torch.bincount(draws, minlength=100).float() / 400
    assert float((freq - logits[3].softmax(-1)).abs().sum()) < 0.6  # and follows softmax(logits)


@pytest.mark.parametrize("which", ["trained_model"])
def test_a_sampled_row_draws_the_same_tokens_alone_and_in_a_batch(which, request):
    """Rows with their own temperature/top-k/top-p/seed, decoded together at their own positions,
    give each the tokens it gives alone (float32 CPU): batched serving keeps seeds reproducible."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(request.getfixturevalue(which)), torch.device("cpu"), torch.float32)
    prompts = [torch.arange(10, 15), torch.arange(100, 109), torch.arange(300, 313)]
    settings = [Sampling(temperature=0.9, seed=1), Sampling(temperature=0),
                Sampling(temperature=1.2, top_k=40, top_p=0.9, seed=3)]
    n = 8
    with torch.inference_mode():
        want = []
        for p, st in zip(prompts, settings):
            dec = Decoder(model, 1, 40, rows=RowSampling.make([st], "cpu"))
            tok, out = dec.prefill(p.view(1, -1)), []
            for i in range(n):
                out.append(int(tok))
                tok = dec.step(tok, p.numel() + i)
            want.append(out)
        dec = Decoder(model, 3, 40, rows=RowSampling.make(settings, "cpu"))
        toks = torch.cat([dec.prefill(p.view(1, -1), slot=r) for r, p in enumerate(prompts)])
        pos = torch.tensor([p.numel() for p in prompts])
        got = []
        for _ in range(n):
            got.append(toks.tolist())
            toks = dec.step(toks, pos).clone()
            pos = pos + 1
    assert [list(c) for c in zip(*got)] == want
    assert want[0] != want[1]  # the sampled row did sample


def test_graphed_steps_count_each_token_once_and_split_steps_draw_as_whole_ones(trained_model, monkeypatch):
    """Rows with penalties decoded through captured steps (a CUDA graph's stand-in: the capture's
    three warm-up runs, then replays that run the step again) count each generated token once, as
    eager steps do, whether the step is whole (step) or its forward and draw apart (step_logits,
    draw: a grammar's masks made between): the same tokens and counts as eager steps."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime import step as step_mod
    from llamactl.runtime.load import load_model
    from llamactl.runtime.step import Decoder

    stand_in = GraphStandIn(None)
    monkeypatch.setattr(step_mod, "capture", stand_in)
    model = load_model(open_artifact(trained_model), torch.device("cpu"), torch.float32)
    settings = [Sampling(temperature=0, frequency_penalty=1.5), Sampling(temperature=0.8, seed=4, presence_penalty=1.0)]
    prompts = [list(range(10, 16)), list(range(200, 205))]

    def run(graphs: bool, split: bool) -> tuple[list, torch.Tensor]:
        rows = RowSampling.make(settings, "cpu")
        stand_in.rows = rows
        dec = Decoder(model, 2, 40, rows=rows)
        rows.adjust_rows([0, 1], settings, prompts, [[], []], [[], []])
        dec.use_graph = graphs
        with torch.inference_mode():
            toks = torch.cat([dec.prefill(torch.tensor([p]), slot=r) for r, p in enumerate(prompts)])
            pos, got = torch.tensor([len(p) for p in prompts]), []
            for i in range(6):
                rows.adjusted = i >= 2  # (the flag turns on mid-way, as when a request with penalties joins)
                got.append(toks.tolist())
                toks = (dec.draw(dec.step_logits(toks, pos), pos) if split else dec.step(toks, pos)).clone()
                pos = pos + 1
        return got, rows.counts.clone()

    want, counts = run(False, False)
    assert int(counts.sum()) == 2 * 4  # each token fed while adjusted counted once
    for graphs, split in ((True, False), (True, True), (False, True)):
        got, c = run(graphs, split)
        assert got == want and torch.equal(c, counts), (graphs, split)
