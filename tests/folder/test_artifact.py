"""Artifact folders: validation, manifests, lineage and atomic output."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from llamactl.folder.artifact import (MANIFEST, check_output, copy_side_files, lineage, open_artifact, save_weights,
                               sha256_file, staged_output, write_manifest)
from llamactl.errors import CheckpointError, InputError, OutputExistsError


def test_staged_output_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_output(out, force=False) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            raise RuntimeError("interrupted")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_staged_output_refuses_existing_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("old")
    with pytest.raises(OutputExistsError, match="already exists"):
        with staged_output(out, force=False):
            pass
    assert (out / "keep").read_text() == "old"
    with pytest.raises(OutputExistsError, match="llamactl did not write"):  # --force replaces llamactl's outputs only
        with staged_output(out, force=True):
            pass
    assert (out / "keep").read_text() == "old"
    (out / "llamactl.json").write_text("{}")
    with staged_output(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_force_never_deletes_an_input_or_a_file(tmp_path):
    """quantize MODEL -o PARENT --force, PARENT holding MODEL, deleted the input (issue 19); a path
    that is no folder was renamed aside."""
    parent = tmp_path / "parent"
    (parent / "model").mkdir(parents=True)
    (parent / "llamactl.json").write_text("{}")
    with pytest.raises(InputError, match="contains the input"):
        check_output(parent, True, [parent / "model"])
    f = tmp_path / "file"
    f.write_text("data")
    with pytest.raises(OutputExistsError, match="not a folder"):
        check_output(f, True)
    assert f.read_text() == "data" and (parent / "model").is_dir()


def test_a_second_writer_of_the_same_output_is_refused(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, force=False):
        with pytest.raises(OutputExistsError, match="being written by another llamactl run"):
            with staged_output(out, force=False):
                pass
    assert out.is_dir() and not (tmp_path / ".out.lock").exists()


def test_staging_folders_of_killed_runs_are_cleaned_and_said(tmp_path):
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f".out.tmp-{dead.pid}-abc").mkdir()
    (tmp_path / ".out.lock").write_text(str(dead.pid))
    (tmp_path / f".out.tmp-{os.getpid()}-live").mkdir()  # a live process's: kept
    said = []
    with staged_output(tmp_path / "out", force=False, log=said.append) as tmp:
        (tmp / "x").write_text("1")
    assert len(said) == 2 and all("killed" in m for m in said)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.tmp-{os.getpid()}-live", "out"]


def test_output_may_not_be_the_input(tmp_path):
    with pytest.raises(InputError, match="inputs are never modified"):
        check_output(tmp_path, force=True, inputs=[tmp_path])


def test_manifest_and_lineage_chain(tmp_path, tiny_gqa):
    parent = open_artifact(tiny_gqa)
    a = tmp_path / "a"
    with staged_output(a, force=False) as tmp:
        save_weights({"w": torch.ones(3)}, tmp)
        copy_side_files(parent.path, tmp)
        shutil.copy(parent.path / "config.json", tmp / "config.json")
        write_manifest(tmp, "test-a", parent, {"x": 1}, {"m": 2.0})
    man = json.loads((a / MANIFEST).read_text())
    assert man["schema_version"] == 1 and man["stage"] == "test-a" and man["params"] == {"x": 1}
    assert man["files"] == {"model.safetensors": sha256_file(a / "model.safetensors")}
    assert man["parent"]["path"] == str(tiny_gqa.resolve())
    assert man["parent"]["manifest_sha256"] is None  # a plain HF folder has no manifest
    assert "torch_version" in man and "created" in man and "llamactl_version" in man

    b = tmp_path / "b"
    with staged_output(b, force=False) as tmp:
        shutil.copy(a / "config.json", tmp / "config.json")
        save_weights({"w": torch.ones(3)}, tmp)
        write_manifest(tmp, "test-b", open_artifact(a), {})
    chain = lineage(open_artifact(b))
    assert [e["stage"] for e in chain] == ["test-b", "test-a", "source"]
    assert chain[0]["parent_status"] == "ok"

    # Editing the parent's manifest breaks the hash link, and lineage says so.
    (a / MANIFEST).write_text((a / MANIFEST).read_text().replace('"x": 1', '"x": 2'))
    chain = lineage(open_artifact(b))
    assert chain[0]["parent_status"].startswith("changed")


def test_sharded_save_writes_index(tmp_path):
    state = {f"t{i}": torch.zeros(1000) for i in range(5)}
    names = save_weights(state, tmp_path, max_shard_bytes=8000)
    assert len(names) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)


def test_truncated_safetensors_is_detected(tmp_path, tiny_gqa):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_gqa, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_artifact(bad)


def test_an_integer_dtype_in_an_unquantized_models_header_is_refused(tmp_path, tiny_gqa):
    """A header entry damaged to I16 (the same bytes as BF16's, so every size checks out) would load
    as integers; a model without quantization_config refuses it."""
    import struct

    bad = tmp_path / "bad"
    shutil.copytree(tiny_gqa, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k.endswith("q_proj.weight"))
    width = {"BF16": "I16", "F16": "I16", "F32": "I32"}[header[name]["dtype"]]
    header[name]["dtype"] = width
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is {width}; an unquantized model's tensors are floating"):
        open_artifact(bad)


def test_pickled_weights_need_the_flag(tmp_path, tiny_gqa):
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_gqa / "config.json", folder / "config.json")
    torch.save(load_file(tiny_gqa / "model.safetensors"), folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow-pickle"):  # named, with the commands that take it
        open_artifact(folder)
    art = open_artifact(folder, allow_pickle=True)
    assert art.weight_format == "pickle"

    from llamactl.runtime.load import load_model

    model = load_model(art, torch.device("cpu"), torch.float32)
    ref = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight)
