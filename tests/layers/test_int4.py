"""int4 tinygemm repacking of GPTQ layers: the math on any machine, the kernels where they exist."""

from __future__ import annotations

import pytest
import torch

from llamactl.layers.gptq import GPTQLinear, dequantize_gptq, pack_gptq
from llamactl.layers.int4 import Int4Linear, dequantize_tinygemm, tinygemm_params
from llamactl.quantize.rtn import rtn_quantize


def gptq_layer(out_f=256, in_f=512, group=128, sym=False, act_order=False, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(out_f, in_f) * 0.05
    codes, zeros, scales, g_idx = rtn_quantize(w, 4, group, sym)
    if act_order:  # as GPTQ's desc_act writes it: columns in a permuted order, each group still g wide
        perm = torch.randperm(in_f)
        codes, g_idx = codes[:, perm], g_idx[perm]
    lin = GPTQLinear(in_f, out_f, 4, group, bias=False)
    for k, v in pack_gptq(codes, zeros, scales, g_idx, 4).items():
        getattr(lin, k).copy_(v)
    return lin


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_tinygemm_parameters_reproduce_the_gptq_weight(act_order, sym):
    lin = gptq_layer(sym=sym, act_order=act_order)
    ref = dequantize_gptq(lin.qweight, lin.qzeros, lin.scales.float(), lin.g_idx, 4)
    from llamactl.layers.gptq import unpack_rows

    codes = unpack_rows(lin.qweight, 4).t()
    zeros = (unpack_rows(lin.qzeros.t().contiguous(), 4).t() + 1) & 0xF
    q, sz, perm = tinygemm_params(codes, zeros, lin.scales, lin.g_idx, 128)
    assert (perm is not None) == act_order
    torch.testing.assert_close(dequantize_tinygemm(q, sz, perm, 128), ref.float(), atol=1e-6, rtol=0)


def _kernel_available(device: str) -> bool:
    name = "_weight_int4pack_mm" if device == "cuda" else "_weight_int4pack_mm_for_cpu"
    return hasattr(torch.ops.aten, name) and (device == "cpu" or torch.cuda.is_available())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_kernel_matches_the_dequantized_reference(device, act_order):
    if not _kernel_available(device):
        pytest.skip(f"no int4 kernel for {device} here")
    lin = gptq_layer(act_order=act_order).to(device)
    fast = Int4Linear.from_gptq(lin, 128)
    x = torch.randn(5, 512, device=device, dtype=torch.bfloat16)
    ref = x.float() @ lin.dequantized(torch.float32).t()
    got = fast(x).float()
    # bf16 activations and bf16 scales/zeros: measured relative error ~3e-3 (H200 and CPU)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


def _logits_of_both(fast, plain, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits of the two models for the same random n-token prompt: [1, n, V] each."""
    ids = torch.randint(0, 8192, (1, n))
    with torch.no_grad():
        return fast(ids, torch.arange(n)).float(), plain(ids, torch.arange(n)).float()


def test_bf16_load_of_a_4bit_checkpoint_uses_the_int4_kernel(trained_model, tmp_path):
    from typer.testing import CliRunner

    from llamactl.folder.artifact import open_artifact
    from llamactl.cli.app import app
    from llamactl.runtime.load import load_model

    out = tmp_path / "q"
    assert CliRunner().invoke(app, ["quantize", str(trained_model), "-o", str(out), "--method", "rtn",
                                    "--eval-tokens", "0"]).exit_code == 0
    from llamactl.layers.cpu import CpuQuantLinear, quant_fast
    from llamactl.options import RuntimeOptions

    art = open_artifact(out)
    off = RuntimeOptions(kernels=False)
    fast = load_model(art, torch.device("cpu"), torch.bfloat16, off)  # torch's tinygemm
    plain = load_model(art, torch.device("cpu"), torch.float32, off)
    assert isinstance(fast.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(plain.model.layers[0].mlp.down_proj, GPTQLinear)
    a, b = _logits_of_both(fast, plain, 64)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert ((a - b).norm() / b.norm()).item() < 3e-2
    if quant_fast():  # llamactl's CPU kernel, in float32 activations too
        own = load_model(art, torch.device("cpu"), torch.float32)
        assert isinstance(own.model.layers[0].mlp.down_proj, CpuQuantLinear)
        a, b = _logits_of_both(own, plain, 64)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
        assert ((a - b).norm() / b.norm()).item() < 3e-2
        a, b = _logits_of_both(own, plain, 4)  # decode rows: the kernel itself (x rounded to int8)
        assert ((a - b).norm() / b.norm()).item() < 3e-2


def test_bench_synthetic_int4(tmp_path):
    import json

    from typer.testing import CliRunner

    from llamactl.cli.app import app

    def run(*extra):
        r = CliRunner().invoke(app, ["bench", "--synthetic", "tiny", "--dtype", "bfloat16", "--prompt-len", "8",
                                     "--gen-len", "4", "--warmup", "0", "--repeat", "1", "--format", "json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["results"][0]

    int4, bf16 = run("--synthetic-quant", "int4"), run()
    assert int4["model"] == "synthetic:tiny int4-g128" and int4["decode_tok_s"] > 0
    # the decoder linears of tiny: 4 layers x (2 x 256x256 + 2 x 64x256 + 3 x 768x256) bf16 weights;
    # in 4 bits (plus scales and zeros) they shrink by more than 70%
    linear_bytes = 4 * (2 * 256 * 256 + 2 * 64 * 256 + 3 * 768 * 256) * 2
    assert bf16["weight_bytes"] - int4["weight_bytes"] > 0.7 * linear_bytes


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_synthetic_quantized_layer_by_layer_is_the_same_model(kind):
    """build_synthetic(quantize=...) quantizes each decoder layer as soon as it is drawn (how
    llama3-70b in int4 fits one GPU): the same weights and codes as drawing the whole model in bf16
    and quantizing it afterwards; and the memory check counts the quantized bytes."""
    from llamactl.layers import rtn
    from llamactl.runtime.synthetic import build_synthetic, peak_weight_bytes, synthetic_args

    quant = {"int4": lambda m, every=False: rtn.quantize_linears_int4(m, False, 128, every=every),
             "int8": lambda m, every=False: rtn.quantize_linears_int8(m, False, every=every)}[kind]
    whole = build_synthetic("tiny", torch.device("cpu"), torch.bfloat16)
    assert quant(whole) == 4 * 7
    streamed = build_synthetic("tiny", torch.device("cpu"), torch.bfloat16, quantize=lambda layer: quant(layer, True),
                               weight_bits=4.2 if kind == "int4" else 8.1)
    a, b = whole.state_dict(), streamed.state_dict()
    assert a.keys() == b.keys() and type(streamed.model.layers[0].mlp.down_proj) is type(whole.model.layers[0].mlp.down_proj)
    assert all(torch.equal(a[k], b[k]) for k in a)
    args = synthetic_args("llama3-70b")  # 16-bit: more than 0.9 of an H200's 139 GiB; int4 a third of it
    assert peak_weight_bytes(args, torch.bfloat16) / 2**30 > 0.9 * 139
    assert peak_weight_bytes(args, torch.bfloat16, 4.2) / 2**30 < 0.33 * 139


@pytest.mark.parametrize("method", ["rtn", pytest.param("int8", marks=pytest.mark.quant)])  # int8: bitsandbytes
def test_bf16_load_of_per_channel_int8_uses_the_int8_kernel(method, tiny128_path, tmp_path):
    from importlib.util import find_spec

    from typer.testing import CliRunner

    from llamactl.folder.artifact import open_artifact
    from llamactl.cli.app import app
    from llamactl.runtime.load import load_model
    from llamactl.layers.int8 import Int8Kernel, available

    if method == "int8" and find_spec("bitsandbytes") is None:
        pytest.skip("pip install 'llamactl[bnb]'")
    if not available("cpu", False):
        pytest.skip("this torch has no _weight_int8pack_mm for the CPU")
    out = tmp_path / method
    args = ["quantize", str(tiny128_path), "-o", str(out), "--method", method, "--bits", "8", "--eval-tokens", "0"]
    if method == "rtn":
        args += ["--group-size", "-1"]
    assert CliRunner().invoke(app, args).exit_code == 0
    from llamactl.options import RuntimeOptions

    art = open_artifact(out)
    off = RuntimeOptions(kernels=False)  # torch's int8 kernel (llamactl's CPU kernel: test_cpu_kernels)
    fast = load_model(art, torch.device("cpu"), torch.bfloat16, off)
    plain = load_model(art, torch.device("cpu"), torch.float32, off)
    assert isinstance(fast.model.layers[0].self_attn.q_proj, Int8Kernel)
    assert not isinstance(plain.model.layers[0].self_attn.q_proj, Int8Kernel)
    a, b = _logits_of_both(fast, plain, 32)
    assert ((a - b).norm() / b.norm()).item() < 3e-2


@pytest.fixture(scope="module")
def tiny128_path(tmp_path_factory):
    from conftest import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("tiny128i8"), hidden=128, heads=4, kv_heads=2, seed=9)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_int8_kernel_matches_the_dequantized_reference(device):
    from llamactl.layers.int8 import Int8Kernel, available

    if device == "cuda" and not torch.cuda.is_available() or not available(device, device == "cuda"):
        pytest.skip(f"no int8 kernel for {device} here")
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (256, 512), dtype=torch.int8)
    scale = torch.rand(256) * 0.01 + 1e-3
    layer = Int8Kernel(q.to(device), scale.to(device), None, device == "cuda")
    x = torch.randn(3, 512, device=device, dtype=torch.bfloat16)
    ref = x.float() @ (q.float() * scale[:, None]).to(device).t()
    assert ((layer(x).float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("in_f,group,act_order", [(576, 64, False), (576, 64, True), (96, 32, False), (320, 64, False)])
def test_int4_kernel_runs_widths_that_are_not_whole_tiles(in_f, group, act_order):
    """A width of whole groups that is not a multiple of tinygemm's 128-column tiles (a 135M
    model's 576) runs the kernel on zero-padded columns, not a dequantized copy each step."""
    if not _kernel_available("cpu"):
        pytest.skip("this torch has no CPU int4 kernel")
    from llamactl.layers.int4 import Int4Linear, supported

    assert supported(in_f, 64, group)
    lin = gptq_layer(out_f=64, in_f=in_f, group=group, act_order=act_order)
    fast = Int4Linear.from_gptq(lin, group)
    assert fast.pad == -in_f % 128 and fast.weight_packed.numel() > 0
    ref = dequantize_gptq(lin.qweight, lin.qzeros, lin.scales.float(), lin.g_idx, 4)
    x = torch.randn(3, in_f, dtype=torch.bfloat16)
    y = fast(x)
    assert y.shape == (3, 64)
    torch.testing.assert_close(y.float(), x.float() @ ref.float().t(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("in_f,group", [(160, 64), (576, 128), (100, 32)])
def test_rtn_groups_need_not_divide_the_width(in_f, group):
    """A short last group (issue 26): every column within half a step of its group's grid, the
    GPTQ tensors sized with ceil(in / g), and the portable layer reproducing the codes."""
    torch.manual_seed(in_f)
    w = torch.randn(48, in_f)
    codes, zeros, scales, g_idx = rtn_quantize(w, 4, group, sym=True)
    groups = -(-in_f // group)
    assert codes.shape == (48, in_f) and zeros.shape == scales.shape == (groups, 48)
    assert int(g_idx[-1]) == groups - 1 and int((g_idx == groups - 1).sum()) == in_f - (groups - 1) * group
    deq = (codes - zeros.t()[:, g_idx.long()]) * scales.t()[:, g_idx.long()]
    assert ((deq - w).abs() <= scales.t()[:, g_idx.long()] * 0.51).all()  # symmetric: half a step (fp16 scales)
    lin = gptq_layer(out_f=48, in_f=in_f, group=group)  # packs through GPTQLinear's ceil-sized buffers
    assert lin.scales.shape == (groups, 48)


@pytest.mark.parametrize("in_f,group,act_order", [(160, 64, False), (160, 64, True), (576, 128, False)])
def test_int4_kernels_take_a_short_last_group(in_f, group, act_order):
    """tinygemm (CPU) and llamactl's Triton int4 layer (interpreted here) on a width that is not a
    multiple of the group: the short group is padded with its zero point, x with zeros."""
    from llamactl.layers.int4 import TritonInt4Linear, _gptq_codes, int4_linear, supported, triton_supported

    lin = gptq_layer(out_f=64, in_f=in_f, group=group, act_order=act_order)
    ref = dequantize_gptq(lin.qweight, lin.qzeros, lin.scales.float(), lin.g_idx, 4).float()  # [64, in]
    x = torch.randn(3, in_f, dtype=torch.bfloat16)
    want = x.float() @ ref.t()
    assert supported(in_f, 64, group) and triton_supported(in_f, group)
    if _kernel_available("cpu"):
        fast = Int4Linear.from_gptq(lin, group)
        torch.testing.assert_close(fast(x).float(), want, atol=0.05, rtol=0.02)
    tri = int4_linear(*_gptq_codes(lin), lin.g_idx, group, None, torch.device("cpu"), triton=True)
    assert isinstance(tri, TritonInt4Linear) and tri.in_features == in_f and not tri.can_fuse()
    for rows in (1, 3):
        torch.testing.assert_close(tri(x[:rows]).float(), want[:rows], atol=0.05, rtol=0.02)
