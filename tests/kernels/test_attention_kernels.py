"""llamactl's Triton decode attention (split-KV, one position for all rows or one each, the folded
RoPE and cache write) against softmax over the filled cache, and the plans that launch it. Without
CUDA through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llamactl.kernels import attention  # noqa: E402
from llamactl.runtime.kv_cache import StaticCache
from test_kernels import ATTN_DTYPE, DEV, rel  # noqa: E402


@pytest.mark.parametrize("kv_heads,rep,max_seq", [(2, 4, 700), (3, 1, 100), (1, 8, 1500)])
@pytest.mark.slow
def test_decode_attention_matches_softmax_over_the_filled_cache(kv_heads, rep, max_seq):
    torch.manual_seed(max_seq)
    d = 64
    q = torch.randn(2, kv_heads, rep, d, device=DEV, dtype=ATTN_DTYPE)
    k = torch.randn(2, kv_heads, max_seq, d, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    splits, chunk = attention.plan(max_seq)
    for pos in sorted(p for p in {0, 1, chunk - 1, chunk, max_seq // 2, max_seq - 1} if p < max_seq):
        out = attention.decode_attention(q, k, v, torch.tensor([pos], device=DEV))
        scores = q.double() @ k[:, :, : pos + 1].double().transpose(-1, -2) / d**0.5
        ref = scores.softmax(-1) @ v[:, :, : pos + 1].double()
        assert rel(out.cpu(), ref.cpu()) < 5e-3, pos


@pytest.mark.parametrize("min_chunk,block_s,warps,stages", [(32, 32, 2, 2), (128, 64, 4, 3), (512, 32, 4, 1),
                                                            (1024, 64, 4, 2)])
@pytest.mark.slow
def test_decode_attention_launch_plans_agree(min_chunk, block_s, warps, stages):
    """The plans a kernel sweep tries give the same attention as the default one (1024: one
    split over the 700-position cache, the output stored by the split kernel, no merge)."""
    torch.manual_seed(min_chunk)
    q = torch.randn(1, 2, 4, 64, device=DEV, dtype=ATTN_DTYPE)
    k = torch.randn(1, 2, 700, 64, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    for pos in (0, 31, 300, 699):
        p = torch.tensor([pos], device=DEV)
        ref = attention._attend(q, k, v, p, None)
        got = attention._attend(q, k, v, p, None, min_chunk, block_s, warps, stages=stages)
        assert rel(got.cpu(), ref.double().cpu()) < 5e-3


def test_plan_covers_the_cache_with_few_power_of_two_splits():
    for s in (1, 64, 255, 256, 700, 4096, 16640, 131072):
        for min_chunk in (32, 64, 512):
            splits, chunk = attention.plan(s, min_chunk)
            assert splits & (splits - 1) == 0 and splits <= attention.MAX_SPLITS
            assert splits * chunk >= s and chunk % min_chunk == 0


@pytest.mark.parametrize("min_chunk", [64, 512], ids=["splits", "one-split"])
def test_decode_attention_with_rope_writes_the_cache_and_matches_the_unfused_steps(min_chunk):
    """The decode step's attention (RoPE and the cache write folded in), with the default plan and
    with one split over the cache (the split kernel stores the output; no merge)."""
    from llamactl.runtime.model import apply_rope

    torch.manual_seed(5)
    b, kv, rep, d, max_seq = 2, 2, 4, 64, 300
    k_cache = torch.randn(b, kv, max_seq, d, device=DEV, dtype=ATTN_DTYPE)
    v_cache = torch.randn_like(k_cache)
    q, k_new, v_new = (torch.randn(b, kv, n, d, device=DEV, dtype=ATTN_DTYPE) for n in (rep, 1, 1))
    ang = torch.rand(d // 2, device=DEV) * 3
    cos, sin = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()  # [D], rotate-half layout
    for pos in (0, 63, 64, 170):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = attention.decode_attention_rope(q, k_new[:, :, 0], v_new[:, :, 0], kc, vc, cos, sin,
                                              torch.tensor([pos], device=DEV), min_chunk)
        qr = apply_rope(q.double(), cos.double()[None], sin.double()[None])  # [B, KV, R, D]
        kr = apply_rope(k_new.double(), cos.double()[None], sin.double()[None])[:, :, 0]
        assert rel(kc[:, :, pos].cpu(), kr.cpu()) < 2e-3 and torch.equal(vc[:, :, pos], v_new[:, :, 0])
        untouched = torch.ones(max_seq, dtype=torch.bool)
        untouched[pos] = False
        assert torch.equal(kc[:, :, untouched.to(DEV)], k_cache[:, :, untouched.to(DEV)])
        keys = kc[:, :, : pos + 1].double()
        ref = torch.softmax(qr @ keys.transpose(-1, -2) / d**0.5, -1) @ vc[:, :, : pos + 1].double()
        assert rel(out.cpu(), ref.cpu()) < 5e-3, pos


@pytest.mark.parametrize("min_chunk", [64, 512], ids=["splits", "one-split"])
def test_decode_attention_reads_each_row_to_its_own_position(min_chunk):
    """pos: [B]: every row attends to its own cache prefix, and with RoPE each row is rotated at,
    and writes its new key and value to, its own position (the rows of a served batch)."""
    from llamactl.runtime.model import apply_rope

    torch.manual_seed(6)
    b, kv, rep, d, max_seq = 3, 2, 4, 64, 300
    pos = torch.tensor([0, 170, 64], device=DEV)
    q, k_new, v_new = (torch.randn(b, kv, n, d, device=DEV, dtype=ATTN_DTYPE) for n in (rep, 1, 1))
    k = torch.randn(b, kv, max_seq, d, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    out = attention.decode_attention(q, k, v, pos, min_chunk)
    ang = torch.rand(b, d // 2, device=DEV) * 3
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [B, D]
    kc, vc = k.clone(), v.clone()
    fused = attention.decode_attention_rope(q, k_new[:, :, 0], v_new[:, :, 0], kc, vc, cos, sin, pos, min_chunk)
    for i, p_ in enumerate(pos.tolist()):
        keys, vals = k[i, :, : p_ + 1].double(), v[i, :, : p_ + 1].double()
        ref = torch.softmax(q[i].double() @ keys.transpose(-1, -2) / d**0.5, -1) @ vals
        assert rel(out[i].cpu(), ref.cpu()) < 5e-3, i
        c, s_ = cos[i].double()[None], sin[i].double()[None]
        qr, kr = apply_rope(q[i : i + 1].double(), c, s_)[0], apply_rope(k_new[i : i + 1].double(), c, s_)[0, :, 0]
        assert rel(kc[i, :, p_].cpu(), kr.cpu()) < 2e-3 and torch.equal(vc[i, :, p_], v_new[i, :, 0])
        keys = kc[i, :, : p_ + 1].double()
        ref = torch.softmax(qr @ keys.transpose(-1, -2) / d**0.5, -1) @ vc[i, :, : p_ + 1].double()
        assert rel(fused[i].cpu(), ref.cpu()) < 5e-3, i
    with pytest.raises(ValueError, match="2 positions for 3 rows"):
        attention.decode_attention(q, k, v, pos[:2])


def test_decode_attention_reads_slices_of_the_fused_projection_as_they_are():
    """q, k_new and v_new as the model passes them at several rows (views into the fused qkv
    output, each row's heads contiguous, rows (H + 2 H_kv) D apart): the kernel reads them in place
    (kernels.attention._rows) and gives the same bits as from contiguous copies; other layouts are
    copied first."""
    torch.manual_seed(7)
    b, kv, rep, d, max_seq = 3, 2, 4, 64, 200
    qkv = torch.randn(b, 1, (kv * rep + 2 * kv) * d, device=DEV, dtype=ATTN_DTYPE)
    q, k_new, v_new = qkv.split([kv * rep * d, kv * d, kv * d], dim=-1)
    q, k_new, v_new = q.reshape(b, kv, rep, d), k_new.reshape(b, kv, d), v_new.reshape(b, kv, d)
    assert not q.is_contiguous() and attention._rows(q) == (q, qkv.shape[-1])
    k = torch.randn(b, kv, max_seq, d, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    pos = torch.tensor([5, 150, 64], device=DEV)
    ang = torch.rand(b, d // 2, device=DEV) * 3
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [B, D]
    outs, caches = [], []
    for args in ((q, k_new, v_new), (q.contiguous(), k_new.contiguous(), v_new.contiguous())):
        kc, vc = k.clone(), v.clone()
        outs.append(attention.decode_attention_rope(args[0], args[1], args[2], kc, vc, cos, sin, pos))
        caches.append((kc, vc))
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(x, y) for x, y in zip(*caches))
    plain = attention.decode_attention(q, k, v, pos)
    assert torch.equal(plain, attention.decode_attention(q.contiguous(), k, v, pos))
    odd = q.transpose(2, 3)  # [B, H_kv, D, R]: not rows of contiguous heads: copied
    assert attention._rows(odd)[0].is_contiguous()


def rows_step(model, fmt=None, dev: str = DEV):
    """A decode step of 3 rows at their own positions (pos [B, 1]) after prompts of 3, 9 and 5
    tokens joined one by one, each call over a fresh StaticCache in fmt (runtime.kv_format; None:
    the model's dtype): () -> logits [3, V]."""
    torch.manual_seed(3)
    lens = [3, 9, 5]
    prompts = [torch.randint(0, 8192, (1, n), device=dev) for n in lens]
    tok = torch.randint(0, 8192, (3, 1), device=dev)
    pos = torch.tensor(lens, device=dev).view(-1, 1)  # [B, 1]: each row's next position

    def step():
        cache = StaticCache.for_model(model, 3, 64, fmt=fmt)
        for r, ids in enumerate(prompts):
            model(ids, torch.arange(ids.shape[1], device=dev), cache, slot=r)
        return model(tok, pos, cache)[:, -1]  # [B, V]

    return step


def test_rows_at_their_own_positions_run_the_decode_kernel_and_match_sdpa(tiny_gqa, monkeypatch):
    """A decode step of rows at different positions (pos [B, 1]) goes through llamactl's attention
    kernel (RoPE and the cache write folded in) and gives the logits SDPA gives over each row's
    own prefix."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions

    model = load_model(open_artifact(tiny_gqa), torch.device(DEV), torch.float32)
    step = rows_step(model)
    with torch.inference_mode():
        prepare(model, RuntimeOptions(kernels=False), interpreter=True)
        ref = step()
        prepare(model, RuntimeOptions(), interpreter=True)
        assert model.model.layers[0].self_attn.decode_kernel == "rope"
        launched = []
        attend = attention._attend
        monkeypatch.setattr(attention, "_attend", lambda q, k, v, pos, *a, **kw: launched.append(pos.numel())
                            or attend(q, k, v, pos, *a, **kw))
        got = step()
    assert launched == [3] * len(model.model.layers)  # the kernel ran, with a position per row
    assert rel(got.cpu(), ref.cpu()) < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_attention_min_chunk_sets_the_plan_and_the_label():
    """attn_min_chunk: one split where the chunk covers the cache (the same attention, one
    kernel), named in reports."""
    torch.manual_seed(6)
    q = torch.randn(1, 2, 4, 64, device=DEV, dtype=ATTN_DTYPE)
    k = torch.randn(1, 2, 300, 64, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    pos = torch.tensor([250], device=DEV)
    ref = attention.decode_attention(q, k, v, pos)
    assert attention.plan(300, 512)[0] == 1
    assert rel(attention.decode_attention(q, k, v, pos, 512).cpu(), ref.double().cpu()) < 5e-3
    assert attention.label(512) == "triton split-kv, min chunk 512" and attention.label() == "triton split-kv"


def test_many_rows_take_fewer_splits():
    """Enough rows x KV heads fill the GPU without splitting the cache: the plan halves its splits
    while heads x splits stays at `fill` programs or more (none on the CPU: fill 0)."""
    assert attention.plan(640, 64) == (16, 64)
    assert attention.plan(640, 64, heads=32, fill=528) == (16, 64)  # batch 1, 32 heads: kept
    assert attention.plan(640, 64, heads=256, fill=528) == (4, 192)  # 8 rows
    assert attention.plan(640, 64, heads=1024, fill=528) == (1, 640)  # 32 rows: one program a head
    assert attention._fill(torch.device("cpu")) == 0


def _scatter_pool(k: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, H_kv, S, D] -> a pool [blocks, block_size, H_kv, D] holding each row's positions in
    shuffled blocks (block 0 left as garbage) and the table [B, S / block_size] int32."""
    b, h, s, d = k.shape
    per = s // block_size
    order = torch.randperm(b * per, generator=torch.Generator().manual_seed(seed)) + 1  # block 0: the null block
    pool = torch.randn(b * per + 1, block_size, h, d, dtype=k.dtype, device=k.device)
    table = order.view(b, per).to(torch.int32)
    for i in range(b):
        for j in range(per):
            pool[table[i, j]] = k[i, :, j * block_size : (j + 1) * block_size].transpose(0, 1)
    return pool, table.to(k.device)


@pytest.mark.parametrize("row_chunks", [False, True], ids=["capacity-chunks", "row-chunks"])
@pytest.mark.parametrize("block_size,rep", [(16, 4), (32, 1)])
def test_paged_decode_attention_reads_each_row_through_its_block_table(block_size, rep, row_chunks, monkeypatch):
    """The paged kernel against a float64 softmax over each row's own positions, rows at different
    lengths, the blocks of the rows interleaved in the pool; its splits cutting the table's
    capacity or each row's own positions (PAGED_ROW_CHUNKS)."""
    monkeypatch.setattr(attention, "PAGED_ROW_CHUNKS", row_chunks)
    torch.manual_seed(block_size)
    b, kv, d, s = 3, 2, 64, 256
    q = torch.randn(b, kv, rep, d, device=DEV, dtype=ATTN_DTYPE)
    k = torch.randn(b, kv, s, d, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    kp, table = _scatter_pool(k, block_size, 1)
    vp, _ = _scatter_pool(v, block_size, 1)
    pos = torch.tensor([0, 77, s - 1], device=DEV)
    out = attention.paged_decode_attention(q, kp, vp, table, pos)
    for i, p in enumerate(pos.tolist()):
        scores = q[i].double() @ k[i, :, : p + 1].double().transpose(-1, -2) / d**0.5
        ref = scores.softmax(-1) @ v[i, :, : p + 1].double()
        assert rel(out[i].cpu(), ref.cpu()) < 5e-3, p


@pytest.mark.parametrize("row_chunks", [False, True], ids=["capacity-chunks", "row-chunks"])
def test_paged_decode_attention_with_rope_writes_its_block_and_nothing_else(row_chunks, monkeypatch):
    from llamactl.runtime.model import apply_rope

    monkeypatch.setattr(attention, "PAGED_ROW_CHUNKS", row_chunks)
    torch.manual_seed(9)
    b, kv, rep, d, s, bs = 2, 2, 2, 64, 128, 16
    k = torch.randn(b, kv, s, d, device=DEV, dtype=ATTN_DTYPE)
    v = torch.randn_like(k)
    kp, table = _scatter_pool(k, bs, 2)
    vp, _ = _scatter_pool(v, bs, 2)
    q, k_new, v_new = (torch.randn(b, kv, n, d, device=DEV, dtype=ATTN_DTYPE) for n in (rep, 1, 1))
    ang = torch.rand(b, d // 2, device=DEV) * 3
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [B, D]
    pos = torch.tensor([40, 95], device=DEV)
    kp2, vp2 = kp.clone(), vp.clone()
    out = attention.paged_decode_attention_rope(q, k_new[:, :, 0], v_new[:, :, 0], kp2, vp2, table, cos, sin, pos)
    changed = (kp2 != kp).any(-1).any(-1)  # [blocks, block_size]
    for i, p in enumerate(pos.tolist()):
        blk, off = int(table[i, p // bs]), p % bs
        assert changed[blk, off] and torch.equal(vp2[blk, off], v_new[i, :, 0])
        kr = apply_rope(k_new[i].double(), cos[i].double()[None], sin[i].double()[None])[:, 0]  # [KV, D]
        assert rel(kp2[blk, off].cpu(), kr.cpu()) < 2e-3
        qr = apply_rope(q[i].double(), cos[i].double()[None], sin[i].double()[None])
        keys = torch.cat([k[i, :, :p].double(), kr[:, None]], 1)
        vals = torch.cat([v[i, :, :p].double(), v_new[i].double()], 1)
        ref = torch.softmax(qr @ keys.transpose(-1, -2) / d**0.5, -1) @ vals
        assert rel(out[i].cpu(), ref.cpu()) < 5e-3
    assert int(changed.sum()) == b


@pytest.mark.parametrize("block_size,rep", [(16, 4), (8, 1), (32, 2)])
def test_packed_prefill_attention_matches_softmax_over_each_sequence(block_size, rep):
    """The prefill kernel of sequences packed end to end (kernels.prefill_attention): each new token
    against a float64 softmax over its own sequence's positions up to it, read through the block
    table (a cached prefix before some, tiles cut mid-sequence), and the PyTorch reference alike."""
    from llamactl.kernels.prefill_attention import ragged_attention
    from llamactl.runtime.kv_cache import PagedCache
    from llamactl.runtime.ragged import Ragged, reference

    torch.manual_seed(block_size)
    hkv, d, blocks = 2, 64, 40
    cache = PagedCache(1, 3, blocks, block_size, 320, hkv, d, ATTN_DTYPE, DEV)
    order = torch.randperm(blocks - 1)[:30] + 1
    cache.set_rows([0, 1, 2], [order[:10].tolist(), order[10:20].tolist(), order[20:30].tolist()])
    layer = cache.layers[0]
    layer.k.normal_(), layer.v.normal_()
    rows, starts, lens = [2, 0, 1], [0, 37, 5], [70, 3, 1]  # 70 tokens: two tiles; a prefix of 37 and of 5
    r = Ragged.build(cache, rows, starts, lens)
    q = torch.randn(sum(lens), hkv * rep, d, device=DEV, dtype=ATTN_DTYPE)
    out = ragged_attention(q, layer.k, layer.v, cache.table, r)
    flat_k, flat_v = layer.k.flatten(0, 1).double(), layer.v.flatten(0, 1).double()
    t = 0
    for row, start, n in zip(rows, starts, lens):
        for j in range(n):
            pos = torch.arange(start + j + 1, device=DEV)
            at = cache.at(torch.full_like(pos, row), pos)
            for h in range(hkv * rep):
                s = flat_k[at, h // rep] @ q[t, h].double() / d**0.5
                want = s.softmax(0) @ flat_v[at, h // rep]
                assert rel(out[t, h].cpu(), want.cpu()) < 5e-3, (row, j, h)
            t += 1
    assert rel(reference(q.float(), layer.k.float(), layer.v.float(), cache.table, r).cpu(), out.double().cpu()) < 5e-3


def test_a_mixed_forwards_decode_rows_attend_through_the_decode_kernel():
    """Decode rows packed before prompt chunks (a mixed step, runtime.ragged.kernels): the rows'
    single tokens go through the paged decode kernel, the chunks through the prefill kernel, and
    together they match the PyTorch reference, which treats each row as a one-token chunk."""
    from llamactl.runtime.kv_cache import PagedCache
    from llamactl.runtime.ragged import Ragged, kernels, reference

    torch.manual_seed(3)
    hkv, rep, d, bs, blocks = 2, 4, 64, 16, 48
    cache = PagedCache(1, 4, blocks, bs, 320, hkv, d, ATTN_DTYPE, DEV)
    order = (torch.randperm(blocks - 1)[:40] + 1).tolist()
    cache.set_rows([0, 1, 2, 3], [order[:10], order[10:20], order[20:30], order[30:40]])
    layer = cache.layers[0]
    layer.k.normal_(), layer.v.normal_()
    # rows 3 and 1 decode at positions 140 and 7; row 0 prefills 70 tokens after 20, row 2 its first 5
    rows, starts, lens = [3, 1, 0, 2], [140, 7, 20, 0], [1, 1, 70, 5]
    r = Ragged.build(cache, rows, starts, lens, decode=2)
    assert r.tile_seq.tolist() == [2, 2, 3]  # no prefill tiles for the decode rows
    q = torch.randn(sum(lens), hkv * rep, d, device=DEV, dtype=ATTN_DTYPE)
    got = kernels(q, layer.k, layer.v, cache.table, r)
    want = reference(q.float(), layer.k.float(), layer.v.float(), cache.table, r)
    assert rel(got.double().cpu(), want.double().cpu()) < 5e-3
    with pytest.raises(ValueError):
        Ragged.build(cache, rows, starts, [1, 2, 70, 5], decode=2)  # a decode row of two tokens


def test_ops_that_write_their_arguments_take_no_defaults():
    """torch 2.11's custom ops index a mutated argument in the call as passed, which the
    dispatcher sends without its trailing defaults: an op writing an argument must have none."""
    import llamactl.kernels.attention  # noqa: F401 (registers the ops)

    mutating = [name for name in ("decode_attention_rope", "paged_decode_attention_rope")
                if getattr(torch.ops.llamactl, name).default._schema.is_mutable]
    assert len(mutating) == 2
    for name in mutating:
        schema = getattr(torch.ops.llamactl, name).default._schema
        assert not [a.name for a in schema.arguments if a.has_default_value()], name
