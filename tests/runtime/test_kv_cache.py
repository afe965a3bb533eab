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
