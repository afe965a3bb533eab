"""Bad and hostile inputs (issue 19): each gives one error line naming the file and field, exit 1,
and nothing written or run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llamactl.cli import app as app_module
from llamactl.cli.app import app

runner = CliRunner()


@pytest.fixture
def folder(tmp_path, tiny_gqa):
    work = tmp_path / "m"
    shutil.copytree(tiny_gqa, work)
    return work


def refused(args, *fragments):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith("error: "), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    for f in fragments:
        assert f in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("key,value,fragment", [
    ("hidden_size", [64], "hidden_size is [64]; expected an integer"),
    ("num_hidden_layers", None, "num_hidden_layers is missing or null"),
    ("vocab_size", "8192", "vocab_size is '8192'"),
    ("intermediate_size", -5, "intermediate_size is -5"),
    ("max_position_embeddings", 0, "max_position_embeddings is 0"),
    ("eos_token_id", 10**6, "eos_token_id is 1000000; expected token ids below vocab_size"),
    ("rope_parameters", "fast", "rope_scaling/rope_parameters is 'fast'"),
    ("tie_word_embeddings", "yes", "tie_word_embeddings is 'yes'; expected true or false"),
])
def test_config_values_are_type_and_range_checked(folder, key, value, fragment):
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    for cmd in ("inspect", "generate"):
        refused([cmd, folder, "-p", "x"] if cmd == "generate" else [cmd, folder], "config.json", fragment)


def _header(folder: Path) -> tuple[Path, dict, int]:
    f = next(folder.glob("*.safetensors"))
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return f, json.loads(raw[8:8 + n]), n


def _rewrite(f: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    f.write_bytes(len(h).to_bytes(8, "little") + h + data)


@pytest.mark.parametrize("damage,fragment", [
    (lambda h: ["a", "list"], "its header is a list"),
    (lambda h: {k: (dict(v, dtype="Q7") if k != "__metadata__" else v) for k, v in h.items()}, "dtype 'Q7'"),
    (lambda h: {k: (dict(v, data_offsets="0") if k != "__metadata__" else v) for k, v in h.items()}, "data_offsets '0'"),
    (lambda h: {k: (dict(v, shape=[10**9, 10**9]) if k != "__metadata__" else v) for k, v in h.items()}, "spans"),
])
def test_malformed_safetensors_headers_are_refused(folder, damage, fragment):
    f, header, n = _header(folder)
    data = f.read_bytes()[8 + n:]
    _rewrite(f, damage(header), data)
    refused(["inspect", folder], str(f.name), fragment)


def test_a_weight_path_that_is_a_fifo_or_a_folder_or_dangling_is_refused(folder):
    f = next(folder.glob("*.safetensors"))
    f.unlink()
    os.mkfifo(f)  # reading it would hang every command
    refused(["inspect", folder], "is a FIFO")
    f.unlink()
    f.mkdir()
    refused(["inspect", folder], "is a folder")
    f.rmdir()
    f.symlink_to(folder / "nowhere.safetensors")
    refused(["inspect", folder], "is a link to nothing")


def test_index_entries_outside_the_folder_and_links_out_are_refused(folder, tmp_path):
    f = next(folder.glob("*.safetensors"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(f, outside)
    f.symlink_to(outside)
    refused(["inspect", folder], "links outside the model folder")
    f.unlink()
    shutil.move(outside, f)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../../etc/passwd"}}))
    refused(["inspect", folder], "names shard files outside the folder")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    refused(["inspect", folder], "is not a valid weight index")


@pytest.mark.parametrize("name,content,fragment", [
    ("llamactl.json", b"\xff\xfe{}", "is not valid llamactl manifest"),
    ("llamactl.json", b'{"stage": 3}', "is not a llamactl manifest"),
    ("llamactl.json", b'{"stage": "quantize", "parent": "x"}', "is not a llamactl manifest"),
    ("generation_config.json", b'{"eos_token_id": "two"}', "generation_config.json"),
    ("generation_config.json", b"[1, 2", "is not valid JSON"),
])
def test_broken_side_files_are_refused(folder, name, content, fragment):
    (folder / name).write_bytes(content)
    refused(["inspect", folder], name, fragment)


def test_a_nan_model_is_an_error_not_a_score(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    f = next(folder.glob("*.safetensors"))
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("norm.weight"))
    sd[key] = sd[key] * float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    refused(["quantize", folder, "-o", tmp_path / "q", "--method", "rtn", "--group-size", "32", "--eval-tokens", "600"],
            "NaN or Inf")
    assert not (tmp_path / "q").exists() and not list(tmp_path.glob(".q*"))


def test_a_pickle_refusal_does_not_repeat_torchs_advice(folder):
    import torch

    f = next(folder.glob("*.safetensors"))
    f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    torch.save({"x": torch.nn.Linear(2, 2)}, folder / "pytorch_model.bin")  # a module: weights_only refuses it
    r = runner.invoke(app, ["generate", str(folder), "-p", "x", "--allow-pickle"])
    assert r.exit_code == 1 and "weights_only=False" not in r.stderr and "not a tensor" in r.stderr, r.stderr


def test_sigterm_removes_the_staging_folder_and_exits_143(tmp_path, tiny_gqa):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "llamactl", "quantize", str(tiny_gqa), "-o", str(out), "--method", "rtn",
                          "--group-size", "32", "--eval-tokens", "200000"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.tmp-*")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert list(tmp_path.glob(".out.tmp-*")), "the run never started staging"
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 143 and "terminated; nothing was written" in err
    assert sorted(tmp_path.iterdir()) == []


def test_a_full_disk_in_a_librarys_writer_is_one_line(tmp_path, tiny_gqa, monkeypatch):
    """safetensors' Rust writer and numpy's tofile do not raise an OSError of errno ENOSPC on a full
    disk (a SafetensorError saying "os error 28"; "N requested and M written"): still the machine's
    state, one line and exit 1, and the staging folder gone."""
    import safetensors
    import safetensors.torch

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "q"
    refused(["quantize", tiny_gqa, "-o", out, "--method", "rtn", "--group-size", "32", "--eval-tokens", "0"],
            "no space left on the device", "free some space")
    pytest.importorskip("gguf")
    import gguf

    def short(*a, **k):
        raise OSError("393216 requested and 321280 written")  # numpy's tofile, as gguf's writer calls it

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short)
    refused(["convert", tiny_gqa, "-o", tmp_path / "m.gguf"], "no space left on the device")
    assert sorted(tmp_path.iterdir()) == []


def test_a_ctrl_c_a_library_turns_into_its_own_error_is_still_an_interrupt(monkeypatch):
    """transformers' lazy imports turn a KeyboardInterrupt into a ModuleNotFoundError (and the
    tokenizer loader that into "could not be loaded"): a Ctrl-C that came is said as one, exit 130."""
    from llamactl.folder import describe

    real = describe.describe

    def interrupted_inside(art):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the boundary's handler raises KeyboardInterrupt here
            time.sleep(1)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'")  # no chain, as transformers
        return real(art)

    monkeypatch.setattr(describe, "describe", interrupted_inside)
    r = runner.invoke(app, ["inspect", "embedded"])
    assert r.exit_code == 130 and "interrupted; nothing was written" in r.stderr and "Traceback" not in r.stderr
    monkeypatch.setattr(describe, "describe", real)
    r = runner.invoke(app, ["generate", "~nosuchuser-llamactl/m", "-p", "x"])  # the next command is itself again
    assert r.exit_code == 1 and "no such user" in r.stderr


def test_a_sigterm_whose_interrupt_was_dropped_still_stops_before_the_output(tmp_path, tiny_gqa, monkeypatch):
    """A signal handler's exception raised inside a finalizer is printed and dropped, and the command
    runs on: the output is still not renamed into place, and the exit is 143, not 0."""
    import gc

    from llamactl.folder import artifact

    real = artifact.staged_output

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises Terminated inside __del__: dropped
            time.sleep(0.5)

    @contextlib.contextmanager
    def dropped(*a, **k):
        with real(*a, **k) as tmp:
            yield tmp
            Finalized()
            gc.collect()

    monkeypatch.setattr(artifact, "staged_output", dropped)
    monkeypatch.setattr("llamactl.quantize.stage.staged_output", dropped)
    previous = signal.signal(signal.SIGTERM, app_module._on_sigterm)
    try:
        r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(tmp_path / "q"), "--method", "rtn",
                                "--group-size", "32", "--eval-tokens", "0"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert r.exit_code == 143 and "terminated; nothing was written" in r.stderr
    assert sorted(tmp_path.iterdir()) == []


def test_a_ctrl_c_while_the_cli_imports_is_one_line():
    """Before a command starts, Ctrl-C ends the process with the line a later one gets."""
    code = "import os, signal; from llamactl.__main__ import _interrupted_at_start as h; h(signal.SIGINT, None)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 130 and p.stderr == "error: interrupted; nothing was written\n"


def test_stdin_that_is_not_utf8_and_a_huge_seed_are_refused():
    r = runner.invoke(app, ["generate", "-n", "2"], input=b"\xff\xfe abc")
    assert r.exit_code == 1 and "UTF-8" in r.stderr
    r = runner.invoke(app, ["generate", "-p", "x", "--seed", str(2**70)])
    assert r.exit_code == 2


def test_an_unknown_users_home_a_missing_pins_file_and_a_profile_file_are_one_line(tmp_path, monkeypatch):
    refused(["generate", "~nosuchuser-llamactl/m", "-p", "x", "-n", "1"], "no such user's home directory")
    monkeypatch.setenv("LLAMACTL_PINS_FILE", str(tmp_path / "nope.json"))
    refused(["generate", "-p", "x", "-n", "1"], "LLAMACTL_PINS_FILE", "no such file")
    monkeypatch.delenv("LLAMACTL_PINS_FILE")
    (tmp_path / "trace").write_text("")
    refused(["bench", "--synthetic", "tiny", "--profile", tmp_path / "trace"], "is a file, not a folder")


def test_inspect_refuses_what_the_loaders_refuse(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(cfg))
    refused(["inspect", folder], "config.json implies")


def test_bench_refuses_work_that_cannot_fit_before_allocating(tiny_gqa):
    refused(["bench", tiny_gqa, "--prompt-len", "250", "--gen-len", "64"], "longer than", "context (256)")
    refused(["bench", "--synthetic", "llama3-70b", "--device", "cpu"], "GiB of weights", "free")


def test_bench_quality_refuses_a_changed_or_self_naming_parent(tmp_path, tiny_gqa):
    child = tmp_path / "child"
    r = runner.invoke(app, ["quantize", str(tiny_gqa), "-o", str(child), "--method", "rtn", "--group-size", "32",
                            "--eval-tokens", "0"])
    assert r.exit_code == 0, r.output
    man = json.loads((child / "llamactl.json").read_text())
    changed = dict(man, parent=dict(man["parent"], manifest_sha256="0" * 64))
    (child / "llamactl.json").write_text(json.dumps(changed))
    args = ["bench", child, "--quality", "--eval-tokens", "300", "--repeat", "1", "--warmup", "0", "--gen-len", "4",
            "--prompt-len", "8"]
    refused(args, "changed since this artifact was made", "--reference")
    (child / "llamactl.json").write_text(json.dumps(dict(man, parent=dict(man["parent"], path=str(child),
                                                                           manifest_sha256=None))))
    refused(args, "names itself as its parent")


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tiny_gqa, monkeypatch):
    import errno

    from llamactl.quantize import rtn

    def full(state, folder, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    monkeypatch.setattr(rtn, "save_weights", full)  # the writer --method rtn calls
    refused(["quantize", tiny_gqa, "-o", tmp_path / "q", "--method", "rtn", "--group-size", "32", "--eval-tokens", "0"],
            "No space left on device", "free some space")
    assert list(tmp_path.iterdir()) == []


def test_compile_of_the_embedded_model_never_writes_into_the_package(tmp_path, monkeypatch):
    from llamactl.folder.artifact import DEFAULT_MODEL

    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["compile", "--buckets", "64", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "docs-llama-17m-compiled" / "llamactl.json").is_file()
    assert not (DEFAULT_MODEL.parent / "docs-llama-17m-compiled").exists()


def test_a_nan_model_does_not_generate_and_a_broken_chat_template_is_one_line(folder):
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('broken on purpose') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    refused(["generate", folder, "--chat", "-p", "hi", "-n", "2"], "chat template failed", "without --chat")
    f = next(folder.glob("*.safetensors"))
    sd = load_file(str(f))
    key = next(k for k in sd if k.endswith("norm.weight"))
    sd[key] = sd[key] * float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    refused(["generate", folder, "-p", "hi", "-n", "2"], "NaN or Inf")


def test_lineage_notes_show_relative_parents_resolve_from_the_folder_and_depth_is_bounded(tmp_path, tiny_gqa):
    """inspect shows "[parent missing]" (not eaten as markup); a hand-made manifest's relative
    parent path is read from the folder, not the current directory; a chain longer than 32 says
    so, and bench --quality refuses to take its 32nd ancestor for the root."""
    from llamactl.folder.artifact import lineage, open_artifact, sha256_file

    def child(name: str, parent: str, sha: str | None = None) -> Path:
        d = tmp_path / name
        shutil.copytree(tiny_gqa, d)
        (d / "llamactl.json").write_text(json.dumps({"stage": "quantize",
                                                     "parent": {"path": parent, "manifest_sha256": sha}}))
        return d

    r = runner.invoke(app, ["inspect", str(child("orphan", str(tmp_path / "gone")))])
    assert r.exit_code == 0 and "[parent missing]" in r.stdout, r.stdout
    rel = child("rel", "../base")
    shutil.copytree(tiny_gqa, tmp_path / "base")
    chain = lineage(open_artifact(rel))
    assert Path(chain[1]["path"]).resolve() == (tmp_path / "base").resolve()
    top = child("d40", "../base")
    for i in range(39, -1, -1):  # d0 <- d1 <- ... <- d40 <- base, each link's hash intact
        top = child(f"d{i}", f"../d{i + 1}", sha256_file(top / "llamactl.json"))
    chain = lineage(open_artifact(top))
    assert len(chain) == 32 and chain[-1]["parent_status"].startswith("not followed")
    refused(["bench", top, "--quality", "--prompt-len", "8", "--gen-len", "2"], "not followed")


@pytest.mark.parametrize("args,line", [
    (["serve", "--device", "cpu", "--port", "0"],
     "error: serving needs starlette, uvicorn, prometheus-client, which is not installed; pip install 'llamactl[serve]'"),
    (["bench", "--url", "http://127.0.0.1:9", "--requests", "1"],
     "error: the load test (bench --url, --serve) needs the 'httpx' package, which is not installed; install it with: pip install 'llamactl[serve]'"),
])
def test_serving_commands_without_their_libraries_are_one_line(args, line):
    """The base install has no Starlette, uvicorn, prometheus-client or httpx: serve and bench --url say
    what to install before they import anything that needs it (the README's serve on a fresh clone).
    A new process, with those packages hidden from imports."""
    hide = ("import sys\nfor m in ('starlette', 'uvicorn', 'prometheus_client', 'httpx'): sys.modules[m] = None\n"
            f"sys.argv = ['llamactl', *{args!r}]\nfrom llamactl.__main__ import main\nmain()")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == line, r.stderr
