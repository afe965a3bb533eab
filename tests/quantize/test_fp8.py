"""quantize --method fp8: compressed-tensors' float-quantized folders, read by llamactl's runtime
(layers.fp8: W8A8 with per-token activations) and by transformers (compressed-tensors), with the
same logits; the quality report; what the runtime refuses."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_hf_model
from llamactl.cli.app import app
from llamactl.folder.artifact import open_artifact
from llamactl.layers.fp8 import FP8Linear, quantize_fp8, quantize_rows
from llamactl.runtime.load import load_model

runner = CliRunner()


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A tiny GQA model (untied head), its FP8 child (lm_head kept, as llm-compressor does) and the
    report, and a child with lm_head FP8 too."""
    root = tmp_path_factory.mktemp("fp8")
    parent = make_hf_model(root / "parent", hidden=128, heads=4, kv_heads=2, seed=7)
    reports = []
    for name, extra in (("child", []), ("child-head", ["--quantize-lm-head"])):
        r = runner.invoke(app, ["quantize", str(parent), "-o", str(root / name), "--method", "fp8", *extra,
                                "--eval-tokens", "1024", "--json"])
        assert r.exit_code == 0, r.output
        reports.append(json.loads(r.stdout))
    return parent, root / "child", reports[0], root / "child-head"


def test_fp8_codes_reproduce_the_weights_within_e4m3s_precision():
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.bfloat16) * torch.rand(64, 1, dtype=torch.bfloat16)
    codes, scale = quantize_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64, 1) and scale.dtype == torch.bfloat16
    back = codes.float() * scale.float()
    assert ((back - w.float()).abs() <= w.float().abs() / 16 + scale.float() * 2**-9).all()  # half of 2^-3
    assert codes.float().abs().amax(1).max() <= 448


def test_the_folder_is_compressed_tensors_fp8_dynamic_and_reports_its_quality(fp8_folder):
    _, out, report, head = fp8_folder
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "float-quantized" and q["ignore"] == ["lm_head"]
    group = q["config_groups"]["group_0"]
    assert group["weights"].items() >= {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False}.items()
    assert group["input_activations"].items() >= {"type": "float", "num_bits": 8, "strategy": "token",
                                                  "dynamic": True}.items()
    quality = report["quality"]
    assert quality["tokens"] > 500 and 0 < quality["kl_mean"] < 0.05 and quality["top1_agreement"] > 0.5  # random weights: flat logits
    names = open_artifact(out).tensor_index()
    assert "model.layers.0.self_attn.q_proj.weight_scale" in names and "lm_head.weight_scale" not in names
    assert "model.embed_tokens.weight_scale" not in names
    assert "lm_head.weight_scale" in open_artifact(head).tensor_index()
    assert json.loads((head / "config.json").read_text())["quantization_config"]["ignore"] == []


def test_the_runtime_runs_it_as_w8a8_and_transformers_gives_the_same_logits(fp8_folder, tmp_path):
    """The embedded trained model (bf16) quantized: llamactl's FP8 layers (here the weights
    dequantized, a prefill's activations rounded per token as FP8 GEMMs take them) against
    transformers with compressed-tensors, both in float32."""
    if find_spec("compressed_tensors") is None:
        pytest.skip("pip install compressed-tensors (the dev extra)")
    from transformers import AutoModelForCausalLM

    out = tmp_path / "embedded-fp8"
    r = runner.invoke(app, ["quantize", "embedded", "-o", str(out), "--method", "fp8", "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    model = load_model(open_artifact(out), torch.device("cpu"), torch.float32)
    layer = model.model.layers[0].mlp.down_proj
    assert isinstance(layer, FP8Linear) and layer.product(8) == "fp8 dequantized per call"
    assert isinstance(load_model(open_artifact(fp8_folder[3]), torch.device("cpu"), torch.float32).lm_head, FP8Linear)
    ids = torch.tensor([[1, 45, 190, 33, 263, 124, 310, 1023, 3000, 42]])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        ours = model(ids, torch.arange(ids.shape[1]))
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_one_row_is_weight_only_and_rows_are_rounded_per_token():
    torch.manual_seed(1)
    lin = FP8Linear(256, 64, True)
    w = torch.randn(64, 256)
    lin.weight, lin.weight_scale = quantize_fp8(w, torch.float32)
    lin.bias = torch.nn.Parameter(torch.randn(64), requires_grad=False)
    x = torch.randn(3, 256)
    dense = x @ lin.dequantized(torch.float32).t() + lin.bias
    assert torch.allclose(lin(x[:1]), dense[:1], atol=1e-5)  # one row: the weights' rounding alone
    xq, xs = quantize_rows(x)
    assert torch.allclose(lin(x), (xq.float() * xs) @ lin.dequantized(torch.float32).t() + lin.bias, atol=1e-5)
    fused = FP8Linear.concat([lin, lin])
    assert fused.weight.dtype == torch.float8_e4m3fn and torch.allclose(fused(x), torch.cat([lin(x)] * 2, -1))


def test_gemv_reads_fp8_weights_with_their_scales():
    pytest.importorskip("triton")
    from llamactl.kernels.gemv import run_gemv
    from test_kernels import DEV

    torch.manual_seed(2)
    codes, scale = quantize_fp8(torch.randn(96, 512, dtype=torch.bfloat16))
    x = torch.randn(512, dtype=torch.bfloat16)
    y = run_gemv(x.to(DEV), codes.to(DEV), scale.view(-1).to(DEV))
    ref = (codes.double() * scale.double()) @ x.double()
    assert ((y.double().cpu() - ref).norm() / ref.norm()) < 1e-2


def test_what_fp8_refuses(tmp_path, fp8_folder):
    parent, out, _, _ = fp8_folder
    tied = make_hf_model(tmp_path / "tied", hidden=128, heads=4, kv_heads=2, tie=True)
    r = runner.invoke(app, ["quantize", str(tied), "-o", str(tmp_path / "x"), "--method", "fp8", "--quantize-lm-head"])
    assert r.exit_code == 1 and "tied model" in r.stderr
    r = runner.invoke(app, ["quantize", str(parent), "-o", str(tmp_path / "y"), "--method", "fp8", "--embed-bits", "8"])
    assert r.exit_code == 1 and "not available with --method fp8" in r.stderr
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    blocky = tmp_path / "blocky"
    blocky.mkdir()
    for f in out.iterdir():
        (blocky / f.name).write_bytes(f.read_bytes())
    (blocky / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["generate", str(blocky), "-p", "x", "-n", "2"])
    assert r.exit_code == 1 and "8-bit per block, which the runtime does not read" in r.stderr


def test_the_row_quantizing_kernel_gives_pytorchs_codes_and_scales():
    """kernels.fp8.quantize_rows (one Triton program a row, before torch._scaled_mm) against the
    PyTorch definition, bit for bit: ties to even, an all-zero row, rows wider than a pass."""
    pytest.importorskip("triton")
    from llamactl.kernels.fp8 import quantize_rows as kernel_rows
    from test_kernels import DEV

    torch.manual_seed(4)
    x = torch.randn(5, 3000, dtype=torch.bfloat16) * torch.rand(5, 1, dtype=torch.bfloat16) * 10  # bf16: exact ties
    x[2] = 0
    q, s = kernel_rows(x.to(DEV))
    q_ref, s_ref = quantize_rows(x)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype,fold", [(torch.bfloat16, ""), (torch.float16, ""), (torch.bfloat16, "norm"),
                                        (torch.bfloat16, "glu")])
