"""compile: cache artifacts written, keyed to this machine, loaded by generate and bench; mismatches warn."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from llamactl.errors import InputError
import torch
from typer.testing import CliRunner

from llamactl.cli.app import app
from llamactl.kernels.device import triton_version
from llamactl.layers import cpu as lcpu

runner = CliRunner()
# what a CPU step runs here: llamactl's CPU kernels, in bf16, where they build (layers.cpu)
CPU_GEMV = "llamactl cpu" if lcpu.quant_fast() or lcpu.bf16_fast() else "torch"
CPU_DTYPE = torch.bfloat16 if lcpu.bf16_fast() else torch.float32


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, trained_model):
    out = tmp_path_factory.mktemp("compile") / "c"
    r = runner.invoke(app, ["compile", str(trained_model), "-o", str(out), "--buckets", "64", "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def test_compile_writes_a_keyed_cache(compiled, trained_model):
    out, entry = compiled
    assert entry["key"]["device_name"] == "cpu" and entry["key"]["mode"] == "default" and entry["buckets"] == [64]
    assert entry["gemv"] == CPU_GEMV  # what the compiled step ran (on a GPU: "triton ..., PDL, int8 inputs", ...)
    assert (out / "compile-cache" / entry["file"]).stat().st_size == entry["bytes"] > 0
    man = json.loads((out / "llamactl.json").read_text())
    assert man["stage"] == "compile" and man["metrics"]["compile_cache"][0]["file"] == entry["file"]
    assert (out / "config.json").read_text() == (trained_model / "config.json").read_text()
    # the CPU step runs none of llamactl's Triton kernels, so no Triton cache entries travel
    assert entry["triton_cache"] is None and not any(p.name.startswith("triton-") for p in (out / "compile-cache").iterdir())
    # but Inductor's C++ kernel builds do (the cache artifacts hold only their source)
    carried = out / "compile-cache" / entry["cpu_builds"]
    builds = sorted(str(p.relative_to(carried)) for p in carried.glob("*/*.so"))
    assert builds == sorted(entry["cpu_build_sha256"]) and builds


def test_a_warm_cpu_start_finds_the_carried_builds(compiled, tmp_path, monkeypatch):
    """Loading the cache puts each carried build where Inductor looks for it (its cache dir, same
    relative path), so the warm start loads it instead of running the C++ compiler; builds it
    already has are left alone, and a damaged one is left out with a warning. (How many builds a
    step makes is Inductor's business: 1 in a fresh CI environment with its C++ wrapper, more elsewhere.)"""
    import shutil

    from llamactl import compile as comp
    from llamactl.folder.artifact import open_artifact

    out, entry = compiled
    names = sorted(entry["cpu_build_sha256"])
    assert len(names) >= 1

    def load(case: str, damage: str | None, keep: str | None):
        copy, cache = tmp_path / case / "c", tmp_path / case / "inductor"
        shutil.copytree(out, copy)  # the module's artifact stays intact for the other tests
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        if keep:
            (cache / keep).parent.mkdir(parents=True)
            (cache / keep).write_bytes(b"built here")
        if damage:
            (copy / "compile-cache" / entry["cpu_builds"] / damage).write_bytes(b"damaged")
        warnings = []
        assert comp.load_compile_cache(open_artifact(copy), torch.device("cpu"), CPU_DTYPE, warnings.append) is not None
        assert not list(cache.glob("*/.*llamactl-tmp"))
        return sorted(str(p.relative_to(cache)) for p in cache.glob("*/*.so")), warnings, cache

    present, warnings, cache = load("kept", None, names[0])
    assert present == names and not warnings and (cache / names[0]).read_bytes() == b"built here"
    present, warnings, _ = load("damaged", names[0], None)
    assert present == names[1:]
    assert len(warnings) == 1 and "damaged" in warnings[0] and names[0].split("/")[1] in warnings[0]


def test_a_cache_from_elsewhere_is_not_loaded_without_trust(compiled, tmp_path, monkeypatch):
    """The cache is native code: another user's (another key) or a changed one is refused and
    said, and --trust-compile-cache loads it (issue 19: a downloaded folder ran a swapped .so)."""
    import shutil

    from llamactl import compile as comp
    from llamactl.folder.artifact import open_artifact

    out, entry = compiled
    copy = tmp_path / "c"
    shutil.copytree(out, copy)
    art = open_artifact(copy)
    warnings = []
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
    assert comp.load_compile_cache(art, torch.device("cpu"), CPU_DTYPE, warnings.append) is None
    assert len(warnings) == 1 and "not built by this user on this machine" in warnings[0]
    users = tmp_path / "users-inductor-cache"  # where later runs would look
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(users))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "users-triton-cache"))
    assert comp.load_compile_cache(art, torch.device("cpu"), CPU_DTYPE, warnings.append, trust=True) is not None
    private = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # trusted for this run alone: its code went here
    assert not users.exists() and list(private.rglob("*.so")) and "llamactl-trusted-cache-" in str(private)
    monkeypatch.undo()
    man = json.loads((copy / "llamactl.json").read_text())
    man["metrics"]["compile_cache"][0]["cpu_build_sha256"] = {"x/evil.so": "0" * 64}  # a swapped build list
    (copy / "llamactl.json").write_text(json.dumps(man))
    warnings.clear()
    assert comp.load_compile_cache(open_artifact(copy), torch.device("cpu"), CPU_DTYPE, warnings.append) is None
    assert "changed since" in warnings[0]
    r = runner.invoke(app, ["generate", str(copy), "-p", "x", "-n", "2", "--temperature", "0", "--compile"])
    assert r.exit_code == 0 and "--trust-compile-cache" in " ".join(r.stderr.split())


