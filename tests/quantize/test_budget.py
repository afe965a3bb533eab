"""quantize --target-bpw: calibration statistics, the allocation under a budget, the files it writes."""

from __future__ import annotations

import json
import os

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llamactl.cli.app import app
from llamactl.errors import InputError
from llamactl.quantize.budget import Option, allocate, packed_bytes

runner = CliRunner()


def _table(seed: int, tensors: int = 40) -> dict[str, list[Option]]:
    """Many tensors, each small beside the budget (as in a model), with diminishing returns."""
    g = torch.Generator().manual_seed(seed)
    table = {}
    for t in range(tensors):
        base = int(torch.randint(20, 60, (1,), generator=g))
        weight = float(torch.rand(1, generator=g)) * 10  # some tensors matter far more than others
        opts = [Option({"bits": 4, "group_size": k, "sym": True}, base * (k + 1), weight / 4**k) for k in range(3)]
        table[f"t{t}"] = opts + [Option(None, base * 5, 0.0)]
    return table


def _best(table: dict[str, list[Option]], room: int) -> float:
    """The least total KL within `room` bytes (dynamic programming over exact byte counts)."""
    inf = float("inf")
    best = [0.0] + [inf] * room  # best[b]: least KL using exactly b bytes so far
    for opts in table.values():
        nxt = [inf] * (room + 1)
        for b, kl in enumerate(best):
            if kl < inf:
                for o in opts:
                    if b + o.bytes <= room:
                        nxt[b + o.bytes] = min(nxt[b + o.bytes], kl + o.kl)
        best = nxt
    return min(best)


