"""The compile stage: compile and warm the decode step for each cache-length bucket, and keep
torch.compile's cache artifacts in an artifact folder so later runs start warm.

The cache is keyed by what makes compiled kernels valid: torch version, CUDA version, device name,
dtype and compile mode. A key that does not match this machine, or bytes torch refuses, give a
warning and a normal (cold) compile, never a crash.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llamactl.errors import InputError
from llamactl.folder.artifact import check_output, open_artifact, sha256_file, staged_output, write_manifest
from llamactl.folder.signing import signing_key
from llamactl.kernels import cache as kernels
from llamactl.kernels.device import triton_version
from llamactl.options import RuntimeOptions
from llamactl.runtime.load import load_model, resolve_device, resolve_dtype
from llamactl.runtime.step import Decoder, sync

CACHE_DIR = "compile-cache"
MODES = ("default", "reduce-overhead", "max-autotune")


def cache_key(device: torch.device, dtype: torch.dtype, mode: str) -> dict[str, str | None]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else None,
            "triton": triton_version(), "device_name": name, "dtype": str(dtype).replace("torch.", ""),
            "mode": mode}


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _signature(entry: dict) -> str:
    """HMAC of what a compile cache entry loads (its key and the checksums of every file)."""
    signed = {k: entry.get(k) for k in ("key", "file", "sha256", "triton_cache", "triton_cache_sha256",
                                         "cpu_builds", "cpu_build_sha256")}
    return hmac.new(signing_key(), json.dumps(signed, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def signed_cache_here(art, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the folder holds a compile cache for this machine that this user's key signed (one
    `llamactl compile` made here): what `generate` runs without --compile."""
    entries = ((art.manifest or {}).get("metrics") or {}).get("compile_cache") or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("key"), dict) for e in entries):
        return False
    try:
        return any(e["key"] == cache_key(device, dtype, e["key"].get("mode"))
                   and hmac.compare_digest(str(e.get("signature", "")), _signature(e)) for e in entries)
    except InputError:  # no usable signing key: nothing is trusted
        return False


def load_compile_cache(art, device: torch.device, dtype: torch.dtype, warn: Callable[[str], None],
                       trust: bool = False) -> dict | None:
    """Load the folder's compile cache for this machine; returns its manifest entry or None. The
    cache holds native code (Inductor's and Triton's builds), so it loads only when this user's
    key signed it (`llamactl compile` on this machine), or with `trust` (--trust-compile-cache);
    any other is refused with a warning and the step compiles from scratch."""
    entries = ((art.manifest or {}).get("metrics") or {}).get("compile_cache") or []
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) and isinstance(e.get("key"), dict)
                                                                for e in entries):
        return None
    want = cache_key(device, dtype, entries[0]["key"].get("mode"))
    for e in entries:
        if e["key"] == want:
            path = art.path / CACHE_DIR / str(e.get("file"))
            if not hmac.compare_digest(str(e.get("signature", "")), _signature(e)):
                if not trust:
                    warn(f"compile cache in {art.path} was not built by this user on this machine (or was changed "
                         "since): it holds native code, so it is not loaded; compiling from scratch "
                         "(--trust-compile-cache loads it anyway)")
                    return None
                private_caches()  # trusted for this run alone: later runs do not find its code
            if e.get("sha256") and (not path.is_file() or sha256_file(path) != e["sha256"]):
                warn(f"compile cache {path} is missing or damaged; compiling from scratch")
                return None
            try:
                torch.compiler.load_cache_artifacts(path.read_bytes())
                if e.get("triton_cache"):  # llamactl's own kernels: binaries and autotune choices
                    folder = art.path / CACHE_DIR / e["triton_cache"]
                    bad = _damaged_entries(folder, e.get("triton_cache_sha256") or {})
                    if bad:
                        warn(f"compile cache {folder}: {len(bad)} Triton entries are missing or damaged; "
                             "Triton will build those kernels again")
                    kernels.load_cache(folder, bad)
                if e.get("cpu_builds"):
                    load_cpu_builds(art.path / CACHE_DIR / e["cpu_builds"], e["cpu_build_sha256"], warn)
                return e
            except Exception as ex:  # stale or corrupt bytes: recompile instead
                warn(f"compile cache {path} could not be loaded ({type(ex).__name__}); compiling from scratch")
                return None
    have = ", ".join(f"{e['key']['device_name']} torch {e['key']['torch']}" for e in entries)
    warn(f"compile cache in {art.path} was made for {have}, not {want['device_name']} torch {want['torch']}; compiling from scratch")
    return None