def test_generate_uses_the_cache_and_matches_eager(compiled, monkeypatch):
    """A warm start also turns Inductor's compile workers off (it compiles nothing; run 45)."""
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    out, _ = compiled
    args = ["generate", str(out), "-p", "The kernel", "-n", "12", "--temperature", "0", "--json"]
    with inductor_config.patch(compile_threads=2):  # restored after it
        warm = runner.invoke(app, args + ["--compile"])
        threads = inductor_config.compile_threads
    eager = runner.invoke(app, args + ["--no-compile"])
    assert json.loads(eager.stdout)["compile_cache"] is None
    default = runner.invoke(app, args)  # no flag: the folder's cache made on this machine is the fast path
    assert json.loads(default.stdout)["compile_cache"] == "loaded" and "using the compile cache" in default.stderr
    assert warm.exit_code == 0, warm.output
    assert "warning" not in warm.stderr
    w = json.loads(warm.stdout)
    assert w["extra"]["mode"] == "compile" and w["compile_cache"] == "loaded" and w["compile_s"] > 0
    assert w["token_ids"][:8] == json.loads(eager.stdout)["token_ids"][:8]
    assert threads == 1
    line = runner.invoke(app, args[:-1] + ["--compile"])  # the timing line says compile apart from decode
    assert "(loaded compiled code)" in line.stderr and "decode" in line.stderr


def test_compile_workers_stay_as_the_environment_says(monkeypatch):
    import torch._inductor.config as inductor_config

    from llamactl.compile import skip_compile_workers

    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "2")
    with inductor_config.patch(compile_threads=2):
        skip_compile_workers()
        assert inductor_config.compile_threads == 2


@pytest.mark.slow
def test_bench_loads_the_cache_when_it_compiles(compiled):
    """bench --mode compile on a compiled folder loads its cache for this machine (a mismatched
    one warns, as generate does); other modes leave it alone."""
    out, _ = compiled
    args = ["bench", str(out), "--prompt-len", "8", "--gen-len", "4", "--warmup", "0", "--repeat", "1",
            "--format", "json"]
    r = runner.invoke(app, args + ["--mode", "compile"])
    assert r.exit_code == 0, r.output
    assert "compile cache" not in r.stderr and json.loads(r.stdout)["results"][0]["stage"].startswith("llamactl + compile")
    with _cache_for_another_torch(out):
        r = runner.invoke(app, args + ["--mode", "compile"])
        assert r.exit_code == 0, r.output
        assert "compiling from scratch" in r.stderr
        r = runner.invoke(app, args + ["--mode", "eager"])
        assert r.exit_code == 0, r.output
        assert "compiling from scratch" not in r.stderr


@contextmanager
def _cache_for_another_torch(out):
    """The compiled folder's manifest says its cache was made by torch 0.0.0, then is put back."""
    man_path = out / "llamactl.json"
    original = man_path.read_text()
    man = json.loads(original)
    man["metrics"]["compile_cache"][0]["key"]["torch"] = "0.0.0"
    man_path.write_text(json.dumps(man))
    try:
        yield
    finally:
        man_path.write_text(original)


def test_mismatched_cache_warns_and_recompiles(compiled):
    out, entry = compiled
    with _cache_for_another_torch(out):
        r = runner.invoke(app, ["generate", str(out), "-p", "x", "-n", "4", "--temperature", "0", "--compile"])
        assert r.exit_code == 0, r.output
        assert "compiling from scratch" in r.stderr