def test_the_scaled_mm_path_gives_the_dequantized_paths_products(dtype, fold):
    """FP8Linear's GPU path (the row-quantizing kernel, then torch._scaled_mm with row-wise scales,
    which give bfloat16 only) run on the CPU, where torch has the product and Triton's interpreter
    the kernel: the products of the CPU path, which rounds the activations alike, in x's dtype;
    with the RMSNorm before it or SwiGLU on its input folded into the quantization (FusedIO's
    norm, glu), and a residual added."""
    pytest.importorskip("triton")
    from llamactl.runtime.model import RMSNorm

    torch.manual_seed(5)
    lin = FP8Linear(256, 96, bias=fold == "")
    lin.weight, lin.weight_scale = quantize_fp8(torch.randn(96, 256))
    if fold == "":
        lin.bias = torch.nn.Parameter(torch.randn(96), requires_grad=False)
    elif fold == "norm":
        lin.norm = RMSNorm(256, 1e-5).to(dtype)
        lin.norm.weight.data = torch.rand(256, dtype=dtype) + 0.5
    else:
        lin.glu = True
    x = torch.randn(3, 7, 512 if fold == "glu" else 256, dtype=dtype) * 2
    residual = torch.randn(3, 7, 96, dtype=dtype)
    with torch.no_grad():
        ref = lin(x, residual)
        lin.scaled_mm = True
        try:
            got = lin(x, residual)
        except RuntimeError as e:  # a torch without FP8 products on the CPU
            pytest.skip(f"torch._scaled_mm on the CPU: {e}")
    assert got.dtype == dtype and got.shape == (3, 7, 96)
    assert (got.float() - ref.float()).abs().max() <= 0.03 * (ref - residual).float().abs().max()


@pytest.mark.parametrize("fold", ["norm", "glu"])
def test_the_row_kernel_folds_the_rmsnorm_or_swiglu_before_it(fold):
    """kernels.fp8.quantize_rows with the step before the linear folded in (the RMSNorm of the
    residual stream, or SwiGLU of a fused [gate; up] output) against PyTorch's step then the
    row quantization: the same scales, and codes equal but where the step's float rounding (a sum's
    order, the 16-bit roundings PyTorch makes between its steps) moves a value across a rounding
    boundary (one code step, rarely)."""
    pytest.importorskip("triton")
    import torch.nn.functional as F

    from llamactl.kernels.fp8 import quantize_rows as kernel_rows
    from llamactl.runtime.model import RMSNorm
    from test_kernels import DEV

    torch.manual_seed(6)
    m, k = 6, 1536
    if fold == "norm":
        x = torch.randn(m, k, dtype=torch.bfloat16) * 3
        norm = RMSNorm(k, 1e-5)
        norm.weight.data = (torch.rand(k) + 0.5).to(torch.bfloat16)
        with torch.no_grad():
            q, s = kernel_rows(x.to(DEV), norm.weight.to(DEV), norm.eps)
            want = norm(x)
    else:
        x = torch.randn(m, 2 * k, dtype=torch.bfloat16) * 2
        q, s = kernel_rows(x.to(DEV), glu=True)
        want = F.silu(x[:, :k]) * x[:, k:]
    q_ref, s_ref = quantize_rows(want)
    assert q.shape == (m, k) and torch.allclose(s.cpu(), s_ref, rtol=1e-2)  # (bf16's rounding of the max)
    codes, ref = (c.view(torch.uint8).int() for c in (q.cpu(), q_ref))  # e4m3 codes: neighbours differ by 1
    codes, ref = (torch.where(c == 128, 0, c) for c in (codes, ref))  # (-0 is 0)
    moved = (codes != ref).float().mean().item()
    assert moved < 0.05 and (codes - ref).abs().max() <= 1, moved
