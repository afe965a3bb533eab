"""llamactl's own Triton kernels for the batch-1 decode step.

gemv       bf16 and 4-bit matrix-vector products that read weights near memory bandwidth
attention  split-KV decode attention that reads the cache only up to the current position

They run on CUDA when Triton is importable; with TRITON_INTERPRET=1 they run on the CPU through
Triton's interpreter (slow; used by the tests). `available` says whether they can run on a device.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from llamactl.env import flag

# the @triton.jit functions of gemv.py and attention.py: their Triton cache entries travel with
# `llamactl compile` artifacts (compiled binaries and autotune choices)
KERNEL_NAMES = ("_gemv_kernel", "_gemv_int4_kernel", "_dequant_int4_kernel", "_split_kernel", "_merge_kernel")
# the GEMV kernels' constexpr switch for each --quant-inputs kind but "float" (env.QUANT_INPUTS), in
# the order of their autotune keys (gemv._arithmetic sets them, pinned.inputs reads them back)
INPUT_SWITCHES = {"int8": "A8", "fp16": "H16", "int16": "I16"}
LAUNCHERS = ("__triton_launcher", "cuda_utils")  # Triton's C launchers, in its cache too


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def available(device: torch.device) -> bool:
    """Whether llamactl's Triton kernels run on `device` (LLAMACTL_KERNELS=0 turns them off).

    On CUDA they must first pass a self-check on the device (once per process); a failure is
    reported once and the model runs on cuBLAS, SDPA and tinygemm instead."""
    if not flag("LLAMACTL_KERNELS", True) or triton_version() is None:
        return False
    if device.type == "cuda":
        return _checked(_index(device))
    return device.type == "cpu" and interpreted()


def pdl(device: torch.device) -> bool:
    """Whether the kernels launch with programmatic dependent launch on `device`: each one's
    programs start while the kernel before it finishes, load their first weights and wait
    (griddepcontrol.wait) before reading what that kernel wrote, so the gaps between the ~224
    kernels of a decode step overlap. CUDA graphs keep it. Hopper (sm_90) and later, compiled
    kernels only; on by default, LLAMACTL_PDL=0 turns it off (run 19 on the H200, same run:
    llama2-7b decode bf16 +5.3%, int4 +2.8%, int8 +1.7%)."""
    if device.type != "cuda" or interpreted() or not flag("LLAMACTL_PDL", True):
        return False
    from llamactl.kernels.gdc import gdc_wait

    return gdc_wait is not None and _capability(_index(device)) >= (9, 0)


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel for `device`: with PDL, the kernel's own PDL flag (its
    griddepcontrol code) and Triton's launch_pdl (the launch attribute); else none."""
    return {"PDL": True, "launch_pdl": True} if pdl(device) else {}


