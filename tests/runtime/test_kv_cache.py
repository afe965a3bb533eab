"""The KV caches handed to the model: the paged pool (blocks in any order, a table a row) gives the
logits of the static cache, for whole prompts, chunks after a cached prefix, and decode steps of
rows at different lengths (CPU float32)."""

from __future__ import annotations

import torch

from llamactl.runtime.kv_cache import NULL_BLOCK, PagedCache, StaticCache


def _model(path):
    from llamactl.runtime.load import load

    _, model, _, _ = load(str(path), "cpu", "float32")
    return model


def test_paged_cache_gives_the_static_caches_logits(tiny_gqa):
    model = _model(tiny_gqa)
    torch.manual_seed(0)
    max_seq, bs = 64, 8
    static = StaticCache.for_model(model, 2, max_seq)
    paged = PagedCache.for_model(model, 2, 20, bs, max_seq)
    # row 0: blocks 5, 3, 9, ...; row 1: 2, 11, 7, ... (interleaved, out of order)
    paged.set_rows([0, 1], [[5, 3, 9, 1, 13, 15, 17, 19], [2, 11, 7, 4, 6, 8, 10, 12]])
    a, b = torch.randint(0, 8192, (1, 21)), torch.randint(0, 8192, (1, 13))
    with torch.inference_mode():
        for cache in (static, paged):  # row 0: one prompt; row 1: two chunks (the second after 8 tokens)
            cache.out = [model(a, torch.arange(21), cache, slot=0, kv_len=21)[:, -1]]
            model(b[:, :8], torch.arange(8), cache, slot=1, kv_len=8)
            cache.out.append(model(b[:, 8:], torch.arange(8, 13), cache, slot=1, kv_len=13)[:, -1])
            tok = torch.cat([x.argmax(-1) for x in cache.out]).view(2, 1)
            for step in range(12):  # both rows decode, each at its own position
                pos = torch.tensor([[21 + step], [13 + step]])
                logits = model(tok, pos, cache, kv_len=40)[:, -1]
                cache.out.append(logits)
                tok = logits.argmax(-1, keepdim=True)
    for x, y in zip(static.out, paged.out):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_paged_prompts_joining_together_write_their_own_blocks(tiny_mha):
    model = _model(tiny_mha)
    paged = PagedCache.for_model(model, 3, 12, 4, 16)
    paged.set_rows([0, 2], [[3, 4], [7, 1]])
    ids = torch.randint(0, 8192, (2, 8))
    with torch.inference_mode():
        model(ids, torch.arange(8), paged, slot=torch.tensor([0, 2]), kv_len=8, last_only=True)
        written = (paged.layers[0].k != 0).flatten(1).any(1)  # [blocks]
    assert written[[3, 4, 7, 1]].all() and not written[[2, 5, 6, 8, 9, 10, 11]].any()
    assert not written[NULL_BLOCK]
    paged.move(torch.tensor([2]), torch.tensor([1]))
    assert paged.table[1, :2].tolist() == [7, 1]


def test_packed_prompts_give_the_logits_of_each_prompt_alone(tiny_gqa):
    """Several sequences' new tokens in one forward (runtime.ragged): a whole prompt, a chunk after
    a cached prefix, and a one-token chunk, packed end to end, give the logits each one's last token
    gets from the static cache alone (CPU float32)."""
    from llamactl.runtime.ragged import Ragged

    model = _model(tiny_gqa)
    torch.manual_seed(1)
    paged = PagedCache.for_model(model, 3, 30, 8, 64)
    paged.set_rows([0, 1, 2], [[5, 3, 9], [2, 11, 7, 4], [20, 21]])
    a, b, c = (torch.randint(0, 8192, (1, n)) for n in (21, 27, 10))
    with torch.inference_mode():
        first = Ragged.build(paged, [1, 2], [0, 0], [16, 9])  # b's prefix and c's first 9
        model(torch.cat([b[:, :16], c[:, :9]], 1), first.positions, paged, slot=first)
        packed = Ragged.build(paged, [0, 1, 2], [0, 16, 9], [21, 11, 1])
        got = model(torch.cat([a, b[:, 16:], c[:, 9:]], 1), packed.positions, paged, slot=packed)[:, -1]  # [3, V]
        want = [model(x, torch.arange(x.shape[1]), StaticCache.for_model(model, 1, 64), slot=0)[:, -1]
                for x in (a, b, c)]
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)


