"""Low-bit embedding tables (quantize --embed-bits): the lookup, one table for a tied head, the file."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_hf_model
from llamactl.folder.artifact import open_artifact
from llamactl.cli.app import app
from llamactl.layers.embedding import QuantEmbedding
from llamactl.layers.gptq import GPTQLinear, dequantize_gptq
from llamactl.runtime.load import load_model, resolve_dtype
from llamactl.quantize.rtn import quantize_embedding
from llamactl.options import RuntimeOptions

runner = CliRunner()


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 48), (8, -1)])
def test_a_lookup_unpacks_the_rows_of_the_table(bits, group):
    """Each looked-up row is that row of the dequantized table (48 leaves a short last group of 64
    columns; ids in any order and shape, the last id odd so a packed zero word is split)."""
    table = torch.randn(37, 64)
    packed = quantize_embedding(table, bits, group, sym=False)
    emb = QuantEmbedding(37, 64, bits, group)
    emb.load_state_dict(packed)
    full = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"].float(), packed["g_idx"], bits)  # [V, D]
    ids = torch.tensor([[3, 36, 0], [17, 17, 35]])
    torch.testing.assert_close(emb(ids), full[ids])
    assert (emb(ids) - table[ids]).abs().max() < (table.abs().max() / (2 ** bits - 1)) * 1.01  # within a step
    head = emb.head()
    assert isinstance(head, GPTQLinear) and head.qweight is emb.qweight  # the tied head: no copy
    x = torch.randn(2, 64)
    torch.testing.assert_close(head(x), x @ full.t(), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("tied"), heads=4, kv_heads=2, hidden=64, tie=True, seed=8)


PORTABLE = RuntimeOptions(kernels=False)  # the GPTQ modules as loaded (the format, not the kernels)


def _quantize(src, out, *extra):
    r = runner.invoke(app, ["quantize", str(src), "-o", str(out), "--method", "rtn", "--group-size", "32",
                            "--eval-tokens", "0", "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_tied_model_keeps_one_low_bit_table_that_its_head_reads(tied, tmp_path):
    plain = _quantize(tied, tmp_path / "q4")
    small = _quantize(tied, tmp_path / "q4e", "--embed-bits", "4")
    names = open_artifact(tmp_path / "q4e").tensor_index()
    assert "model.embed_tokens.qweight" in names and not any(n.startswith("lm_head") for n in names)
    assert "model.embed_tokens.weight" not in names
    assert small["params"]["embed_bits"] == 4 and small["params"]["engine"]["embed_tokens"]["bits"] == 4
    assert small["metrics"]["file_bpw"] < plain["metrics"]["file_bpw"] - 5  # the 16-bit table was most of the file
    art = open_artifact(tmp_path / "q4e")
    model = load_model(art, torch.device("cpu"), torch.float32, PORTABLE)
    emb = model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and model.lm_head.qweight is emb.qweight
    # the logits are those of the dequantized table used as embedding and head
    ref = load_model(open_artifact(tmp_path / "q4"), torch.device("cpu"), torch.float32, PORTABLE)
    table = dequantize_gptq(emb.qweight, emb.qzeros, emb.scales.float(), emb.g_idx, 4)  # [V, D]
    ref.model.embed_tokens.weight.data.copy_(table)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, torch.arange(4)), ref(ids, torch.arange(4)), rtol=1e-4, atol=1e-4)
    r = runner.invoke(app, ["generate", str(tmp_path / "q4e"), "-p", "hello", "-n", "4", "--temperature", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert resolve_dtype("auto", torch.device("cpu"), art) == torch.bfloat16  # the CPU int4 kernels' dtype


def test_embed_bits_refusals(tied, tmp_path):
    r = runner.invoke(app, ["quantize", str(tied), "-o", str(tmp_path / "a"), "--method", "rtn", "--embed-bits", "5"])
    assert r.exit_code != 0 and "--embed-bits 5 is not supported" in r.output
    r = runner.invoke(app, ["quantize", str(tied), "-o", str(tmp_path / "b"), "--method", "rtn", "--embed-bits", "4",
                            "--quantize-lm-head"])
    assert r.exit_code != 0 and "its head is its embedding table" in r.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_head_in_8_bits_beside_4_bit_layers(tmp_path):
    """--head-bits 8: lm_head per row in 8 bits (GPTQModel's per-module `dynamic` in config.json),
    the layers in 4; the loader builds each module at its own bits and the head's KL is small."""
    src = make_hf_model(tmp_path / "src", heads=4, kv_heads=2, hidden=64, seed=9)
    m = _quantize(src, tmp_path / "h8", "--head-bits", "8")
    cfg = json.loads((tmp_path / "h8" / "config.json").read_text())["quantization_config"]
    assert cfg["bits"] == 4 and cfg["dynamic"] == {"lm_head": {"bits": 8, "group_size": -1, "sym": True}}
    assert m["params"]["head_bits"] == 8
    model = load_model(open_artifact(tmp_path / "h8"), torch.device("cpu"), torch.float32, PORTABLE)
    assert model.lm_head.bits == 8 and model.lm_head.scales.shape[0] == 1
    assert model.model.layers[0].mlp.down_proj.bits == 4
    plain = _quantize(src, tmp_path / "q4")
    assert m["metrics"]["file_bpw"] < plain["metrics"]["file_bpw"]  # the head in 8 bits, not its stored width
    r = runner.invoke(app, ["quantize", str(src), "-o", str(tmp_path / "x"), "--method", "rtn", "--head-bits", "6"])
    assert r.exit_code != 0 and "--head-bits 6 is not supported" in r.output
