"""llamactl's Triton GEMVs (16-bit, int8 and int4 weights) and the models that run them, against
float64 references (the decode attention: test_attention_kernels; the multi-row products:
test_multirow). Without CUDA they run through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.errors import InputError  # noqa: E402
from llamactl.kernels import gemv, gemv_int4  # noqa: E402
from llamactl.runtime.kv_cache import StaticCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
OFF = "cublas" if DEV == "cuda" else "torch"  # what prepare reports with the kernels off
# Triton's CPU interpreter mishandles bf16 matrix products (tl.dot); attention is checked in fp16 there
ATTN_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
# and it truncates where the GPU rounds bf16 to nearest: results rounded several times are checked in fp16 there
ROUND_DTYPE = ATTN_DTYPE


def rel(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


# how a GEMV kernel loads its weights: per iteration; the next block ahead; or, as with programmatic
# dependent launch (PDL), the first block before waiting for the previous kernel, its iteration peeled
# off the loop (on the CPU the fixed config runs these; on a GPU the autotuner
# chooses between the first two, and PDL is on where the GPU has it)
LOADS = {"load": (False, False), "prefetch": (True, False), "pdl": (False, True), "prefetch-pdl": (True, True)}


@pytest.fixture(params=LOADS.values(), ids=LOADS.keys())
def gemv_prefetch(request, monkeypatch):
    """Each way the 16-bit/int8 kernel loads its weights (LOADS), at the fixed blocks on the GPU too
    (autotuned, the GPU would run its own pick whatever the variant, and tune every new shape:
    run 33's int8-input tests took over 200 s on a fresh machine)."""
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setitem(gemv.GEMV_FIXED, "PREFETCH", request.param[0])
    monkeypatch.setitem(gemv.GEMV_FIXED, "PDL", request.param[1])


@pytest.mark.parametrize("n,k", [(24, 128), (13, 200), (64, 1024)])
def test_gemv_16bit_matches_float64(n, k, gemv_prefetch):
    torch.manual_seed(n + k)
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    y = gemv.gemv_bf16(x, w)
    assert y.shape == (n,) and y.dtype == torch.bfloat16 and not y.isnan().any()
    assert rel(y.cpu(), w.double().cpu() @ x.double().cpu()) < 1e-2  # bf16 output rounding


def test_gemv_folds_rmsnorm_swiglu_and_the_residual(gemv_prefetch):
    torch.manual_seed(2)
    n, k = 24, 192
    w = torch.randn(n, k, device=DEV, dtype=torch.float32)
    x, nw, r = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    y = gemv.gemv(x, w, None, nw, 1e-5, r, False)
    ref = w.double() @ (x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()) + r.double()
    assert rel(y.cpu(), ref.cpu()) < 1e-5
    h = torch.randn(2 * k, device=DEV)
    y = gemv.gemv(h, w, glu=True)
    ref = w.double() @ (F.silu(h[:k].double()) * h[k:].double())
    assert rel(y.cpu(), ref.cpu()) < 1e-5


def test_gemv_applies_swiglu_to_a_fused_gate_up(gemv_prefetch):
    """glu_out: w is a fused [gate; up]; the kernel stores silu(gate) * up, rounded as the unfused
    model rounds (16-bit and int8 weights, with the RMSNorm before it folded in too)."""
    torch.manual_seed(4)
    n, k = 24, 192
    gate, up = torch.randn(n, k, device=DEV), torch.randn(n, k, device=DEV)
    w = torch.cat([gate, up])  # [2n, k]
    x, nw = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()
    ref = F.silu(gate.double() @ xn) * (up.double() @ xn)
    y = gemv.gemv(x, w, None, nw, 1e-5, glu_out=True)
    assert y.shape == (n,) and rel(y.cpu(), ref.cpu()) < 1e-5
    w8 = torch.randint(-127, 128, (2 * n, k), device=DEV, dtype=torch.int8)
    s8 = torch.rand(2 * n, device=DEV) * 0.01 + 1e-3
    h = (w8.double() @ x.double()) * s8.double()
    assert rel(gemv.gemv(x, w8, s8, glu_out=True).cpu(), (F.silu(h[:n]) * h[n:]).cpu()) < 1e-5


def test_gemv_int8_applies_row_scales(gemv_prefetch):
    torch.manual_seed(1)
    n, k = 40, 256
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16)
    w = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s = (torch.rand(n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    ref = (w.double() @ x.double()) * s.double()
    assert rel(gemv.gemv_int8(x, w, s).cpu(), ref.cpu()) < 1e-2


def _int4_case(n, k, g, seed=0):
    torch.manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), device=DEV)
    scales = (torch.rand(n, k // g, device=DEV) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 16, (n, k // g), device=DEV).to(torch.uint8)
    w = (codes.double() - zeros.double().repeat_interleave(g, 1)) * scales.double().repeat_interleave(g, 1)
    return gemv_int4.pack_int4(codes), scales, zeros, w


def _swiglu_rounded(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """silu(gate) * up of a fused [gate; up] output h, rounded to dtype where the model rounds."""
    gate, up = (t.to(dtype).double() for t in h.chunk(2))
    return F.silu(gate).to(dtype).double() * up


def _fixed(config) -> dict:
    """An autotune config as the fixed launch arguments of _launch."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _covering(configs: list) -> list:
    """On the GPU every autotune config; through the interpreter (which ignores warps and stages)
    the fewest that still take every block size and every combination of the other switches."""
    if DEV == "cuda":
        return configs
    need = {f"BLOCK_N={c.kwargs['BLOCK_N']}" for c in configs}
    need |= {repr(sorted((k, v) for k, v in c.kwargs.items() if k != "BLOCK_N")) for c in configs}
    keep = []
    for c in configs:
        has = {f"BLOCK_N={c.kwargs['BLOCK_N']}", repr(sorted((k, v) for k, v in c.kwargs.items() if k != "BLOCK_N"))}
        if has & need:
            keep.append(c)
            need -= has
    return keep


@pytest.mark.parametrize("config", _covering(gemv._bf16_configs()), ids=str)
@pytest.mark.slow
def test_every_gemv_autotune_config_computes_the_product(config, monkeypatch):
    """The autotuner keeps the fastest config, not a correct one: each candidate must be right.
    Odd sizes (rows and K not multiples of the blocks) exercise the masks; int8 and bf16 weights."""
    torch.manual_seed(5)
    n, k = 40, 1100
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setattr(gemv, "GEMV_FIXED", _fixed(config))
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    assert rel(gemv.gemv_bf16(x, w).cpu(), w.double().cpu() @ x.double().cpu()) < 1e-2
    w8 = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s8 = (torch.rand(n, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    assert rel(gemv.gemv_int8(x, w8, s8).cpu(), ((w8.double() @ x.double()) * s8.double()).cpu()) < 1e-2
    xr = x.to(ROUND_DTYPE)  # as a fused [gate; up]: SwiGLU in the epilogue, three roundings
    assert rel(gemv.gemv(xr, w, glu_out=True).cpu(), _swiglu_rounded(w.double() @ xr.double(), ROUND_DTYPE).cpu()) < 1e-2
    x32 = torch.randn(1056, device=DEV)  # int8 inputs (DP4A): whole 32-column blocks, not whole config blocks
    w8 = torch.randint(-127, 128, (n, 1056), device=DEV, dtype=torch.int8)
    y8 = gemv.gemv(x32, w8, s8.float(), inputs="int8")
    assert rel(y8.cpu(), ((w8.double() @ _int8_per_32(x32)) * s8.double()).cpu()) < 1e-5
    y16 = gemv.gemv(x32, w8, s8.float(), inputs="fp16")  # packed fp16: the same config
    assert rel(y16.cpu(), ((w8.double() @ x32.double()) * s8.double()).cpu()) < 2e-3


@pytest.mark.parametrize("config", _covering(gemv_int4._int4_configs()), ids=str)
@pytest.mark.slow
def test_every_int4_autotune_config_computes_the_product(config, monkeypatch):
    n, k, g = 72, 1152, 128  # 9 groups: K is no multiple of the 1024/2048-column blocks
    q, s, z, w = _int4_case(n, k, g, seed=7)
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setattr(gemv_int4, "INT4_FIXED", _fixed(config))
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16)
    assert rel(gemv_int4.gemv_int4(x, q, s, z, g).cpu(), (w @ x.double()).cpu()) < 1e-2
    xr = x.to(ROUND_DTYPE)
    assert rel(gemv_int4.gemv_int4(xr, q, s, z, g, glu_out=True).cpu(), _swiglu_rounded(w @ xr.double(), ROUND_DTYPE).cpu()) < 1e-2
    y16 = gemv_int4.gemv_int4(x.float(), q, s, z, g, inputs="fp16")  # packed fp16: the same config
    assert rel(y16.cpu(), (w @ x.double()).cpu()) < 2e-3
    assert rel(gemv_int4.gemv_int4(x.float(), q, s, z, g, inputs="int8").cpu(), (w @ x.double()).cpu()) < 2e-2  # int8 inputs


@pytest.mark.slow
def test_autotuned_launch_tries_every_candidate_and_keeps_the_fastest(monkeypatch):
    """The GPU's launch path (triton.autotune with the call's GLU_OUT keyword and the int4 pruning),
    here with a stand-in benchmark that makes the last candidate the fastest: each candidate runs,
    the last one is kept, and its product is right."""
    import itertools

    import triton

    if DEV == "cuda":
        pytest.skip("the GPU benchmarks for real (test_every_*_autotune_config covers each candidate)")
    def stand_in(clock):
        def bench(call, quantiles):
            call()  # the candidate runs, through the interpreter
            return [float(next(clock))] * 3  # every later candidate is faster

        return bench

    clocks = [itertools.count(1000, -1), itertools.count(1000, -1)]
    for tuned, clock in zip((gemv._gemv_tuned, gemv_int4._gemv_int4_tuned), clocks):
        monkeypatch.setattr(tuned, "_do_bench", stand_in(clock))
        monkeypatch.setattr(tuned, "cache", {})
    x = torch.randn(256, dtype=torch.float16)
    w = torch.randn(64, 256, dtype=torch.float16)
    y = torch.empty(32, dtype=x.dtype)  # glu_out: w is a fused [gate; up]
    gemv._gemv_tuned[lambda m: (triton.cdiv(32, m["BLOCK_N"] // 2),)](
        x, w, w, x, x, y, 64, 256, 1e-6, False, False, False, False, False, GLU_OUT=True)
    assert gemv._gemv_tuned.best_config.kwargs == gemv._bf16_configs()[-1].kwargs
    assert rel(y, _swiglu_rounded(w.double() @ x.double(), torch.float16)) < 1e-2
    q, s4, z4, w4 = _int4_case(64, 512, 128, seed=9)
    y4 = torch.empty(64, dtype=x.dtype)
    x4 = torch.randn(512, dtype=torch.float16)
    gemv_int4._gemv_int4_tuned[lambda m: (triton.cdiv(64, m["BLOCK_N"]),)](
        x4, q, q, s4, z4, x4, x4, y4, 64, 512, 1e-6, 128, False, False, False, False, GLU_OUT=False)
    assert gemv_int4._gemv_int4_tuned.best_config.kwargs == gemv_int4._int4_configs()[-1].kwargs
    assert rel(y4, w4 @ x4.double()) < 1e-2
    # each candidate was benchmarked once (int4: all of them divide into groups of 128)
    assert [1000 - next(c) for c in clocks] == [len(gemv._bf16_configs()), len(gemv_int4._int4_configs())]
    # int8 inputs: the pruned candidates only (the same stand-in benchmark counts on)
    before = next(clocks[0])
    w8 = torch.randint(-127, 128, (64, 256), dtype=torch.int8)
    s8 = torch.rand(64) * 0.01 + 1e-3
    y8 = torch.empty(64, dtype=torch.float32)
    x32 = x.float()
    gemv._gemv_tuned[lambda m: (triton.cdiv(64, m["BLOCK_N"]),)](
        x32, w8, s8, x32, x32, y8, 64, 256, 1e-6, True, False, False, False, False, GLU_OUT=False, A8=True)
    benchmarked = before - next(clocks[0]) - 1
    named = {"x_ptr": x, "N": 64, "K": 256, "HAS_SCALE": True, "NORM": False, "GLU": False, "RESIDUAL": False}
    assert benchmarked == len(gemv._prune_gemv(gemv._bf16_configs(), named, A8=True)) < len(gemv._bf16_configs())
    assert rel(y8, (w8.double() @ _int8_per_32(x32)) * s8.double()) < 1e-5


def test_programmatic_dependent_launch_is_for_compiled_kernels_on_hopper(monkeypatch):
    from llamactl.kernels import device

    monkeypatch.setattr(device, "interpreted", lambda: False)
    for capability, on in [((9, 0), True), ((10, 0), True), ((8, 0), False)]:
        monkeypatch.setattr(device, "capability", lambda index, c=capability: c)
        assert device.pdl_supported(torch.device("cuda", 0)) is on, capability
    assert not device.pdl_supported(torch.device("cpu"))
    monkeypatch.setattr(device, "interpreted", lambda: True)
    assert not device.pdl_supported(torch.device("cuda", 0))
    assert device.pdl_launch(True) == {"PDL": True, "launch_pdl": True} and device.pdl_launch(False) == {"PDL": False}


def test_int4_kernels_refuse_partial_groups():
    q = torch.zeros(8, 20, dtype=torch.int32, device=DEV)  # 160 columns: no whole groups of 128
    s, z = torch.ones(8, 2, dtype=torch.float16, device=DEV), torch.zeros(8, 2, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="whole groups"):
        gemv_int4.gemv_int4(torch.zeros(160, device=DEV), q, s, z, 128)
    with pytest.raises(ValueError, match="whole groups"):
        gemv_int4.dequantize_int4(q, s, z, 128, torch.float32)


def test_pack_int4_puts_column_8i_plus_j_in_nibble_j():
    codes = torch.arange(16).repeat(2, 1)  # [2, 16]: 0..15 per row
    words = gemv_int4.pack_int4(codes)
    assert words.dtype == torch.int32 and words.shape == (2, 2)
    assert words[0, 0].item() == 0x76543210
    assert (words[0, 1].item() & 0xFFFFFFFF) == 0xFEDCBA98  # top nibble set: stored as a negative int32


@pytest.fixture(params=[(*v, False) for v in LOADS.values()] + [(False, False, True)], ids=[*LOADS, "x-contig"])
def int4_prefetch(request, monkeypatch):
    """Each way the int4 kernel loads its weights (LOADS), and x in one piece (X_CONTIG), at the
    fixed blocks on the GPU too (see gemv_prefetch)."""
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setitem(gemv_int4.INT4_FIXED, "PREFETCH", request.param[0])
    monkeypatch.setitem(gemv_int4.INT4_FIXED, "PDL", request.param[1])
    monkeypatch.setitem(gemv_int4.INT4_FIXED, "X_CONTIG", request.param[2])


@pytest.mark.parametrize("n,k,g", [(24, 256, 128), (20, 512, 64), (16, 384, 128), (8, 640, 128)])
def test_gemv_int4_and_dequantize_match_the_formula(n, k, g, int4_prefetch):
    q, s, z, w = _int4_case(n, k, g, seed=n)
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(gemv_int4.dequantize_int4(q, s, z, g, torch.float32).double(), w.float().double())
    assert rel(gemv_int4.gemv_int4(x, q, s, z, g).cpu(), (w @ x.double()).cpu()) < 1e-2


def test_gemv_int4_folds_rmsnorm_swiglu_and_the_residual(int4_prefetch):
    n, k, g = 16, 384, 128
    q, s, z, w = _int4_case(n, k, g, seed=3)
    x, nw, r = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    y = gemv_int4.gemv_int4(x, q, s, z, g, nw, 1e-5, r, False)
    ref = w @ (x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()) + r.double()
    assert rel(y.cpu(), ref.cpu()) < 1e-5
    h = torch.randn(2 * k, device=DEV)
    y = gemv_int4.gemv_int4(h, q, s, z, g, glu=True)
    assert rel(y.cpu(), (w @ (F.silu(h[:k].double()) * h[k:].double())).cpu()) < 1e-5


def test_gemv_int4_applies_swiglu_to_a_fused_gate_up(int4_prefetch):
    n, k, g = 16, 384, 128
    q, s, z, w = _int4_case(n, k, g, seed=6)  # rows [:n/2] read as gate, [n/2:] as up
    x = torch.randn(k, device=DEV)
    h = w @ x.double()
    y = gemv_int4.gemv_int4(x, q, s, z, g, glu_out=True)
    assert y.shape == (n // 2,) and rel(y.cpu(), (F.silu(h[: n // 2]) * h[n // 2 :]).cpu()) < 1e-5


def _int8_per_32(x: torch.Tensor) -> torch.Tensor:
    """x [K] float32 as the A8 kernel reads it: rounded to int8 per 32 columns, dequantized, in
    float64: 127 / max |x| correctly rounded to float32 (torch's `127.0 / t` multiplies by t's
    reciprocal, 1 ulp off in a quarter of the blocks of bf16-valued x), the exact product of x and
    it rounded to an integer, ties to even (the kernel's one FMA)."""
    xb = x.float().view(-1, 32)
    qmax = xb.abs().amax(1, keepdim=True)
    inv = torch.where(qmax > 0, torch.full_like(qmax, 127.0) / qmax, torch.zeros_like(qmax))
    return (torch.round(xb.double() * inv.double()) * (qmax.double() / 127)).view(-1)


@pytest.mark.parametrize("act_order", [False, True])
def test_triton_int4_linear_from_gptq_matches_the_checkpoint(act_order):
    from test_int4 import gptq_layer

    from llamactl.layers.int4 import TritonInt4Linear
    from llamactl.layers.gptq import dequantize_gptq
    from llamactl.layers.int4 import _gptq_codes, sort_by_group

    lin = gptq_layer(act_order=act_order)
    ref = dequantize_gptq(lin.qweight, lin.qzeros, lin.scales.float(), lin.g_idx, 4).double()  # [out, in]
    codes, zeros, scales = _gptq_codes(lin)
    codes, perm = sort_by_group(codes, lin.g_idx, 128)
    fast = TritonInt4Linear(codes, zeros, scales, perm, 128, None, torch.device(DEV))
    x = torch.randn(3, lin.in_features, dtype=torch.bfloat16, device=DEV)
    for rows in (x[:1], x):  # one row: the GEMV; three: per-row GEMVs
        assert rel(fast(rows).cpu(), rows.double().cpu() @ ref.t()) < 1e-2
    long = torch.randn(12, lin.in_features, dtype=torch.bfloat16, device=DEV)  # prefill: dequantize + matmul
    assert rel(fast(long).cpu(), long.double().cpu() @ ref.t()) < 1e-2


@pytest.mark.parametrize("swiglu", ["down", "gate_up", None])
@pytest.mark.slow
def test_model_with_kernels_gives_the_same_logits(tiny_gqa, swiglu):
    """The whole model through layers.prepare (GEMV linears + decode attention) against cuBLAS/SDPA,
    with SwiGLU folded into down_proj's kernel or into gate_up_proj's (None: the default, gate_up's)."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.fused import GemvLinear
    from llamactl.layers.plan import prepare
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions

    options = RuntimeOptions().replace(swiglu=swiglu)
    model = load_model(open_artifact(tiny_gqa), torch.device(DEV), torch.float32)
    model.fuse_projections()  # as the decoder does: q/k/v and gate/up concatenated
    ids = torch.randint(0, 8192, (1, 9), device=DEV)

    def run():
        cache = StaticCache.for_model(model, 1, 64)
        out = [model(ids[:, :6], torch.arange(6, device=DEV), cache)[:, -1]]
        for p in range(6, 9):
            out.append(model(ids[:, p : p + 1], torch.tensor([p], device=DEV), cache)[:, -1])
        return torch.stack(out)

    ref = run()
    plan = prepare(model, options, interpreter=True)
    assert isinstance(model.lm_head, GemvLinear) and plan.attention == "triton split-kv" and plan.kernels
    assert model.lm_head.norm is not None and model.dtype == torch.float32  # the final norm moved into lm_head
    mlp = model.model.layers[0].mlp
    assert (mlp.gate_up_proj.glu_out, mlp.down_proj.glu) == (swiglu != "down", swiglu == "down")
    assert plan.swiglu == (swiglu or "gate_up") and ("SwiGLU before down" in plan.label) == (swiglu == "down")
    fast = run()
    torch.testing.assert_close(fast, ref, atol=2e-3, rtol=2e-3)
    off = prepare(model, options.replace(kernels=False), interpreter=True)
    assert off.gemv == OFF and not off.kernels and type(model.lm_head) is torch.nn.Linear


def test_bad_runtime_options_are_refused(monkeypatch):
    from llamactl.options import RuntimeOptions

    with pytest.raises(InputError, match="SwiGLU site 'up'"):
        RuntimeOptions(swiglu="up")
    with pytest.raises(InputError, match="attention chunk 500"):
        RuntimeOptions(attn_min_chunk=500)
    monkeypatch.setenv("LLAMACTL_PDL", "on")  # a typo is refused, not read as off
    with pytest.raises(InputError, match="LLAMACTL_PDL='on' is not 0 or 1"):
        RuntimeOptions.from_env()
    monkeypatch.setenv("LLAMACTL_PDL", "0")
    assert RuntimeOptions.from_env() == RuntimeOptions(pdl=False)


def test_quantized_projections_fuse_side_by_side():
    """q/k/v (and gate/up) of int4 and int8 layers concatenate into one wider layer, as 16-bit ones do."""
    from test_int4 import gptq_layer

    from llamactl.layers.int4 import TritonInt4Linear, _gptq_codes, sort_by_group
    from llamactl.runtime.model import _concat
    from llamactl.layers.int8 import Int8Kernel

    def int4(seed, act_order=False):
        lin = gptq_layer(seed=seed, act_order=act_order)
        codes, zeros, scales = _gptq_codes(lin)
        codes, perm = sort_by_group(codes, lin.g_idx, 128)
        return TritonInt4Linear(codes, zeros, scales, perm, 128, None, torch.device(DEV))

    x = torch.randn(1, 512, dtype=torch.bfloat16, device=DEV)
    parts = [int4(s) for s in range(3)]
    fused = _concat(parts)
    assert isinstance(fused, TritonInt4Linear) and fused.out_features == 3 * parts[0].out_features
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), atol=0, rtol=0)
    assert _concat([int4(0, act_order=True), int4(1, act_order=True)]) is None  # different input orders

    w = [torch.randint(-127, 128, (16, 512), dtype=torch.int8) for _ in range(2)]
    s = [torch.rand(16) * 0.01 + 1e-3 for _ in range(2)]
    mods = [Int8Kernel(wi, si, None, False) for wi, si in zip(w, s)]
    fused8 = _concat(mods)
    assert isinstance(fused8, Int8Kernel) and fused8.out_features == 32
    from llamactl.layers.int8 import torch_kernel

    if not torch_kernel("cpu"):
        pytest.skip("this torch has no CPU int8 kernel")
    x = x.cpu()
    torch.testing.assert_close(fused8(x), torch.cat([m(x) for m in mods], dim=-1))


@pytest.mark.slow
@pytest.mark.parametrize("swiglu,inputs", [("down", "float"), ("gate_up", "int8")])  # int16 inputs: test_int16_inputs
def test_int4_model_with_fused_kernels_matches_the_unfused_path(tmp_path, monkeypatch, swiglu, inputs):
    """An int4 model (RTN, group 32) with q/k/v and gate/up concatenated and norms, SwiGLU and
    residuals folded into the int4 GEMV decodes like the same layers run unfused; with int8 or
    int16 inputs the decode steps' logits within 2e-2 (prefill unchanged)."""
    from conftest import make_hf_model

    from llamactl.folder.artifact import open_artifact
    from llamactl.kernels import check
    from llamactl.layers.int4 import TritonInt4Linear
    from llamactl.layers.plan import prepare
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions
    from llamactl.layers.rtn import quantize_linears_int4

    options = RuntimeOptions(swiglu=swiglu, quant_inputs=inputs)
    path = make_hf_model(tmp_path / "m", hidden=128, heads=4, kv_heads=2)
    model = load_model(open_artifact(path), torch.device(DEV), torch.float32)
    assert quantize_linears_int4(model, True, 32) == 2 * 7  # CUDA's choice, here via the interpreter
    model.fuse_projections()
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, TritonInt4Linear)
    ids = torch.randint(0, 8192, (1, 12), device=DEV)

    def run():  # a 10-token prefill (dequantize + matmul), then 2 decode steps (the fused GEMVs)
        cache = StaticCache.for_model(model, 1, 32)
        out = [model(ids[:, :10], torch.arange(10, device=DEV), cache)[:, -1]]
        for p in range(10, 12):
            out.append(model(ids[:, p : p + 1], torch.tensor([p], device=DEV), cache)[:, -1])
        return torch.stack(out)

    assert prepare(model, options.replace(kernels=False), interpreter=True).gemv == OFF
    ref = run()
    plan = prepare(model, options, interpreter=True)
    mlp = model.model.layers[0].mlp
    assert (mlp.gate_up_proj.glu_out, mlp.down_proj.glu) == (swiglu == "gate_up", swiglu == "down")
    assert model.model.layers[0].self_attn.qkv_proj.norm is not None
    chosen = [m.inputs for m in model.modules() if isinstance(m, TritonInt4Linear)]
    assert chosen == [inputs] * 4 * 2 and plan.inputs == inputs and ("int8 inputs" in plan.label) == (inputs == "int8")
    if inputs == "float":
        torch.testing.assert_close(run(), ref, atol=1e-3, rtol=1e-3)
    else:
        out = run()
        torch.testing.assert_close(out[0], ref[0], atol=1e-3, rtol=1e-3)  # prefill: cuBLAS on dequantized weights
        assert 0 < rel(out[1:], ref[1:].double()) < 2e-2
    if inputs == "int8":  # their check failed: the kernels stay, with float inputs, and the plan says why
        monkeypatch.setattr(check, "passed", lambda device, inputs="float": "broken" if inputs != "float" else None)
        plan = prepare(model, options, interpreter=True)
        assert plan.kernels and plan.inputs == "float" and "int8-input GEMVs failed their check" in plan.warnings[0]
        assert {m.inputs for m in model.modules() if isinstance(m, TritonInt4Linear)} == {"float"}
    prepare(model, options.replace(kernels=False), interpreter=True)
    assert {m.inputs for m in model.modules() if isinstance(m, TritonInt4Linear)} == {"float"}


def test_self_check_passes_on_working_kernels_and_names_a_broken_one(monkeypatch):
    from llamactl.kernels import check

    assert check.self_check(torch.device(DEV)) is None
    monkeypatch.setattr(gemv_int4, "pack_int4", lambda codes: torch.zeros(codes.shape[0], codes.shape[1] // 8,
                                                                       dtype=torch.int32, device=codes.device))
    assert "gemv int4" in check.self_check(torch.device(DEV))


@pytest.mark.parametrize("regions,swiglu", [(True, "gate_up"), (False, "down")])
@pytest.mark.slow
def test_compiled_step_with_kernels_matches_eager(tiny_gqa, regions, swiglu):
    """torch.compile calls the cache-writing attention op in place (no cache copies); with regional
    compilation, which cannot take a mutating op, the model falls back to the plain attention op.
    SwiGLU folded into either kernel traces too (the ops' fake shapes)."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare, unfold_cache_writes
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions

    torch._dynamo.reset()
    model = load_model(open_artifact(tiny_gqa), torch.device(DEV), torch.float32)
    prepare(model, RuntimeOptions(swiglu=swiglu), interpreter=True)
    if regions:
        unfold_cache_writes(model)
    for layer in model.model.layers:
        layer.compile_region = regions
    assert model.model.layers[0].self_attn.decode_kernel == ("plain" if regions else "rope")
    ids = torch.randint(0, 8192, (1, 6), device=DEV)

    cache = None

    def step(tok, pos):
        return model(tok, pos, cache)[:, -1].argmax(-1)

    def decode(fn):
        nonlocal cache
        cache = StaticCache.for_model(model, 1, 64)  # a fresh cache
        tok, out = model(ids, torch.arange(6, device=DEV), cache)[:, -1].argmax(-1), []
        for i in range(4):
            tok = fn(tok.view(1, 1), torch.tensor([6 + i], device=DEV))
            out.append(int(tok))
        return out

    with torch.inference_mode():
        assert decode(torch.compile(step, fullgraph=True, dynamic=False)) == decode(step)


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    """The GPU-only code paths (inline PTX, the RoPE/cache-write branch, every fused variant)
    compile to sm_90 cubins in CI, which has no GPU; the interpreter never compiles them. A fresh
    process: in this one Triton's interpreter mode is on."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "scripts" / "compile_kernels.py")], env=env, cwd=root,
                         capture_output=True, text=True, timeout=1800)  # 160 s on 2 idle cores; a busy machine takes far longer
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "all compiled" in res.stdout