@pytest.mark.parametrize("seed", range(3))
def test_allocation_fits_the_budget_and_is_near_the_best_choice(seed):
    """Within the budget, and within 2% of the least KL any combination within it reaches."""
    table = _table(seed)
    least = sum(min(o.bytes for o in opts) for opts in table.values())
    most = sum(max(o.bytes for o in opts) for opts in table.values())
    for room in (least + 50, (least + most) // 2, most - 50, most):
        a = allocate(table, fixed_bytes=100, budget_bytes=room + 100)
        got = {n: next(o for o in opts if o.scheme == a.schemes[n]) for n, opts in table.items()}
        assert a.bytes == 100 + sum(o.bytes for o in got.values()) <= room + 100
        assert a.predicted_kl == pytest.approx(sum(o.kl for o in got.values()))
        assert a.predicted_kl <= _best(table, room) * 1.02 + 1e-12


def test_a_budget_below_the_smallest_file_is_refused():
    table = _table(0)
    least = sum(min(o.bytes for o in opts) for opts in table.values())
    with pytest.raises(InputError, match="raise --target-bpw"):
        allocate(table, fixed_bytes=50, budget_bytes=least + 49)


def test_packed_bytes_count_every_tensor_written():
    from llamactl.layers.gptq import pack_gptq
    from llamactl.quantize.rtn import rtn_quantize

    w = torch.randn(96, 200)
    for bits, group in ((4, 32), (4, 128), (8, -1)):
        packed = pack_gptq(*rtn_quantize(w, bits, group, True), bits)
        data = sum(t.numel() * t.element_size() for t in packed.values())
        assert data < packed_bytes("x", 96, 200, {"bits": bits, "group_size": group, "sym": True}, 2) < data + 600
    assert packed_bytes("x", 96, 200, None, 2) > 96 * 200 * 2


@pytest.fixture(scope="module")
def stats_file(tiny_gqa, tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "tiny.safetensors"
    r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", str(out), "--n-samples", "2", "--seq-len", "64"])
    assert r.exit_code == 0, r.output
    return out


def test_calibrate_measures_every_quantizable_tensor(tiny_gqa, stats_file):
    from llamactl.folder.artifact import open_artifact
    from llamactl.quantize.sensitivity import load_stats

    art = open_artifact(tiny_gqa)
    stats = load_stats(stats_file, art)
    umask = os.umask(0)
    os.umask(umask)
    assert stats_file.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, as quantize's outputs
    assert [p.name for p in stats_file.parent.iterdir()] == [stats_file.name]  # nothing staged is left
    a = art.args
    assert len(stats.fisher) == 7 * a.num_hidden_layers + 2 and stats.tokens == 128
    assert stats.fisher["model.embed_tokens"].shape == (a.vocab_size, a.hidden_size)
    assert stats.act2["model.layers.0.mlp.down_proj"].shape == (a.intermediate_size,)
    for f in stats.fisher.values():
        assert bool((f >= 0).all()) and float(f.sum()) > 0
    assert all(bool((v > 0).all()) for v in stats.act2.values())


def test_calibrate_refuses_what_it_would_lose(tiny_gqa, stats_file, tmp_path):
    r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", str(stats_file)])
    assert r.exit_code != 0 and "pass --force" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", str(tmp_path)])
    assert r.exit_code != 0 and "is a folder" in r.output
    weights = sorted(tiny_gqa.glob("*.safetensors"))[0]
    before = weights.read_bytes()
    for target in (weights, tiny_gqa / "config.json", tiny_gqa / "stats.safetensors"):  # into the model: never
        r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", str(target), "--force"])
        assert r.exit_code != 0 and "input folder" in r.output and not (tiny_gqa / "stats.safetensors").exists()
    assert weights.read_bytes() == before
    other = tmp_path / "notes.safetensors"
    other.write_text("not statistics")
    r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", str(other), "--force"])  # --force: only stats files
    assert r.exit_code != 0 and "not a calibration statistics file" in r.output and other.read_text() == "not statistics"
    r = runner.invoke(app, ["calibrate", str(tiny_gqa), "-o", "/dev/null", "--force"])  # a device node stays one
    assert r.exit_code != 0 and Path("/dev/null").is_char_device()


def test_calibrating_a_model_with_nan_weights_is_one_line(tiny_gqa, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(tiny_gqa, model)
    shard = sorted(model.glob("*.safetensors"))[0]
    weights = load_file(shard)
    name = next(k for k in weights if "q_proj" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, shard, metadata={"format": "pt"})
    out = tmp_path / "stats.safetensors"
    r = runner.invoke(app, ["calibrate", str(model), "-o", str(out), "--n-samples", "2", "--seq-len", "16"])
    assert r.exit_code == 1 and "logits on calibration sample 1 are not finite" in r.output
    assert "Traceback" not in r.output and not out.exists()


def test_damaged_stats_are_refused(tiny_gqa, stats_file, tmp_path):
    """A stats file whose squares went negative (or NaN) steers the bit choice wrong: refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(stats_file), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in tensors if k.startswith("fisher/"))
    tensors[key] = -tensors[key]
    damaged = tmp_path / "damaged.safetensors"
    save_file(tensors, str(damaged), metadata=meta)
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(tmp_path / "q"), "--method", "rtn",
                            "--target-bpw", "6", "--calib-stats", str(damaged), "--eval-tokens", "0"])
    assert r.exit_code != 0 and "negative or non-finite" in r.output and not (tmp_path / "q").exists()


def test_stats_of_another_model_are_refused(tiny_mha, stats_file, tmp_path):
    r = runner.invoke(app, ["quantize", str(tiny_mha), "-o", str(tmp_path / "q"), "--method", "rtn",
                            "--target-bpw", "6", "--calib-stats", str(stats_file), "--eval-tokens", "0"])
    assert r.exit_code != 0 and "another shape" in r.output and not (tmp_path / "q").exists()


def test_target_bpw_writes_a_mixed_file_within_the_budget_that_loads(tiny_gqa, stats_file, tmp_path):
    from llamactl.folder.artifact import open_artifact
    from llamactl.folder.describe import describe, params_from_config
    from llamactl.runtime.load import load_model

    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(out), "--method", "rtn", "--target-bpw", "7",
                            "--calib-stats", str(stats_file), "--eval-tokens", "1024", "--json"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "llamactl.json").read_text())
    alloc = manifest["params"]["engine"]["allocation"]
    art = open_artifact(out)
    bpw = 8 * art.disk_bytes / params_from_config(art.args)
    assert bpw <= 7 and manifest["metrics"]["file_bpw"] == round(bpw, 3)
    assert len(alloc["choices"]) > 1  # mixed: the budget is between all-4-bit and all-8-bit
    assert describe(art)["tensor_bits"] == alloc["choices"]
    model = load_model(art, torch.device("cpu"), torch.float32)
    logits = model(torch.arange(8)[None], torch.arange(8))
    assert bool(torch.isfinite(logits).all())
    r = runner.invoke(app, ["inspect", str(out)])
    assert "tensors by bits" in r.output


def test_target_bpw_refuses_options_it_decides_itself(tiny_gqa, tmp_path):
    for extra in (["--embed-bits", "8"], ["--head-bits", "8"], ["--target-bpw", "0.5"]):
        r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(tmp_path / "q"), "--method", "rtn",
                                "--target-bpw", "5", *extra])
        assert r.exit_code != 0 and "Traceback" not in r.output, r.output
        assert "--target-bpw" in r.output


@pytest.mark.slow
def test_the_allocation_beats_a_uniform_file_of_the_same_size_on_the_trained_model(tmp_path):
    """The embedded (trained) model: a budget equal to a uniform file's size (4-bit g64 layers,
    table and head) gives a lower KL against the parent than that uniform file."""
    stats = tmp_path / "stats.safetensors"
    assert runner.invoke(app, ["calibrate", "embedded", "-o", str(stats), "--n-samples", "4"]).exit_code == 0
    common = ["--method", "rtn", "--asym", "--clip-search", "--eval-tokens", "4096", "--json"]
    r = runner.invoke(app, ["quantize", "embedded", "-o", str(tmp_path / "u"), "--group-size", "64",
                            "--embed-bits", "4", "--head-bits", "4", *common])
    assert r.exit_code == 0, r.output
    uniform = json.loads((tmp_path / "u" / "llamactl.json").read_text())["metrics"]
    r = runner.invoke(app, ["quantize", "embedded", "-o", str(tmp_path / "t"), "--target-bpw", str(uniform["file_bpw"]),
                            "--calib-stats", str(stats), *common])
    assert r.exit_code == 0, r.output
    target = json.loads((tmp_path / "t" / "llamactl.json").read_text())["metrics"]
    assert target["file_bpw"] <= uniform["file_bpw"]
    assert target["quality"]["kl_mean"] < 0.9 * uniform["quality"]["kl_mean"]


def test_widths_limit_the_choices(tiny_gqa, stats_file, tmp_path):
    out = tmp_path / "q"
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(out), "--method", "rtn", "--target-bpw", "6",
                            "--widths", "4,8", "--calib-stats", str(stats_file), "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    choices = json.loads((out / "llamactl.json").read_text())["params"]["engine"]["allocation"]["choices"]
    assert choices and all(k.startswith(("4-bit", "8-bit", "16-bit")) for k in choices)
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(tmp_path / "b"), "--method", "rtn", "--target-bpw", "6",
                            "--widths", "4,7", "--calib-stats", str(stats_file)])
    assert r.exit_code != 0 and "--widths" in r.output and "Traceback" not in r.output
