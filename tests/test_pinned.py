"""kernels.pinned: the autotune picks pinned per GPU and shape (the lookup; no GPU needed)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llamactl.kernels import gemv, pinned  # noqa: E402

KERNELS = {"gemv": (gemv._prune_gemv, gemv._bf16_configs), "int4": (gemv._prune_int4, gemv._int4_configs)}


def launch_args(kernel: str, key: tuple, device: str = "cuda:0") -> dict:
    """The launch's arguments by name, as the autotuner's prune hook gets them, for a table key."""
    n, k, third, norm, glu, residual, glu_out, pdl, inputs, dtype = key
    args = {"x_ptr": _Input(getattr(torch, dtype), torch.device(device)), "N": n, "K": k, "NORM": norm, "GLU": glu, "RESIDUAL": residual,
            "GLU_OUT": glu_out, "PDL": pdl, "A8": inputs == "int8", "H16": inputs == "fp16",
            "I16": inputs == "int16"}
    return args | ({"G": third} if kernel == "int4" else {"HAS_SCALE": third})


class _Input:
    """A stand-in for the input tensor: its dtype, on a device this machine may not have."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device


@pytest.fixture
def on_h200(monkeypatch):
    monkeypatch.setattr(pinned, "_device_name", lambda index: "NVIDIA H200")
    monkeypatch.delenv("LLAMACTL_PIN_CONFIGS", raising=False)


def prune(kernel: str, args: dict) -> list:
    """The kernel's prune hook on all its candidates, called as the autotuner calls it: the
    positional arguments by name, the flags the launcher passes by keyword."""
    hook, configs = KERNELS[kernel]
    kw = {k: args[k] for k in ("GLU_OUT", "PDL", "A8", "H16", "I16") if k in args}
    return hook(configs(), {k: v for k, v in args.items() if k not in kw}, **kw)


@pytest.mark.parametrize("kernel", ["gemv", "int4"])
def test_every_pin_is_a_candidate_the_prune_hook_returns_alone(kernel, on_h200):
    """A pin that the candidate lists (or the A8 twin pruning) no longer hold would be ignored:
    catch it here, where the lists change."""
    for key, want in pinned.TABLE["NVIDIA H200"][kernel].items():
        chosen = prune(kernel, launch_args(kernel, key))
        assert len(chosen) == 1, (key, want)
        c = chosen[0]
        assert {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} == want, key


def test_unlisted_shapes_gpus_and_the_switch_tune_as_before(on_h200, monkeypatch):
    key = next(iter(pinned.TABLE["NVIDIA H200"]["int4"]))
    every = len(prune("int4", launch_args("int4", (1024,) + key[1:])))  # a shape not in the table
    assert every > 1
    args = launch_args("int4", key)
    assert len(prune("int4", args)) == 1
    assert len(prune("int4", args | {"A8": True})) == 1  # int8 inputs: pinned for int4 too (run 35)
    assert len(prune("int4", args | {"H16": True})) == 1  # and packed fp16 (run 36)
    assert len(prune("int4", args | {"PDL": False})) == every  # a flag of no pinned row
    monkeypatch.setenv("LLAMACTL_PIN_CONFIGS", "0")
    assert len(prune("int4", args)) == every
    monkeypatch.delenv("LLAMACTL_PIN_CONFIGS")
    assert len(prune("int4", launch_args("int4", key, device="cpu"))) == every
    monkeypatch.setattr(pinned, "_device_name", lambda index: "NVIDIA A100-SXM4-80GB")
    assert len(prune("int4", args)) == every


def test_fp16_activations_and_other_flags_are_not_pinned(on_h200):
    key = next(iter(pinned.TABLE["NVIDIA H200"]["gemv"]))
    every = len(gemv._bf16_configs())
    assert len(prune("gemv", launch_args("gemv", key[:-1] + ("float16",)))) == every
    assert len(prune("gemv", launch_args("gemv", key) | {"PDL": False})) == every


