"""kernels.pinned: tuned configs per GPU from data files (the lookup; no GPU needed)."""

import json

import pytest
import torch

from llamactl.errors import InputError
from llamactl.kernels import pinned


@pytest.fixture
def on_h200(monkeypatch):
    from llamactl.kernels import device

    monkeypatch.setattr(device, "name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(device, "index", lambda dev: 0)


def test_the_packaged_h200_file_reads_and_every_row_is_a_candidate():
    """Every packaged pin names a config the autotuner still offers (a stale pin would be ignored)."""
    triton = pytest.importorskip("triton")  # noqa: F841
    from llamactl.kernels import gemv, gemv_int4

    rows = pinned.read(pinned.file_for("NVIDIA H200"))
    assert len(rows) >= 40 and {r["kernel"] for r in rows} == {"gemv", "int4"}
    configs = {"gemv": gemv._bf16_configs(), "int4": gemv_int4._int4_configs()}
    for r in rows:
        key = tuple(r["key"][f] for f in pinned.KEY_FIELDS[r["kernel"]])
        table = {(r["kernel"], key): r["config"]}
        pinned._TABLES["t"] = table
        assert pinned.pick("t", r["kernel"], key, configs[r["kernel"]]) is not None, r


def test_resolve_gives_pins_on_an_h200_only_and_a_file_adds_to_them(on_h200, tmp_path):
    cuda = torch.device("cuda", 0)
    pins = pinned.resolve(cuda)
    assert pins.id and pins.source == "kernels/configs/NVIDIA_H200.json" and pins.count >= 40
    assert pinned.resolve(torch.device("cpu")) == pinned.NONE and pinned.resolve(cuda, on=False) == pinned.NONE
    row = {"kernel": "int4", "key": {"N": 64, "K": 256, "G": 128, "NORM": False, "GLU": False, "RESIDUAL": False,
                                     "GLU_OUT": False, "PDL": True, "inputs": "int16", "dtype": "bfloat16"},
           "config": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4}}
    extra = tmp_path / "mine.json"
    pinned.write(extra, "NVIDIA H200", [row], "abc1234", "llamactl bench --tune mine.json")
    doc = json.loads(extra.read_text())
    assert doc["commit"] == "abc1234" and doc["bench"].startswith("llamactl bench")
    both = pinned.resolve(cuda, extra=str(extra))
    assert both.count == pins.count + 1 and both.source.endswith("+ mine.json") and both.id != pins.id
    key = tuple(row["key"][f] for f in pinned.KEY_FIELDS["int4"])
    assert pinned.lookup(both.id, "int4", key) == row["config"] and pinned.lookup(pins.id, "int4", key) is None
    assert pinned.lookup("", "int4", key) is None


def test_older_pins_files_still_read_and_a_broken_one_is_one_clear_error(tmp_path):
    legacy = tmp_path / "old.json"
    legacy.write_text(json.dumps([["gemv", [64, 256, True, True, False, False, False, True, False, "bfloat16"],
                                   {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4}]]))
    (row,) = pinned.read(legacy)
    assert row["key"]["inputs"] == "float" and row["key"]["HAS_SCALE"] is True
    bad = tmp_path / "bad.json"
    for text in ("[[1, 2]]", "{", json.dumps({"pins": [{"kernel": "fft", "key": {}, "config": {}}]})):
        bad.write_text(text)
        with pytest.raises(InputError, match="not a readable pins file"):
            pinned.read(bad)


def test_a_pin_that_is_no_candidate_is_ignored():
    class Config:
        def __init__(self, **kw):
            self.kwargs, self.num_warps, self.num_stages = kw, 4, 1

    candidates = [Config(BLOCK_N=8, BLOCK_K=512), Config(BLOCK_N=16, BLOCK_K=1024)]
    pinned._TABLES["x"] = {("gemv", ("k",)): {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4},
                           ("gemv", ("gone",)): {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}}
    assert pinned.pick("x", "gemv", ("k",), candidates) is candidates[1]
    assert pinned.pick("x", "gemv", ("gone",), candidates) is None
    assert pinned.pick("x", "gemv", ("other",), candidates) is None


def test_tune_turns_the_autotuners_picks_into_pins(monkeypatch):
    """bench --tune: the autotuner's cache (its key: the key arguments, then the tensors' dtypes)
    becomes pins rows keyed as kernels.pinned reads them."""
    pytest.importorskip("triton")
    from llamactl.bench import tune
    from llamactl.kernels import gemv, gemv_int4

    config = gemv._bf16_configs()[0]
    names = gemv._gemv_tuned.keys
    values = {"N": 4096, "K": 4096, "HAS_SCALE": False, "NORM": False, "GLU": False, "RESIDUAL": True,
              "USE_ASM": True, "GLU_OUT": False, "PDL": True, "A8": False, "H16": False, "I16": True}
    key = tuple(values[n] for n in names) + ("torch.bfloat16", "torch.bfloat16")
    monkeypatch.setattr(gemv._gemv_tuned, "cache", {key: config})
    monkeypatch.setattr(gemv_int4._gemv_int4_tuned, "cache", {})
    (row,) = tune.picks()
    assert row["kernel"] == "gemv" and row["key"]["inputs"] == "int16" and row["key"]["dtype"] == "bfloat16"
    assert row["key"]["RESIDUAL"] and row["config"]["BLOCK_N"] == config.kwargs["BLOCK_N"]
