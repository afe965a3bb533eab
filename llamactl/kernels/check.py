"""A self-check of every kernel on small random inputs against a float64 reference, once per
device: a kernel that fails it is not used, and the caller says so."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llamactl.errors import first_line
from llamactl.kernels.device import index, interpreted


def passed(device: torch.device, inputs: str = "float") -> str | None:
    """None when the kernels (inputs "float") or the int4/int8 GEMVs with `inputs` compute right on
    `device`, else what failed. On CUDA the check runs once per process and device; elsewhere the
    interpreter runs the same code the tests check."""
    if device.type != "cuda":
        return None
    return _checked(index(device), inputs)


@functools.lru_cache(maxsize=None)
def _checked(idx: int, inputs: str) -> str | None:
    return self_check(torch.device("cuda", idx), inputs)


@torch.inference_mode()
def self_check(device: torch.device, inputs: str = "float") -> str | None:
    """Run each kernel once against a float64 reference: None when all agree (relative error under
    2e-2, bf16 output), else what failed. inputs other than "float" (kernels.arith): the int4
    and int8 GEMVs with those inputs instead. One fixed block size each: no autotuning."""
    from llamactl.kernels import attention, gemv, gemv_int4

    def rel(y, ref):
        return float((y.double() - ref).norm() / ref.norm())

    gen = torch.Generator(device=device).manual_seed(0)
    bf16 = torch.bfloat16
    x = torch.randn(256, device=device, generator=gen).to(bf16)
    checks = {}
    fixed = {"fixed": True}
    try:
        w = torch.randn(48, 256, device=device, generator=gen).to(bf16)
        w8 = torch.randint(-127, 128, (48, 256), device=device, generator=gen, dtype=torch.int8)
        s8 = (torch.rand(48, device=device, generator=gen) * 0.01 + 1e-3).to(bf16)
        codes = torch.randint(0, 16, (48, 256), device=device, generator=gen)
        s4 = (torch.rand(48, 2, device=device, generator=gen) * 0.01 + 1e-3).half()
        z4 = torch.randint(0, 16, (48, 2), device=device, generator=gen).to(torch.uint8)
        w4 = (codes.double() - z4.double().repeat_interleave(128, 1)) * s4.double().repeat_interleave(128, 1)
        ref8 = (w8.double() @ x.double()) * s8.double()
        q4 = gemv_int4.pack_int4(codes)
        if inputs != "float":
            checks[f"gemv int8 {inputs}"] = rel(gemv.run_gemv(x, w8, s8, inputs=inputs, **fixed), ref8)
            checks[f"gemv int4 {inputs}"] = rel(gemv_int4.run_gemv_int4(x, q4, s4, z4, 128, inputs=inputs, **fixed),
                                                w4 @ x.double())
            return _failed(checks)
        checks["gemv"] = rel(gemv.run_gemv(x, w, **fixed), w.double() @ x.double())
        h = w.double() @ x.double()  # w as a fused [gate; up]: SwiGLU in the epilogue
        checks["gemv swiglu"] = rel(gemv.run_gemv(x, w, glu_out=True, **fixed), F.silu(h[:24]) * h[24:])
        checks["gemv int8"] = rel(gemv.run_gemv(x, w8, s8, **fixed), ref8)
        checks["gemv int4"] = rel(gemv_int4.run_gemv_int4(x, q4, s4, z4, 128, **fixed), w4 @ x.double())
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
        return first_line(e)
    return _failed(checks)


def _failed(checks: dict[str, float]) -> str | None:
    """The checks whose relative error is not under 2e-2, as one line, or None."""
    bad = [f"{name} error {err:.1e}" for name, err in checks.items() if not err < 2e-2]
    return "; ".join(bad) or None