def test_a_pins_file_overrides_the_table_for_its_shapes(on_h200, monkeypatch, tmp_path):
    """LLAMACTL_PINS_FILE: its rows pin their shapes over the table (here int8 o_proj with int8
    inputs: 16 x 2048 instead of the table's 8 x 2048) and add shapes; the rest keep the table's pins.
    A row written before the inputs were named (true for int8) still pins its shape."""
    import json

    o_a8 = (4096, 4096, True, False, False, True, False, True, "int8", "bfloat16")
    new_shape = (1024, 4096, True, False, False, True, False, True, "int8", "bfloat16")
    want = {"BLOCK_N": 16, "BLOCK_K": 2048, "PREFETCH": False, "REDUCE_EACH": False, "num_warps": 8, "num_stages": 1}
    assert pinned.TABLE["NVIDIA H200"]["gemv"][o_a8] != want
    old_form = [*o_a8[:8], True, o_a8[9]]  # runs 32-40's files
    (tmp_path / "pins.json").write_text(json.dumps([["gemv", old_form, want], ["gemv", list(new_shape), want]]))
    monkeypatch.setenv("LLAMACTL_PINS_FILE", str(tmp_path / "pins.json"))
    for key in (o_a8, new_shape):
        (c,) = prune("gemv", launch_args("gemv", key))
        assert {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages} == want
    key = next(iter(pinned.TABLE["NVIDIA H200"]["int4"]))
    assert len(prune("int4", launch_args("int4", key))) == 1
    assert pinned.label(torch.device("cuda:0")) == ", pinned configs (and pins.json)"  # reports name the file
    monkeypatch.delenv("LLAMACTL_PINS_FILE")
    assert pinned.label(torch.device("cuda:0")) == ", pinned configs" and pinned.label(torch.device("cpu")) == ""


def test_a_bad_pins_file_is_one_clear_error(on_h200, monkeypatch, tmp_path):
    from llamactl.errors import InputError

    monkeypatch.setenv("LLAMACTL_PINS_FILE", str(tmp_path / "pins.json"))
    for bad in ("{not json", '[["gemv", [4096, 4096], {}]]', '[["gemm", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], {}]]', "[1]"):
        (tmp_path / "pins.json").write_text(bad)
        pinned._file_pins.cache_clear()
        with pytest.raises(InputError, match="LLAMACTL_PINS_FILE"):
            pinned.table(torch.device("cuda:0"))
    (tmp_path / "missing.json").unlink(missing_ok=True)
    monkeypatch.setenv("LLAMACTL_PINS_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match="missing.json"):
        pinned.table(torch.device("cuda:0"))


def test_pins_from_autotune_turns_a_runs_log_into_the_tables_rows():
    """scripts/pins_from_autotune.py on run 41's log (keys with A8, H16 and I16) gives the int4
    int16 rows pinned from it, and reads run 24's (A8 only) with --switches 1."""
    import ast
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import pins_from_autotune
    finally:
        sys.path.pop(0)

    def parse(rows):
        out = {}
        for row in rows:
            kernel, key, cfg = re.fullmatch(r'"(\w+)": (\(.*?\)): (_cfg\(.*\)),', row).groups()
            out[kernel, ast.literal_eval(key)] = eval(cfg, {"_cfg": pinned._cfg})
        return out

    run41 = parse(pins_from_autotune.rows((root / "docs/bench/run41-autotune.txt").read_text()))
    int16 = {key: cfg for (kernel, key), cfg in run41.items() if kernel == "int4" and key[8] == "int16"}
    assert len(int16) == 4 and all(pinned.TABLE["NVIDIA H200"]["int4"][key] == cfg for key, cfg in int16.items())
    run24 = parse(pins_from_autotune.rows((root / "docs/bench/run24-autotune.txt").read_text(), switches=1))
    assert {key[8] for _, key in run24} == {"float", "int8"}
    with pytest.raises(SystemExit, match="switches"):
        pins_from_autotune.rows((root / "docs/bench/run24-autotune.txt").read_text())


def test_every_quant_inputs_kind_keys_the_pins_by_its_own_name():
    """gemv._arithmetic's switches for each --quant-inputs kind read back (pinned.inputs) as that kind."""
    from llamactl.env import QUANT_INPUTS

    assert [pinned.inputs(gemv._arithmetic(kind)) for kind in QUANT_INPUTS] == list(QUANT_INPUTS)