def test_a_cache_compiled_for_other_kernels_says_so(compiled, tmp_path):
    """A cache made for other GEMVs (e.g. `compile --quant-inputs int8` on a GPU) still loads, and
    generate says its kernels were compiled now."""
    out, _ = compiled
    man_path = out / "llamactl.json"
    original = man_path.read_text()
    man = json.loads(original)
    man["metrics"]["compile_cache"][0]["gemv"] = "triton 3.6.0, PDL, int8 inputs"
    man_path.write_text(json.dumps(man))
    try:
        r = runner.invoke(app, ["generate", str(out), "-p", "x", "-n", "4", "--temperature", "0", "--compile"])
        assert r.exit_code == 0, r.output
        assert f"made for gemv triton 3.6.0, PDL, int8 inputs; this run used {CPU_GEMV}" in " ".join(r.stderr.split())
    finally:
        man_path.write_text(original)
    bad = runner.invoke(app, ["compile", str(out), "-o", str(tmp_path / "o"), "--quant-inputs", "int4"])
    assert bad.exit_code == 2 and "use float, int8, fp16 or int16" in bad.output and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [("--buckets", "4"), ("--buckets", "999999"), ("--mode", "ludicrous")])
def test_bad_compile_options(trained_model, tmp_path, args):
    r = runner.invoke(app, ["compile", str(trained_model), "-o", str(tmp_path / "o"), "--device", "cpu", *args])
    assert r.exit_code == 1 and r.stderr.startswith("error: ")
    assert not (tmp_path / "o").exists()


def test_regional_compilation_defaults_and_override():
    import torch

    from llamactl.runtime.step import compile_regions
    from llamactl.options import RuntimeOptions

    default = RuntimeOptions()
    assert not compile_regions(torch.device("cpu"), default) and not compile_regions(torch.device("cuda"), default)
    assert compile_regions(torch.device("cpu"), RuntimeOptions(compile_regions=True))
    assert compile_regions(torch.device("cuda"), RuntimeOptions(compile_regions=True))
    assert not compile_regions(torch.device("cpu"), RuntimeOptions(compile_regions=False))


def test_triton_cache_entries_of_llamactl_kernels_travel(tmp_path, monkeypatch):
    """save_cache takes llamactl's kernel entries (not Inductor's) and Triton's launchers, load_cache
    adds them atomically."""
    from llamactl.kernels import cache as kernels

    cache = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    for entry, name in [("aaa", "_gemv_kernel.cubin"), ("bbb", "_split_kernel.autotune.json"), ("ccc", "triton_red_fused_0.cubin"),
                        ("eee", "__triton_launcher.cpython-311-x86_64-linux-gnu.so")]:
        (cache / entry).mkdir(parents=True)
        (cache / entry / name).write_text(entry)
    for entry, arch in [("aaa", 90), ("ddd", 80)]:  # the kernels' metadata names the GPU they were built for
        (cache / entry).mkdir(exist_ok=True)
        (cache / entry / "_gemv_kernel.json").write_text(json.dumps({"target": {"backend": "cuda", "arch": arch}}))
    saved = tmp_path / "saved"
    assert kernels.save_cache(saved, 90) == 3
    assert sorted(p.name for p in saved.iterdir()) == ["aaa", "bbb", "eee"]  # not Inductor's kernels, not sm_80's
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    assert kernels.load_cache(saved) == 3 and kernels.load_cache(saved) == 0  # the second adds nothing
    assert (tmp_path / "fresh" / "aaa" / "_gemv_kernel.cubin").read_text() == "aaa"


def test_damaged_triton_entries_of_an_artifact_are_left_out(tmp_path, monkeypatch):
    """compile records a checksum per saved file; an entry with a changed or missing file is not
    put into Triton's cache (Triton would load the damaged binary), the others are."""
    from llamactl import compile as comp
    from llamactl.kernels import cache as kernels

    saved = tmp_path / "saved"
    for entry in ("aaa", "bbb", "ccc"):
        (saved / entry).mkdir(parents=True)
        (saved / entry / "_gemv_kernel.cubin").write_text(entry)
    sums = comp._checksums(saved)
    assert sorted(sums) == ["aaa/_gemv_kernel.cubin", "bbb/_gemv_kernel.cubin", "ccc/_gemv_kernel.cubin"]
    (saved / "bbb" / "_gemv_kernel.cubin").write_text("damaged")
    (saved / "ccc" / "_gemv_kernel.cubin").unlink()
    bad = comp._damaged_entries(saved, sums)
    assert bad == {"bbb", "ccc"}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    assert kernels.load_cache(saved, bad) == 1 and sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["aaa"]
