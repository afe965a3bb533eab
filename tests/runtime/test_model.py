"""Parity of llamactl's runtime with transformers' LlamaForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from llamactl.folder.artifact import open_artifact
from llamactl.folder.config import LlamaArgs
from llamactl.runtime.generate import Sampling, generate, sample
from llamactl.runtime.load import load, load_model
from llamactl.runtime.model import rope_inv_freq
from llamactl.runtime.kv_cache import StaticCache

# float32 on both sides: the only differences are summation order (measured max |diff| ~1e-5
# on logits of magnitude ~20).
FP32_ATOL = 2e-4


def _both(path, dtype=torch.float32):
    art = open_artifact(path)
    ours = load_model(art, torch.device("cpu"), dtype)
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return ours, ref


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))


@pytest.mark.parametrize("fixture", ["tiny_mha", "tiny_gqa", "tiny_llama3", "trained_model"])
def test_logits_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    ours, ref = _both(path)
    ids = torch.randint(0, 8192, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(_logits(ours, ids), expected, atol=FP32_ATOL, rtol=0)


def test_llama3_scaling_changes_frequencies(tiny_llama3):
    args = open_artifact(tiny_llama3).args
    assert args.rope_type == "llama3"
    plain = LlamaArgs(**{**args.__dict__, "rope_scaling": {"rope_type": "default"}})
    scaled, base = rope_inv_freq(args), rope_inv_freq(plain)
    assert torch.equal(scaled[0], base[0])  # highest frequency kept
    assert torch.allclose(scaled[-1], base[-1] / 8.0)  # lowest divided by factor


def test_bf16_logits_close_to_transformers(trained_model):
    """bf16 on both sides: rounding of activations differs, so compare loosely and by argmax."""
    ours, ref = _both(trained_model, torch.bfloat16)
    ids = torch.randint(0, 8192, (1, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids).logits.float()
    got = _logits(ours, ids).float()
    assert (got - expected).abs().max() < 0.25
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.97


def test_incremental_decode_matches_full_forward(tiny_gqa):
    ours, _ = _both(tiny_gqa)
    ids = torch.randint(0, 8192, (1, 24), generator=torch.Generator().manual_seed(3))
    full = _logits(ours, ids)
    cache = StaticCache.for_model(ours, 1, 64)
    with torch.no_grad():
        ours(ids[:, :16], torch.arange(16), cache)
        steps = [ours(ids[:, i : i + 1], torch.tensor([i]), cache) for i in range(16, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 16:], atol=FP32_ATOL, rtol=0)


def test_greedy_matches_transformers_64_tokens(trained_model):
    art, ours, tok, _ = load(str(trained_model), "cpu", "float32")
    ref = AutoModelForCausalLM.from_pretrained(str(trained_model), dtype=torch.float32).eval()
    prompt = tok("The kernel scheduler decides").input_ids
    events = list(generate(ours, tok, prompt, 64, Sampling(temperature=0.0), set(), ignore_eos=True))
    got = events[-1].token_ids
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                           pad_token_id=3)
    expected = out[0, len(prompt):].tolist()
    assert len(got) == 64
    assert got == expected


def test_sharded_and_tied_checkpoints_load(tmp_path):
    from conftest import make_hf_model

    path = make_hf_model(tmp_path / "sharded", tie=True, shard_bytes="300KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    ours, ref = _both(path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = torch.randint(0, 8192, (1, 32))
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(_logits(ours, ids), expected, atol=FP32_ATOL, rtol=0)


def test_same_seed_same_tokens(trained_model):
    _, ours, tok, _ = load(str(trained_model), "cpu", "float32")
    prompt = tok("Python").input_ids
    s = Sampling(temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a = list(generate(ours, tok, prompt, 20, s, set(), ignore_eos=True))[-1].token_ids
    b = list(generate(ours, tok, prompt, 20, s, set(), ignore_eos=True))[-1].token_ids
    c = list(generate(ours, tok, prompt, 20, Sampling(temperature=1.0, seed=8), set(), ignore_eos=True))[-1].token_ids
    assert a == b
    assert a != c


def test_fused_projections_give_the_same_logits(tiny_gqa):
    ours, _ = _both(tiny_gqa)
    ids = torch.randint(0, 8192, (2, 40), generator=torch.Generator().manual_seed(4))
    before = _logits(ours, ids)
    ours.fuse_projections()
    assert ours.model.layers[0].self_attn.q_proj is None and ours.model.layers[0].mlp.gate_up_proj is not None
    torch.testing.assert_close(_logits(ours, ids), before, atol=1e-5, rtol=0)


def test_gumbel_sampling_follows_the_filtered_softmax():
    """Sampling (graph-safe Gumbel-max) draws from softmax(logits / T) restricted by top-k and top-p."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    draws = sample(logits, Sampling(temperature=0.7))
    freq = torch.bincount(draws, minlength=6).float() / draws.numel()
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.01, rtol=0)
    topk = sample(logits, Sampling(temperature=1.0, top_k=2))
    assert set(topk.tolist()) == {0, 1}
    p = logits[0].softmax(-1)  # 0.55, 0.20, 0.12, ...: top_p 0.7 keeps the first two (0.55 < 0.7)
    top_p = sample(logits, Sampling(temperature=1.0, top_p=0.7))
    assert set(top_p.tolist()) == {0, 1}
    assert abs((top_p == 0).float().mean().item() - (p[0] / p[:2].sum()).item()) < 0.015