def _index(device: torch.device) -> int:
    """The CUDA device's index (the current device's for a bare "cuda")."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def on_gpu(device: torch.device) -> bool:
    """Whether the kernels run compiled on `device`, a CUDA device (not through the CPU interpreter)."""
    return device.type == "cuda" and available(device)


def inputs_available(device: torch.device, inputs: str) -> bool:
    """Whether the low-bit GEMVs with `inputs` "int8" (DP4A), "fp16" (packed fp16 arithmetic) or
    "int16" (DP2A) run on `device`, where the kernels do: on CUDA they pass a check of their own
    first (once per process), so that a failure turns off only them, with a warning, and not the
    float kernels."""
    if device.type == "cuda":
        return _checked(_index(device), inputs)
    return True


@functools.lru_cache(maxsize=None)
def _checked(index: int, inputs: str = "float") -> bool:
    problem = self_check(torch.device("cuda", index), inputs)
    if problem:
        from llamactl import ui

        name = torch.cuda.get_device_name(index)
        ui.warn(f"llamactl's {inputs}-input GEMVs failed their check on {name} ({problem}); using float inputs."
                if inputs != "float" else
                f"llamactl's Triton kernels failed their check on {name} ({problem}); "
                "using cuBLAS/SDPA/tinygemm instead. LLAMACTL_KERNELS=0 silences this.")
    return problem is None


@torch.inference_mode()
def self_check(device: torch.device, inputs: str = "float") -> str | None:
    """Run each kernel once on small random inputs against a float64 reference: None when all
    agree (relative error under 2e-2, bf16 output), else what failed. inputs other than "float"
    (env.QUANT_INPUTS): the int4 and int8 GEMVs with those inputs instead."""
    from llamactl.kernels import attention, gemv

    def rel(y, ref):
        return float((y.double() - ref).norm() / ref.norm())

    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(256, device=device, generator=gen).to(bf16)
    checks = {}
    fixed, gemv.FIXED_BLOCKS = gemv.FIXED_BLOCKS, True
    try:
        w = torch.randn(48, 256, device=device, generator=gen).to(bf16)
        w8 = torch.randint(-127, 128, (48, 256), device=device, generator=gen, dtype=torch.int8)
        s8 = (torch.rand(48, device=device, generator=gen) * 0.01 + 1e-3).to(bf16)
        codes = torch.randint(0, 16, (48, 256), device=device, generator=gen)
        s4 = (torch.rand(48, 2, device=device, generator=gen) * 0.01 + 1e-3).half()
        z4 = torch.randint(0, 16, (48, 2), device=device, generator=gen).to(torch.uint8)
        w4 = (codes.double() - z4.double().repeat_interleave(128, 1)) * s4.double().repeat_interleave(128, 1)
        ref8 = (w8.double() @ x.double()) * s8.double()
        if inputs != "float":
            checks[f"gemv int8 {inputs}"] = rel(gemv.gemv(x, w8, s8, inputs=inputs), ref8)
            checks[f"gemv int4 {inputs}"] = rel(gemv.gemv_int4(x, gemv.pack_int4(codes), s4, z4, 128, inputs=inputs),
                                                w4 @ x.double())
            return _failed(checks)
        checks["gemv"] = rel(gemv.gemv(x, w), w.double() @ x.double())
        h = w.double() @ x.double()  # w as a fused [gate; up]: SwiGLU in the epilogue
        checks["gemv swiglu"] = rel(gemv.gemv(x, w, glu_out=True), F.silu(h[:24]) * h[24:])
        checks["gemv int8"] = rel(gemv.gemv(x, w8, s8), ref8)
        checks["gemv int4"] = rel(gemv.gemv_int4(x, gemv.pack_int4(codes), s4, z4, 128), w4 @ x.double())
        adt = torch.float16 if interpreted() else bf16  # the CPU interpreter mishandles bf16 tl.dot
        q = torch.randn(1, 2, 4, 64, device=device, generator=gen).to(adt)
        k, v = (torch.randn(1, 2, 300, 64, device=device, generator=gen).to(adt) for _ in range(2))
        ref = torch.softmax(q.double() @ k[:, :, :200].double().transpose(-1, -2) / 8, -1) @ v[:, :, :200].double()
        pos = torch.tensor([199], device=device)
        checks["decode attention"] = rel(attention.decode_attention(q, k, v, pos), ref)
        # with RoPE folded in: cos = 1, sin = 0 leaves q and the new key as they are
        k_new, v_new = k[:, :, 199].clone(), v[:, :, 199].clone()
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 199], v2[:, :, 199] = 0, 0
        ones, zeros = torch.ones(64, device=device), torch.zeros(64, device=device)
        out = attention.decode_attention_rope(q, k_new, v_new, k2, v2, ones, zeros, pos)
        checks["decode attention + rope"] = rel(out, ref)
    except Exception as e:  # a kernel that does not compile or launch here
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        gemv.FIXED_BLOCKS = fixed
    return _failed(checks)


def _failed(checks: dict[str, float]) -> str | None:
    """The checks whose relative error is not under 2e-2, as one line, or None."""
    bad = [f"{name} error {err:.1e}" for name, err in checks.items() if not err < 2e-2]
    return "; ".join(bad) or None


def cache_dir() -> Path | None:
    """Triton's cache folder (TRITON_CACHE_DIR or its default), or None without Triton."""
    if triton_version() is None:
        return None
    from triton import knobs

    return Path(knobs.cache.dir)


def save_cache(dest: Path, arch: int) -> int:
    """Copy the Triton cache entries of llamactl's kernels built for CUDA compute capability `arch`
    (90 for sm_90), their autotune choices and Triton's compiled launchers to dest; returns how many
    entries. Kernels built for other GPUs (or by scripts/compile_kernels.py) stay behind. A launcher
    is a C extension named for its Python ABI, so another Python misses it and rebuilds it (about
    0.3 s each with gcc, which a warm start otherwise pays)."""
    src = cache_dir()
    if src is None or not src.is_dir():
        return 0
    n = 0
    for entry in sorted(src.iterdir()):
        files = [f for f in entry.iterdir() if f.name.startswith(KERNEL_NAMES + LAUNCHERS)] if entry.is_dir() else []
        if files and all(_built_for(f, arch) for f in files):
            shutil.copytree(entry, dest / entry.name, dirs_exist_ok=True)
            n += 1
    return n


def _built_for(f: Path, arch: int) -> bool:
    """False for a kernel's metadata file (NAME.json) that names another target than CUDA `arch`."""
    if f.suffix != ".json" or f.name.endswith(".autotune.json"):
        return True
    try:
        target = json.loads(f.read_text()).get("target", {})
    except (OSError, ValueError):
        return False
    return target.get("backend") == "cuda" and target.get("arch") == arch


def load_cache(src: Path, skip: frozenset[str] = frozenset()) -> int:
    """Add saved entries to Triton's cache (existing ones, and those named in skip, are kept out);
    returns how many were added."""
    dest = cache_dir()
    if dest is None or not src.is_dir():
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if entry.is_dir() and not target.exists() and entry.name not in skip:
            tmp = dest / f".{entry.name}.llamactl-tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(entry, tmp)
            try:
                tmp.rename(target)  # atomic: a concurrent reader never sees half an entry
                n += 1
            except OSError:  # another process put it there first
                shutil.rmtree(tmp, ignore_errors=True)
    return n
