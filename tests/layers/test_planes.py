"""3-, 5- and 6-bit weights: GPTQModel's packings, the plane kernels (Triton's interpreter on the
CPU) against float64, the layers and the files quantize writes at these widths."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from llamactl.cli.app import app
from llamactl.layers.gptq import BITS, GPTQLinear, pack_gptq, pack_rows, unpack_rows
from llamactl.options import RuntimeOptions

DEV = "cuda" if torch.cuda.is_available() else "cpu"
runner = CliRunner()


@pytest.mark.parametrize("bits", BITS)
def test_packing_round_trips_at_every_width(bits):
    rows = 64 if 32 % bits else 37  # 3, 5, 6, 7 bits: whole blocks of 32; else a last word not full
    codes = torch.randint(0, 2**bits, (rows, 11))
    packed = pack_rows(codes, bits)
    assert packed.shape == (-(-rows * bits // 32), 11) and packed.dtype == torch.int32
    assert torch.equal(unpack_rows(packed, bits, rows), codes.int())


def test_3_bits_pack_as_one_stream():
    """3 bits (outside gptq_p files) in GPTQModel's continuous stream, word by word (its
    10-1-10-1-10 layout: code 10 straddles words 0 and 1, code 21 words 1 and 2); the planes of
    5-7 bits (and 3 in gptq_p) are checked against GPTQModel's packer below."""
    codes = torch.randint(0, 8, (32, 3))
    words = pack_rows(codes, 3).to(torch.int64) & 0xFFFFFFFF  # [3, C]
    stream = sum(int(words[i, 0]) << (32 * i) for i in range(3))
    assert [(stream >> (3 * j)) & 7 for j in range(32)] == codes[:, 0].tolist()


@pytest.mark.quant
def test_planes_match_gptqmodels_packer():
    planar = pytest.importorskip("gptqmodel.utils.planar_packing")
    for bits in (3, 5, 6, 7):
        codes = torch.randint(0, 2**bits, (64, 9))
        assert torch.equal(pack_rows(codes, bits, planar=True), planar.planar_pack_rows(codes, bits))
        assert torch.equal(unpack_rows(pack_rows(codes, bits, planar=True), bits, 64, planar=True), codes.int())


def _layer(bits: int, out_f: int = 96, in_f: int = 320, group: int = 64, seed: int = 0) -> GPTQLinear:
    from llamactl.quantize.rtn import rtn_quantize

    torch.manual_seed(seed)
    w = torch.randn(out_f, in_f) * 0.02
    lin = GPTQLinear(in_f, out_f, bits, group, bias=False)
    for k, v in pack_gptq(*rtn_quantize(w, bits, group, False), bits).items():
        setattr(lin, k, v)
    return lin


@pytest.mark.parametrize("bits", (3, 5, 6))
@pytest.mark.parametrize("rows", (1, 3, 17, 70))
def test_plane_layer_computes_the_dequantized_product(bits, rows):
    """1 row (float32 sums), 3 and 17 (tensor-core dots), 70 (more than MAX_ROWS: dequantized)
    against the GPTQ layer's float64 weight."""
    from llamactl.layers.planes import PlanesLinear

    lin = _layer(bits)
    assert PlanesLinear.fits(lin)
    fast = PlanesLinear(lin).to(DEV)
    w = lin.dequantized(torch.float64)  # [out, in]
    x = torch.randn(rows, lin.in_features, dtype=torch.bfloat16)
    y = fast(x.to(DEV)).double().cpu()
    ref = x.double() @ w.t()
    assert float((y - ref).norm() / ref.norm()) < 1e-2


def test_layers_the_planes_cannot_take_stay_portable():
    from llamactl.layers.planes import PlanesLinear

    assert not PlanesLinear.fits(_layer(4))
    lin = _layer(5)
    lin.g_idx = lin.g_idx.flip(0)  # act-order: columns out of group order
    assert not PlanesLinear.fits(lin)


@pytest.mark.parametrize("bits", (3, 5, 6))
@pytest.mark.slow
def test_quantize_writes_each_width_and_more_bits_cost_less(tiny_gqa, tmp_path, bits):
    """Uniform RTN at 3, 5 and 6 bits: the file loads (Triton layers through the interpreter in
    bf16, the portable layer in float32, the same logits)."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.planes import Int4PlanesLinear, PlanesLinear, use_plane_kernels
    from llamactl.runtime.load import load_model

    out = tmp_path / f"q{bits}"
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(out), "--method", "rtn", "--bits", str(bits),
                            "--group-size", "32", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    art = open_artifact(out)
    assert art.quantization["checkpoint_format"] == "gptq_p"  # as GPTQModel writes 3-7 bits: planes, zeros as they are
    off = RuntimeOptions(kernels=False) if DEV == "cpu" else None  # not llamactl's CPU kernels (test_cpu_kernels)
    fast = load_model(art, torch.device(DEV), torch.bfloat16, off)  # on CUDA the loader swaps the plane layers in
    if DEV == "cpu":
        use_plane_kernels(fast)  # here, for the interpreter
    kind = PlanesLinear if bits == 3 else Int4PlanesLinear  # 5 and 6 bits: the int4 GEMV with a high plane
    assert sum(isinstance(m, kind) for m in fast.modules()) == 7 * art.args.num_hidden_layers
    plain = load_model(art, torch.device(DEV), torch.float32, off)
    ids = torch.randint(0, 8192, (1, 6), device=DEV)
    got = fast(ids, torch.arange(6, device=DEV)).float()
    want = plain(ids, torch.arange(6, device=DEV))
    assert float((got - want).norm() / want.norm()) < 2e-2


def test_more_bits_cost_less_kl(tiny_gqa, tmp_path):
    kls = []
    for bits in (3, 4, 5, 6):
        out = tmp_path / f"q{bits}"
        r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(out), "--method", "rtn", "--bits", str(bits),
                                "--group-size", "32", "--eval-tokens", "1024"])
        assert r.exit_code == 0, r.output
        kls.append(json.loads((out / "llamactl.json").read_text())["metrics"]["quality"]["kl_mean"])
    assert kls == sorted(kls, reverse=True) and kls[-1] < kls[0] / 8  # about 4x less a bit


def test_widths_that_do_not_pack_are_refused(tmp_path):
    from conftest import make_hf_model

    path = make_hf_model(tmp_path / "m", hidden=80, heads=5, kv_heads=5)  # 80 is no multiple of 32
    r = runner.invoke(app, ["quantize", str(path), "-o", str(tmp_path / "q"), "--method", "rtn", "--bits", "5"])
    assert r.exit_code != 0 and "80 wide" in r.output and "Traceback" not in r.output