@pytest.mark.parametrize("which", ["trained_model", "tiny_gqa"])
def test_rows_at_their_own_positions_decode_as_each_alone(which, request):
    """Batched decoding's first step (issue 20): three prompts of different lengths, each prefilled
    into its own cache row (one joining while the others are mid-decode), decoded together with
    each row at its own position, give exactly the greedy tokens each gives alone (float32, CPU)."""
    import torch

    from conftest import greedy_alone

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(request.getfixturevalue(which)), torch.device("cpu"), torch.float32)
    prompts = [torch.arange(10, 15), torch.arange(100, 109), torch.arange(300, 313)]  # 5, 9, 13 tokens
    n = 6

    want = [greedy_alone(model, p, n) for p in prompts]
    with torch.inference_mode():
        got = _batched(model, prompts, n)
    assert [g[:n] for g in got] == want


def _batched(model, prompts, n):
    import torch

    from llamactl.runtime.step import Decoder

    dec = Decoder(model, 3, 40)
    toks = torch.zeros(3, dtype=torch.long)
    pos = torch.zeros(3, dtype=torch.long)
    got = [[], [], []]
    for r in (0, 1):
        toks[r] = dec.prefill(prompts[r].view(1, -1), slot=r)[0]
        pos[r] = prompts[r].numel()
    for step in range(n + 2):
        if step == 2:  # row 2 joins while rows 0 and 1 decode
            toks[2] = dec.prefill(prompts[2].view(1, -1), slot=2)[0]
            pos[2] = prompts[2].numel()
        active = [r for r in range(3) if step < n + (2 if r == 2 else 0) and (r != 2 or step >= 2)]
        for r in active:
            got[r].append(int(toks[r]))
        toks = dec.step(toks, pos).clone()
        pos = pos + 1
    return got


def test_a_batch_bucket_steps_the_first_rows_alone(tiny_gqa):
    """step() with fewer rows than the cache (a bucket) runs cache rows 0..b-1 only: their tokens
    are those of the full step, and the rows above keep their cache."""
    import torch

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    prompts = [torch.arange(10, 15), torch.arange(100, 109), torch.arange(300, 313), torch.arange(7, 11)]
    with torch.inference_mode():
        dec = Decoder(model, 4, 40)
        toks = torch.cat([dec.prefill(p.view(1, -1), slot=r) for r, p in enumerate(prompts)])
        pos = torch.tensor([p.numel() for p in prompts])
        above = dec.cache.layers[0].k[2:].clone()
        part = dec.step(toks[:2], pos[:2]).clone()
        assert torch.equal(dec.cache.layers[0].k[2:], above)
        full = dec.step(toks, pos)  # rewrites rows 0-1 at the same positions
    assert part.shape == (2,) and torch.equal(part, full[:2])
    with pytest.raises(ValueError, match="5 rows for a cache of 4"):
        dec.step(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long))


@pytest.mark.slow
def test_a_compiled_step_serves_its_batch_buckets_with_one_compile(tiny_gqa):
    """A server's compiled step (rows at their own positions) compiles once for every bucket of 2
    rows up to the cache's rows less one, and gives the eager step's tokens (CPU float32)."""
    import torch
    from torch._dynamo.utils import counters

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model
    from llamactl.runtime.sampling import RowSampling

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    prompts = [torch.arange(10, 15), torch.arange(100, 109), torch.arange(300, 313)]
    out = {}
    with torch.inference_mode():
        for mode in ("eager", "compile"):
            dec = Decoder(model, 4, 40, mode, rows=RowSampling.make([Sampling(temperature=0)] * 4, "cpu"))
            dec.rows.greedy = True
            toks = torch.cat([dec.prefill(p.view(1, -1), slot=r) for r, p in enumerate(prompts)])
            pos = torch.tensor([p.numel() for p in prompts])
            steps = [dec.step(toks[:2], pos[:2]).clone()]
            graphs = counters["stats"]["unique_graphs"]
            steps.append(dec.step(toks, pos).clone())  # 3 rows: the same compile as 2
            out[mode] = (steps, counters["stats"]["unique_graphs"] - graphs)
    assert out["compile"][1] == 0
    assert all(torch.equal(a, b) for a, b in zip(out["eager"][0], out["compile"][0]))


@pytest.mark.slow
def test_compiled_cpu_steps_skip_guards_only_where_checked(tiny_gqa):
    """A compiled CPU step runs a kind's later calls without Dynamo's guards (Decoder._checked);
    a second Decoder of another batch and cache length on the same model still gets its own
    compile, and both give the eager steps' tokens."""
    import torch

    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    prompt = torch.arange(10, 17).view(1, -1)

    def run(mode: str, batch: int, max_seq: int) -> list[torch.Tensor]:
        dec = Decoder(model, batch, max_seq, mode)
        tok = dec.prefill(prompt.expand(batch, -1))
        out = []
        for i in range(4):
            tok = dec.step(tok, prompt.shape[1] + i)
            out.append(tok.clone())
        assert dec._skip_guards == (mode == "compile") and len(dec._checked) == (mode == "compile")
        return out

    with torch.inference_mode():
        for batch, max_seq in ((1, 24), (2, 40)):
            assert all(torch.equal(a, b) for a, b in zip(run("eager", batch, max_seq), run("compile", batch, max_seq)))
