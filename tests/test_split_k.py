"""The 16-bit/int8 GEMV with K split across programs (SPLIT_K: the last program of a row block
adds the partial sums in a fixed order) against float64 references and the unsplit kernel. Without
CUDA it runs through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.kernels import gemv  # noqa: E402
from test_kernels import DEV, _int8_per_32, rel  # noqa: E402

SPLITS = [c for c in gemv._bf16_configs() if c.kwargs.get("SPLIT_K", 1) > 1]


def _fixed(monkeypatch, block_n: int, block_k: int, split: int, pdl: bool = False) -> None:
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setattr(gemv, "GEMV_FIXED", {"BLOCK_N": block_n, "BLOCK_K": block_k, "PREFETCH": False,
                                             "REDUCE_EACH": True, "SPLIT_K": split, "PDL": pdl, "num_warps": 4})


@pytest.mark.parametrize("split,pdl", [(2, False), (3, True), (8, False)])
def test_split_k_sums_every_range_once_and_leaves_the_counters_zero(split, pdl, monkeypatch):
    """Rows not a multiple of the block, K not a multiple of the ranges (with 8 splits of 128
    columns over K = 600, the last three ranges are empty), a residual, a SwiGLU input, int8
    weights with float and int8 inputs; two launches agree bit for bit (a fixed order of sums)."""
    torch.manual_seed(split)
    n, k = 40, 608
    _fixed(monkeypatch, 16, 128 if split == 8 else 64, split, pdl)
    x, r = torch.randn(k, device=DEV), torch.randn(n, device=DEV)
    w = torch.randn(n, k, device=DEV)
    y = gemv.gemv(x, w, residual=r)
    assert rel(y.cpu(), (w.double() @ x.double() + r.double()).cpu()) < 1e-5
    assert torch.equal(y, gemv.gemv(x, w, residual=r))
    h = torch.randn(2 * k, device=DEV)
    assert rel(gemv.gemv(h, w, glu=True).cpu(), (w.double() @ (F.silu(h[:k].double()) * h[k:].double())).cpu()) < 1e-5
    w8 = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s8 = torch.rand(n, device=DEV) * 0.01 + 1e-3
    assert rel(gemv.gemv(x, w8, s8).cpu(), ((w8.double() @ x.double()) * s8.double()).cpu()) < 1e-5
    y8 = gemv.gemv(x, w8, s8, residual=r, a8=True)
    assert rel(y8.cpu(), ((w8.double() @ _int8_per_32(x)) * s8.double() + r.double()).cpu()) < 1e-5
    assert not gemv._COUNTERS[x.device].any()


def test_a_folded_norm_or_swiglu_output_runs_unsplit(monkeypatch):
    """The norm needs all of x's squares and GLU_OUT both halves in one program: a split config
    given to such a launch runs unsplit and gives the right product."""
    torch.manual_seed(3)
    n, k = 24, 256
    _fixed(monkeypatch, 8, 64, 4)
    w = torch.randn(2 * n, k, device=DEV)
    x, nw = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()
    assert rel(gemv.gemv(x, w, None, nw, 1e-5).cpu(), (w.double() @ xn).cpu()) < 1e-5
    h = w.double() @ xn
    assert rel(gemv.gemv(x, w, None, nw, 1e-5, glu_out=True).cpu(), (F.silu(h[:n]) * h[n:]).cpu()) < 1e-5


@pytest.mark.parametrize("norm,glu_out", [(True, False), (False, True), (False, False)])
def test_the_autotuner_offers_split_k_only_where_it_can_run(norm, glu_out):
    named = {"x_ptr": torch.empty(1), "N": 4096, "K": 4096, "HAS_SCALE": True, "NORM": norm, "GLU": False,
             "RESIDUAL": not norm}  # on the CPU: no pinned configs
    for a8 in (False, True):
        kept = gemv._prune_gemv(gemv._bf16_configs(), named, A8=a8, GLU_OUT=glu_out)
        splits = [c for c in kept if c.kwargs.get("SPLIT_K", 1) > 1]
        assert len(splits) == (0 if norm or glu_out else len(SPLITS))
    assert max(c.kwargs["SPLIT_K"] for c in SPLITS) <= gemv.SPLIT_MAX