def private_caches() -> Path:
    """Inductor's and Triton's caches in a folder of this process's own, removed at its exit (its
    path returned): a cache loaded with --trust-compile-cache lands there, not in the user's
    caches, where later runs would load its native code without being asked."""
    import atexit

    d = Path(tempfile.mkdtemp(prefix="llamactl-trusted-cache-"))
    atexit.register(shutil.rmtree, d, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(d / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(d / "triton")
    if triton_version() is not None:  # the knob follows the environment unless set in code
        from triton import knobs

        del knobs.cache.dir
    return d


def skip_compile_workers() -> None:
    """For a warm start: Inductor's compile workers off (compile_threads = 1), unless
    TORCHINDUCTOR_COMPILE_THREADS says otherwise. A warm start finds its kernels in the cache and
    compiles nothing, but Inductor starts a pool of worker processes at its first compile, which the
    short process then pays for (several seconds; docs/bench/README.md). What the cache lacks is
    then compiled in this process, one kernel at a time."""
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1


def _inductor_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


@contextmanager
def _fresh_inductor_dir() -> Iterator[Path]:
    """Inductor's cache dir set to an empty folder for the duration (the folder is yielded)."""
    with tempfile.TemporaryDirectory(prefix="llamactl-inductor-") as d, _env_var("TORCHINDUCTOR_CACHE_DIR", d):
        yield Path(d)


@contextmanager
def _env_var(name: str, value: str) -> Iterator[None]:
    """os.environ[name] = value inside the block (Inductor reads its cache dir from it), restored after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _checksums(folder: Path) -> dict[str, str]:
    """{path relative to folder: sha256} of every file below folder."""
    return {f.relative_to(folder).as_posix(): sha256_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}


def _damaged(folder: Path, sums: dict[str, str]) -> list[str]:
    """The files of sums (paths relative to folder) that are missing or differ from their sum: a
    loader (Triton, Inductor) would use a damaged binary as it is."""
    return [rel for rel, digest in sorted(sums.items())
            if not (folder / rel).is_file() or sha256_file(folder / rel) != digest]


def _damaged_entries(folder: Path, sums: dict[str, str]) -> frozenset[str]:
    """The top-level entries of folder (Triton cache entries) holding a damaged file (_damaged)."""
    return frozenset(rel.split("/")[0] for rel in _damaged(folder, sums))


def save_cpu_builds(src: Path, dest: Path) -> dict[str, str]:
    """Copy the shared libraries Inductor built under src (its C++ kernels and its probes of the
    CPU's vector instructions) to dest, same relative paths; returns {relative path: sha256}.
    The cache artifacts hold their C++ source only, so without them a warm CPU start rebuilds
    each one with the C++ compiler. Their names hash the source and the compiler flags (the
    vector ISA included), so another CPU looks for other names and builds its own."""
    for f in sorted(src.glob("*/*.so")):
        (dest / f.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / f.parent.name / f.name)
    return _checksums(dest) if dest.is_dir() else {}


def load_cpu_builds(src: Path, sums: dict[str, str], warn: Callable[[str], None]) -> int:
    """Put the saved builds into Inductor's cache dir where it has none of that name; returns how
    many. Inductor would load a damaged library as it is, so one whose checksum differs from the
    manifest's is left out (with a warning) and Inductor builds it again."""
    dest, n = _inductor_dir(), 0
    wanted = {rel: digest for rel, digest in sums.items() if not (dest / rel).exists()}
    bad = _damaged(src, wanted)
    for rel in bad:
        warn(f"compile cache build {src / rel} is missing or damaged; Inductor will build it again")
    for rel in sorted(set(wanted) - set(bad)):
        f, target = src / rel, dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.llamactl-tmp")
        shutil.copy2(f, tmp)
        os.replace(tmp, target)  # atomic: a concurrent compile never loads half a library
        n += 1
    return n


def warm(model, buckets: list[int], mode: str, progress, options: RuntimeOptions | None = None):
    """Compile and run the decode step once per bucket; returns seconds per bucket and the plan
    that ran (layers.plan.Plan: which kernels, PDL, inputs)."""
    timings = []
    with progress("compile buckets", len(buckets)) as advance:
        for b in buckets:
            t0 = time.perf_counter()
            dec = Decoder(model, 1, b, "compile", buckets=buckets, compile_mode=mode, options=options)
            ids = torch.zeros(1, min(8, b - 2), dtype=torch.long, device=model.device)
            tok = dec.prefill(ids)
            for i in range(2):
                tok = dec.step(tok, ids.shape[1] + i)
            sync(model.device)
            timings.append({"bucket": b, "seconds": round(time.perf_counter() - t0, 2)})
            advance(1)
    return timings, dec.plan


def compile_model(model_path: str | Path, out: str | Path, buckets: list[int], mode: str = "default", *,
                  device: str = "auto", dtype: str = "auto", force: bool = False, progress=None,
                  log: Callable[[str], None] = lambda m: None, options: RuntimeOptions | None = None) -> dict[str, Any]:
    """Write `out`: the model (hard-linked where possible) plus compile cache artifacts, compiled
    for `options` (the GEMVs' inputs among them; RuntimeOptions()'s defaults when None)."""
    if mode not in MODES:
        raise InputError(f"--mode {mode!r} is not known", f"use one of {', '.join(MODES)}")
    art = open_artifact(model_path)
    ctx = art.args.max_position_embeddings
    if not buckets or min(buckets) < 8 or max(buckets) > ctx:
        raise InputError(f"--buckets {buckets} must lie between 8 and the model's context ({ctx})")
    out = Path(out)
    check_output(out, force, [art.path])
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev, art)
    model = load_model(art, dev, dt, options)
    torch.compiler.reset()
    with ExitStack() as stack:
        # on the CPU, compile into an empty Inductor cache dir, so all its builds can be carried
        inductor_dir = stack.enter_context(_fresh_inductor_dir()) if dev.type == "cpu" else None
        t0 = time.perf_counter()
        timings, plan = warm(model, sorted(set(buckets)), mode, progress, options)
        cold = time.perf_counter() - t0
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise InputError("torch produced no compile cache artifacts", "is the inductor cache disabled in this environment?")
        blob, _info = saved
        key = cache_key(dev, dt, mode)
        tmp = stack.enter_context(staged_output(out, force, log))
        for f in art.path.iterdir():
            if f.is_file() and f.name != "llamactl.json":
                try:
                    os.link(f, tmp / f.name)  # weights are never modified, so sharing them is safe
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        (tmp / CACHE_DIR).mkdir()
        fname = f"{_key_id(key)}.bin"
        (tmp / CACHE_DIR / fname).write_bytes(blob)
        triton_dir, builds_dir = f"triton-{_key_id(key)}", f"cpu-builds-{_key_id(key)}"
        saved_kernels, builds = 0, {}
        if dev.type == "cuda":  # the CPU step runs no Triton kernels of llamactl's
            major, minor = torch.cuda.get_device_capability(dev)
            saved_kernels = kernels.save_cache(tmp / CACHE_DIR / triton_dir, 10 * major + minor)
        if inductor_dir is not None:
            builds = save_cpu_builds(inductor_dir, tmp / CACHE_DIR / builds_dir)
        entry = {"key": key, "file": fname, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                 "buckets": sorted(set(buckets)),
                 "triton_cache": triton_dir if saved_kernels else None, "triton_cache_entries": saved_kernels,
                 "triton_cache_sha256": _checksums(tmp / CACHE_DIR / triton_dir) if saved_kernels else {},
                 "cpu_builds": builds_dir if builds else None, "cpu_build_sha256": builds,
                 "cold_compile_seconds": round(cold, 2), "per_bucket": timings, "gemv": plan.label,
                 "plan": plan.as_dict()}
        entry["signature"] = _signature(entry)
        prior = (art.manifest or {}).get("params", {}) if art.manifest else {}
        params = {"mode": mode, "buckets": sorted(set(buckets)), "device": str(dev), "dtype": str(dt), "parent_params": prior}
        return write_manifest(tmp, "compile", art, params, {"compile_cache": [entry]}) | {"output": str(out)}