def test_a_verify_step_of_padded_rows_gives_each_rows_draws_and_writes_nothing_else(tiny_gqa):
    """Decoder.verify_rows (the serving engine's speculative step, runtime.ragged.uniform): rows of
    4, 1 and 0 real tokens (a free row) padded to 4 give the greedy draws each row's tokens get
    from the static cache alone, and change no pool position but the real tokens' own (padding
    writes the null block)."""
    from llamactl.runtime.kv_cache import NULL_BLOCK
    from llamactl.runtime.ragged import Ragged
    from llamactl.runtime.step import Decoder

    model = _model(tiny_gqa)
    torch.manual_seed(2)
    paged = PagedCache.for_model(model, 3, 30, 8, 64)
    paged.set_rows([0, 1], [[5, 3, 9], [2, 11, 7, 4]])
    a, b = torch.randint(0, 8192, (1, 14)), torch.randint(0, 8192, (1, 23))
    dec = Decoder(model, 3, paged.max_seq, "eager", cache=paged)
    with torch.inference_mode():
        pre = Ragged.build(paged, [0, 1], [0, 0], [10, 22])  # a's first 10, b's first 22
        model(torch.cat([a[:, :10], b[:, :22]], 1), pre.positions, paged, slot=pre)
        before = [layer.k.clone() for layer in paged.layers]
        tok = torch.zeros(3, 4, dtype=torch.long)
        tok[0], tok[1, 0] = a[0, 10:14], b[0, 22]
        got = dec.verify_rows(tok, torch.tensor([10, 22, 0]), torch.tensor([4, 1, 0]))  # [3, 4]
        want = [model(x, torch.arange(x.shape[1]), StaticCache.for_model(model, 1, 64), slot=0)[0].argmax(-1)
                for x in (a, b)]  # [S]: the greedy draw after each token
    assert got[0].tolist() == want[0][10:14].tolist() and got[1, 0] == want[1][22]
    written = {(3, p % 8) for p in range(10, 14)} | {(7, 22 % 8)}  # row 0's block 1 is 3, row 1's block 2 is 7
    for layer, old in zip(paged.layers, before):
        changed = {(blk, off) for blk, off in (layer.k != old).any(-1).any(-1).nonzero().tolist()}
        assert changed - {(NULL_BLOCK, o) for o in range(8)} <= written and written <= changed


def test_a_verify_step_whose_graph_fails_to_capture_runs_eagerly(tiny_gqa, monkeypatch):
    """A CUDA graph of a verify step that cannot be captured (capture raises) leaves that shape
    eager, says why in verify_failed, and draws what the eager step draws (for the real row: a
    free row's draws are garbage either way)."""
    from llamactl.runtime import step as step_mod

    model = _model(tiny_gqa)
    paged = PagedCache.for_model(model, 2, 10, 8, 32)
    paged.set_rows([0], [[1, 2]])
    dec = step_mod.Decoder(model, 2, paged.max_seq, "eager", cache=paged)
    args = (torch.tensor([[5, 6, 7], [0, 0, 0]]), torch.tensor([0, 0]), torch.tensor([3, 0]))
    with torch.inference_mode():
        want = dec.verify_rows(*args)
        dec.use_graph = True  # as on a GPU, where capture() then fails

        def fails(*a, **k):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

        monkeypatch.setattr(step_mod, "capture", fails)
        assert torch.equal(dec.verify_rows(*args)[0], want[0]) and torch.equal(dec.verify_rows(*args)[0], want[0])
    assert list(dec.verify_failed) == [(2, 3)] and "not permitted" in dec.verify_failed[2, 3]
