"""convert-heads: head permutation, mean and fit merges, RoPE exactness, distillation, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_hf_model
from llamactl.folder.artifact import MANIFEST, open_artifact
from llamactl.cli.app import app
from llamactl.gqa.heads import permute_units
from llamactl.runtime.load import iter_checkpoint, load_model

runner = CliRunner()


def convert(*args):
    return runner.invoke(app, ["convert-heads", *map(str, args)])


def logits(path_or_model, ids):
    model = path_or_model if not isinstance(path_or_model, (str,)) and hasattr(path_or_model, "setup_positions") else \
        load_model(open_artifact(path_or_model), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("mha"), heads=4, kv_heads=4, hidden=64, seed=11)


def test_permuting_whole_heads_leaves_logits_unchanged(mha, tmp_path):
    from llamactl.folder.artifact import save_weights

    art = open_artifact(mha)
    state = dict(iter_checkpoint(art))
    for layer in range(art.args.num_hidden_layers):
        permute_units(state, f"model.layers.{layer}", [2, 0, 3, 1], units=4, rep=1, d=art.args.head_dim)
    out = tmp_path / "perm"
    shutil.copytree(mha, out)
    (out / "model.safetensors").unlink()
    save_weights(state, out)
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           dict(iter_checkpoint(art))["model.layers.0.self_attn.q_proj.weight"])
    ids = torch.randint(0, 8192, (1, 48))
    torch.testing.assert_close(logits(str(out), ids), logits(str(mha), ids), atol=1e-5, rtol=0)


def test_mean_merge_averages_groups_and_loads_in_transformers(mha, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "gqa"
    r = convert(mha, "--kv-heads", "2", "-o", out, "--merge", "mean", "--eval-tokens", "512", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    d = 16  # head_dim of the fixture
    assert report["kv_bytes_per_token_before"] == 2 * 2 * 4 * d * 2
    assert report["kv_bytes_per_token_after"] == 2 * 2 * 2 * d * 2
    for key in ("kl_mean", "ppl", "ppl_parent", "top1_agreement"):
        assert key in report["quality"]
    parent = dict(iter_checkpoint(open_artifact(mha)))
    child = dict(iter_checkpoint(open_artifact(out)))
    wk = parent["model.layers.1.self_attn.k_proj.weight"].view(4, d, -1)
    torch.testing.assert_close(child["model.layers.1.self_attn.k_proj.weight"].view(2, d, -1), (wk[0::2] + wk[1::2]) / 2
                               if False else wk.view(2, 2, d, -1).mean(1))
    assert torch.equal(child["model.layers.1.self_attn.q_proj.weight"], parent["model.layers.1.self_attn.q_proj.weight"])
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    ref = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(0, 8192, (2, 40))
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(logits(str(out), ids), expected, atol=2e-4, rtol=0)
    man = json.loads((out / MANIFEST).read_text())
    assert man["stage"] == "convert-heads" and man["params"]["kv_heads_before"] == 4


def test_fit_is_exact_when_a_group_shares_keys_up_to_rope_phase(tmp_path):
    """Head 1's key pairs are head 0's multiplied per frequency by a complex number, and both
    heads read the same values: then one KV head represents both exactly, at every position."""
    from llamactl.folder.artifact import save_weights

    src = make_hf_model(tmp_path / "src", heads=2, kv_heads=2, hidden=64, seed=3, head_dim=32, layers=1)
    art = open_artifact(src)
    state = dict(iter_checkpoint(art))
    d, half = 32, 16
    p = "model.layers.0.self_attn"
    wk = state[f"{p}.k_proj.weight"].clone()
    k0 = torch.complex(wk[:half], wk[half:d])  # [d/2, hid]
    z = torch.polar(torch.rand(half) + 0.5, torch.rand(half) * 6.28)  # per-frequency complex factors
    k1 = k0 * z[:, None]
    wk[d : d + half], wk[d + half :] = k1.real, k1.imag
    state[f"{p}.k_proj.weight"] = wk
    wv = state[f"{p}.v_proj.weight"].clone()
    wv[d:] = wv[:d]
    state[f"{p}.v_proj.weight"] = wv
    (src / "model.safetensors").unlink()
    save_weights(state, src)
    out = tmp_path / "fit"
    r = convert(src, "--kv-heads", "1", "--merge", "fit", "-o", out, "--n-samples", "4", "--seq-len", "64",
                "--eval-tokens", "0")
    assert r.exit_code == 0, r.output
    ids = torch.randint(0, 8192, (1, 64))
    torch.testing.assert_close(logits(str(out), ids), logits(str(src), ids), atol=1e-3, rtol=1e-3)


@pytest.mark.slow
def test_fit_beats_mean_on_the_trained_model(trained_model, tmp_path):
    kl = {}
    for merge in ("mean", "fit"):
        r = convert(trained_model, "--kv-heads", "3", "--merge", merge, "-o", tmp_path / merge, "--n-samples", "8",
                    "--seq-len", "256", "--eval-tokens", "2048", "--json")
        assert r.exit_code == 0, r.output
        report = json.loads(r.stdout)
        kl[merge] = report["quality"]["kl_mean"]
        if merge == "mean":  # the repair hint is in the JSON, and on stderr, in --json mode too
            assert "--merge fit and --distill-steps 200 repair most of it" in report["warnings"][0]
            assert "lost much quality" in r.stderr
    assert kl["mean"] > 1.0  # mean-pooling without training is catastrophic on a trained model
    assert kl["fit"] < 0.35 * kl["mean"]


@pytest.mark.slow
def test_similarity_grouping_permutes_consistently(trained_model, tmp_path):
    out = tmp_path / "sim"
    r = convert(trained_model, "--kv-heads", "3", "--grouping", "similarity", "--merge", "fit", "-o", out,
                "--n-samples", "4", "--seq-len", "128", "--eval-tokens", "1024", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    for layer in report["params"]["groups_per_layer"]:
        assert sorted(u for g in layer for u in g) == list(range(6)) and all(len(g) == 2 for g in layer)
    assert report["quality"]["kl_mean"] < 1.0


def test_distillation_runs_on_the_cpu_and_lowers_kl(mha, tmp_path):
    r = convert(mha, "--kv-heads", "2", "--distill-steps", "12", "--distill-lr", "3e-3", "-o", tmp_path / "d",
                "--n-samples", "8", "--seq-len", "64", "--eval-tokens", "0", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)["metrics"]["distill"]
    assert d["steps"] == 12 and d["kl_last"] < d["kl_first"]


@pytest.mark.parametrize("args,fragment", [
    (("--kv-heads", "3"), "does not divide the model's 4 KV heads; valid values for"),
    (("--kv-heads", "4"), "is not below the model's 4 KV heads"),
    (("--kv-heads", "9"), ": 1, 2"),  # the hint names the valid values
    (("--kv-heads", "2", "--merge", "avg"), "--merge 'avg'"),
])
def test_bad_input_is_refused_and_nothing_written(mha, tmp_path, args, fragment):
    out = tmp_path / "o"
    r = convert(mha, "-o", out, *args)
    assert r.exit_code == 1 and fragment in r.stderr, r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_quantized_input_is_refused(mha, tmp_path):
    q = tmp_path / "q"
    assert runner.invoke(app, ["quantize", str(mha), "-o", str(q), "--method", "rtn", "--group-size", "64",
                               "--eval-tokens", "0"]).exit_code == 0
    r = convert(q, "--kv-heads", "2", "-o", tmp_path / "o")
    assert r.exit_code == 1 and "convert the 16-bit model first, then quantize" in r.stderr
