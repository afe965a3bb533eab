"""int4, int8 and FP8 (e4m3, weight-only) x bf16/fp16 products on the tensor cores for decode
batches (issues 51 and 53): mma.cu,
Marlin's approach (the codes laid out once at load as the MMA's B fragments, dequantized in
registers) in a kernel of llamactl's own.

The kernel is built at first use on a GPU machine: by nvcc into a cubin in the user's cache
(~/.cache/llamactl/cuda-kernels, named by a hash of the source, the compiler and the GPU's
architecture; written to a temporary name and renamed into place), else by NVRTC (PyTorch's
`torch.cuda._compile_kernel` machinery). Where neither works, `available()` says why and the
callers keep the Triton kernels. Not built from anything in a model folder.

Layouts (mma.cu's header comment): `pack` turns GPTQ-style codes [N, K] (0..15 or 0..255, groups
of consecutive columns; FP8: the e4m3 bytes), zeros and scales [K / group, N] into the kernel's qw
[N / 8, K / 128, 32 * bits / 4, 4] int32 and sz [K / group, N] int32; `emulate`
computes what the kernel computes, fragment by fragment, on any device (the tests' check of the
layout on a machine without a GPU).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from llamactl.errors import first_line
from llamactl.kernels.cpu import build_once, cache_root, compiler_stamp

SOURCE = Path(__file__).with_name("mma.cu")
MAX_ROWS = 64  # rows one launch takes (four m16 tiles)
TILES = (1, 2, 4)  # the kernel's variants: m16 tiles of rows, each for every kind of code, bf16 and fp16
KINDS = {"int4": 4, "int8": 8, "fp8": 8}  # the codes the kernel reads: their bits
DTYPES = {torch.bfloat16: ("bf16", 128), torch.float16: ("f16", 1024)}  # name, the magic number's value
E4M3_SHIFT = {torch.bfloat16: 120, torch.float16: 8}  # 2^-shift: an e4m3 code's bits read in dtype
VARIANTS = [f"mma_{c}_{d}_{t}" for c in KINDS for d, _ in DTYPES.values() for t in TILES]  # mma.cu's kernels
BLOCK_N, CHUNK_K = 128, 128  # columns a block owns; columns of K a step of its loop takes
# 4 bits: nibble p of a lane's word (lane = 4 g + t, word j) holds column 32 j + 2 t + NIBBLE_K[p] of
# its chunk: b0 and b1 of the first k-step (nibbles 0, 4 and 1, 5), then of the second (2, 6 and 3, 7)
NIBBLE_K = (0, 8, 16, 24, 1, 9, 17, 25)
# 8 bits: byte p of word j of a lane's uint4 h holds column 16 (4 h + j) + 2 t + BYTE_K[p]: b0, then b1
BYTE_K = (0, 1, 8, 9)


def supported(n: int, k: int, group: int) -> bool:
    """Whether the kernel takes a layer of n outputs, k inputs, groups of `group` inputs."""
    return n % BLOCK_N == 0 and k % CHUNK_K == 0 and group % 32 == 0 and k % group == 0


def _bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(dtype).float()


def pack(codes: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, group: int,
         dtype: torch.dtype = torch.bfloat16, kind: str = "int4") -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (int4 / int8: 0..2^bits - 1, in group order; fp8: float8_e4m3fn or its bytes),
    zeros (None for fp8) and scales [K / group, N] -> (qw [N / 8, K / 128, 32 * bits / 4, 4] int32,
    sz [K / group, N] int32: the scale high, in dtype (the activations'; fp8: times 2^E4M3_SHIFT);
    low, -(magic + zero) in dtype (magic 128 for bf16, 1024 for fp16), for bf16 8-bit codes the
    zero, for fp8 0)."""
    n, k = codes.shape
    bits = KINDS.get(kind)
    if bits is None or not supported(n, k, group) or scales.shape != (k // group, n) or (
            (zeros is None) != (kind == "fp8") or zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"mma.pack: {kind} codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, group {group}")
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    dev = codes.device
    t = torch.arange(4, device=dev).view(4, 1, 1)
    if bits == 4:  # [t, word j, nibble p]: a column of the chunk
        offs = torch.arange(4, device=dev).view(1, 4, 1) * 32 + 2 * t + torch.tensor(NIBBLE_K, device=dev).view(1, 1, 8)
    else:  # [t, k-step 4 h + j, byte p]
        offs = torch.arange(8, device=dev).view(1, 8, 1) * 16 + 2 * t + torch.tensor(BYTE_K, device=dev).view(1, 1, 4)
    cw = codes.to(torch.int64).view(n // 8, 8, k // CHUNK_K, CHUNK_K)  # [n8, g, c, column]
    parts = cw[:, :, :, offs]  # [n8, g, c, t, word, part]
    words = (parts << (bits * torch.arange(parts.shape[-1], device=dev))).sum(-1)  # [n8, g, c, t, word]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    v = bits // 4  # uint4 a lane reads per n-tile and chunk
    qw = words.view(n // 8, 8, k // CHUNK_K, 4, v, 4).permute(0, 2, 4, 1, 3, 5)  # [n8, c, h, g, t, j]
    qw = qw.reshape(n // 8, k // CHUNK_K, 32 * v, 4).contiguous()
    if kind == "fp8":
        scales, low = scales.double() * 2.0 ** E4M3_SHIFT[dtype], 0
    elif kind == "int8" and dtype == torch.bfloat16:
        low = zeros.to(torch.int32)
    else:
        low = _bits(-(DTYPES[dtype][1] + zeros.float()), dtype)
    return qw, ((_bits(scales, dtype) << 16) | low).to(torch.int32).contiguous()


def _codes(qw: torch.Tensor) -> torch.Tensor:
    """The dense codes [N, K] of a packed qw, each read from where the kernel reads it: for lane
    (g, t), b0 holds rows 2t, 2t + 1 and b1 rows 2t + 8, 2t + 9 of a k-step, column g of the n-tile
    (the PTX ISA's m16n8k16 fragments). 4 bits: nibbles 0/4 b0 and 1/5 b1 of a word's first k-step,
    2/6 and 3/7 of its second; 8 bits: bytes 0/1 b0 and 2/3 b1 of word j of uint4 h, k-step 4 h + j."""
    n8, chunks, lanes = qw.shape[:3]
    bits = lanes // 8
    w = (qw.to(torch.int64) & 0xFFFFFFFF).view(n8, chunks, bits // 4, 32, 4)  # [n8, c, h, lane, j]
    g, t = torch.arange(32) // 4, torch.arange(32) % 4
    if bits == 4:
        part = torch.stack([(w >> (4 * p)) & 0xF for p in range(8)], -1)  # [n8, c, h, lane, j, p]
        step = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1]) + 2 * torch.arange(4).view(4, 1)  # [j, p]
        row = torch.tensor([0, 8, 0, 8, 1, 9, 1, 9]).expand(4, 8)
    else:
        part = torch.stack([(w >> (8 * p)) & 0xFF for p in range(4)], -1)
        step = torch.arange(4).view(4, 1).expand(4, 4)
        row = torch.tensor([0, 1, 8, 9]).expand(4, 4)
    dense = torch.zeros(n8, 8, chunks, CHUNK_K, dtype=torch.int64)
    for h in range(bits // 4):
        col = ((step + 4 * h) * 16 + row).view(1, *step.shape) + 2 * t.view(32, 1, 1)  # [lane, j, p]
        gi = g.view(32, 1, 1).expand(col.shape)
        for c in range(chunks):
            dense[:, gi, c, col] = part[:, c, h]
    return dense.view(n8 * 8, chunks * CHUNK_K)


def emulate(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group: int,
            dtype: torch.dtype = torch.bfloat16, kind: str = "int4") -> torch.Tensor:
    """x [M, K] -> [M, N] float32 as the kernel computes it: the codes read as the kernel reads them
    (`_codes`), (q - z) * s (fp8: its value times s) rounded to dtype once, products of x in dtype
    summed in float32."""
    q = _codes(qw)
    szw = sz.to(torch.int64).cpu() & 0xFFFFFFFF
    s = _from_bits(szw >> 16, dtype).double()  # [G, N]
    cols = torch.arange(q.shape[1]) // group
    if kind == "fp8":
        v = q.to(torch.uint8).view(torch.float8_e4m3fn).double()
        wq = v * s.t()[:, cols] * 2.0 ** -E4M3_SHIFT[dtype]
    else:
        if kind == "int8" and dtype == torch.bfloat16:
            z = (szw & 0xFFFF).double()
        else:
            z = -_from_bits(szw & 0xFFFF, dtype).double() - DTYPES[dtype][1]
        wq = (q.double() - z.t()[:, cols]) * s.t()[:, cols]
    return x.to(dtype).float().cpu() @ wq.to(dtype).float().t()  # [N, K] rounded once


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _cubin(nvcc: str) -> Path:
    """The kernel's cubin for this GPU, built by nvcc once into the user's cache."""
    h = hashlib.sha256(SOURCE.read_bytes() + f"{compiler_stamp(nvcc)}:{_arch()}".encode())
    path = cache_root("cuda-kernels") / f"mma-{h.hexdigest()[:16]}.cubin"
    failed = build_once(path, lambda out: [nvcc, f"-arch={_arch()}", "-cubin", "-O3", "-o", str(out), str(SOURCE)], 300)
    if failed:
        raise RuntimeError(failed)
    return path


@functools.lru_cache(maxsize=None)
def _kernels() -> "dict[str, object] | str":
    """{a name of VARIANTS: the launchable kernel}, built at first use; or why not (one line)."""
    if not torch.cuda.is_available():
        return "the low-bit MMA kernel needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"the low-bit MMA kernel needs bf16 tensor cores (sm_80+), not {_arch()}"
    try:
        from torch.cuda._utils import _cuda_load_module
    except ImportError:
        return f"this torch ({torch.__version__}) cannot load CUDA modules (torch.cuda._utils)"
    why = []
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc:
        try:
            return _cuda_load_module(_cubin(nvcc).read_bytes(), VARIANTS)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why.append(f"nvcc: {first_line(e)}")
    try:
        from torch.cuda._utils import _nvrtc_compile

        ptx, _ = _nvrtc_compile(SOURCE.read_text(), VARIANTS[0], None, None, None)
        return _cuda_load_module(ptx, VARIANTS)
    except Exception as e:  # NVRTC missing or failing: the reason, for the plan's line
        why.append(f"NVRTC: {first_line(e)}")
    return "the low-bit MMA kernel could not be built (" + "; ".join(why) + ")"


def available() -> str | None:
    """None where the kernel runs here, else why not."""
    k = _kernels()
    return k if isinstance(k, str) else None


def variant(kind: str, dtype: torch.dtype, rows: int) -> str:
    """The kernel of VARIANTS that multiplies `rows` rows of dtype by `kind` codes."""
    return f"mma_{kind}_{DTYPES[dtype][0]}_{next(t for t in TILES if rows <= 16 * t)}"


def spread(chunks: int, split: int) -> tuple[int, int]:
    """(blocks along K, chunks each) for about `split` blocks over `chunks` chunks, none empty."""
    per = -(-chunks // max(1, min(chunks, split)))
    return -(-chunks // per), per


@functools.lru_cache(maxsize=None)
def split_for(n: int, k: int) -> tuple[int, int]:
    """(blocks along K, chunks each): about two blocks per SM, at least one chunk each."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return spread(k // CHUNK_K, -(-2 * sms // (n // BLOCK_N)))


@torch.library.custom_op("llamactl::mma", mutates_args=())
def mma(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group: int, kind: str) -> torch.Tensor:
    """x [M, K] bf16 or fp16 (M <= MAX_ROWS) on the GPU, qw/sz from pack for x's dtype and `kind`
    (on the GPU) -> [M, N] in x's dtype."""
    kernels = _kernels()
    if isinstance(kernels, str):
        raise RuntimeError(kernels)
    m, k = x.shape
    n = qw.shape[0] * 8
    if not (0 < m <= MAX_ROWS and x.dtype in DTYPES and qw.shape[1] * CHUNK_K == k and kind in KINDS
            and qw.shape[2] == 8 * KINDS[kind]):
        raise ValueError(f"mma: x {tuple(x.shape)} {x.dtype} against {kind} qw {tuple(qw.shape)}")
    x = x.contiguous()
    if x.data_ptr() % 16:  # a view that starts mid-row of its storage: the kernel loads 16 bytes at a time
        x = x.clone()
    split, per = split_for(n, k)
    out = (torch.zeros if split > 1 else torch.empty)(m, n, dtype=torch.float32, device=x.device)
    kernels[variant(kind, x.dtype, m)](grid=(n // BLOCK_N, split, 1), block=(128, 1, 1),
                                       args=[x, qw, sz, out, m, n, k, group, per, int(split > 1)])
    return out.to(x.dtype)


@mma.register_fake
def _(x, qw, sz, group, kind):
    return x.new_empty(x.shape[0], qw.shape[0] * 8)
