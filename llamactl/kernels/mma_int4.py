"""int4 x bf16 products on the tensor cores for decode batches (issue 51): mma_int4.cu, Marlin's
approach (the codes laid out once at load as the MMA's B fragments, dequantized in registers) in a
kernel of llamactl's own.

The kernel is built at first use on a GPU machine: by nvcc into a cubin in the user's cache
(~/.cache/llamactl/cuda-kernels, named by a hash of the source, the compiler and the GPU's
architecture; written to a temporary name and renamed into place), else by NVRTC (PyTorch's
`torch.cuda._compile_kernel` machinery). Where neither works, `available()` says why and the
callers keep the Triton kernels. Not built from anything in a model folder.

Layouts (mma_int4.cu's header comment): `pack` turns GPTQ-style codes [N, K] (0..15, groups of
consecutive columns), zeros and scales [K / group, N] into the kernel's qw [N / 8, K / 128, 32, 4]
int32 and sz [K / group, N] int32; `emulate` computes what the kernel computes, fragment by
fragment, on any device (the tests' check of the layout on a machine without a GPU).
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

SOURCE = Path(__file__).with_name("mma_int4.cu")
MAX_ROWS = 64  # rows one launch takes (four m16 tiles)
TILES = (1, 2, 4)  # the kernel's variants: m16 tiles of rows, each for bf16 and fp16
DTYPES = {torch.bfloat16: ("bf16", 128), torch.float16: ("f16", 1024)}  # name, the magic number's value
BLOCK_N, CHUNK_K = 128, 128  # columns a block owns; columns of K a step of its loop takes
# nibble p of a lane's word (lane = 4 g + t, word j) holds column 32 j + 2 t + NIBBLE_K[p] of its chunk:
# b0 and b1 of the first k-step (nibbles 0, 4 and 1, 5), then of the second (2, 6 and 3, 7)
NIBBLE_K = (0, 8, 16, 24, 1, 9, 17, 25)


def supported(n: int, k: int, group: int) -> bool:
    """Whether the kernel takes a layer of n outputs, k inputs, groups of `group` inputs."""
    return n % BLOCK_N == 0 and k % CHUNK_K == 0 and group % 32 == 0 and k % group == 0


def _bits(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF


def _from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16).view(dtype).float()


def pack(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
         dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15, in group order), zeros/scales [K / group, N] -> (qw [N / 8, K / 128, 32, 4]
    int32, sz [K / group, N] int32: -(magic + zero) low, the scale high, in dtype (bf16: magic 128;
    fp16: 1024), the activations' dtype)."""
    n, k = codes.shape
    if not supported(n, k, group) or zeros.shape != (k // group, n) or scales.shape != zeros.shape:
        raise ValueError(f"mma_int4.pack: codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)}, group {group}")
    dev = codes.device
    t, j, p = torch.arange(4, device=dev), torch.arange(4, device=dev), torch.tensor(NIBBLE_K, device=dev)
    offs = j.view(1, 4, 1) * 32 + 2 * t.view(4, 1, 1) + p.view(1, 1, 8)  # [t, j, p]: a column of the chunk
    cw = codes.to(torch.int64).view(n // 8, 8, k // CHUNK_K, CHUNK_K)  # [n8, g, c, column]
    nib = cw[:, :, :, offs]  # [n8, g, c, t, j, p]
    words = (nib << (4 * torch.arange(8, device=dev))).sum(-1)  # [n8, g, c, t, j]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    qw = words.permute(0, 2, 1, 3, 4).reshape(n // 8, k // CHUNK_K, 32, 4).contiguous()
    magic = DTYPES[dtype][1]
    sz = (_bits(scales.float(), dtype) << 16) | _bits(-(magic + zeros.float()), dtype)
    return qw, sz.to(torch.int32).contiguous()


def emulate(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group: int,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] -> [M, N] float32 as the kernel computes it: each lane's B fragments read from its
    word as mma_int4.cu reads them (nibbles 0/4 and 1/5: rows 2t, 2t + 1 and 2t + 8, 2t + 9 of the
    first k-step; 2/6 and 3/7 of the second; column g of the n-tile), (q - z) * s rounded to dtype
    once, products of x in dtype summed in float32."""
    n8, chunks = qw.shape[:2]
    n, k = n8 * 8, chunks * CHUNK_K
    w = qw.to(torch.int64) & 0xFFFFFFFF  # [n8, c, lane, j]
    nib = torch.stack([(w >> (4 * p)) & 0xF for p in range(8)], -1)  # [n8, c, lane, j, p]
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    # nibble p -> (k-step s, row of the k-step): (0: s0 2t) (4: s0 2t+1) (1: s0 2t+8) (5: s0 2t+9) ...
    step = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    row = torch.tensor([0, 8, 0, 8, 1, 9, 1, 9])
    col = (torch.arange(4).view(1, 4, 1) * 32 + step.view(1, 1, 8) * 16 + 2 * t.view(32, 1, 1)
           + row.view(1, 1, 8))  # [lane, j, p]: the column of K in the chunk
    dense = torch.zeros(n8, 8, chunks, CHUNK_K, dtype=torch.int64)
    gi = g.view(32, 1, 1).expand(32, 4, 8)
    for c in range(chunks):
        dense[:, gi, c, col] = nib[:, c]
    q = dense.view(n, k).float()
    szw = sz.to(torch.int64).cpu() & 0xFFFFFFFF
    nz, s = _from_bits(szw & 0xFFFF, dtype), _from_bits(szw >> 16, dtype)  # [G, N]: -(magic + z), s
    cols = torch.arange(k) // group
    wq = ((q + DTYPES[dtype][1] + nz.t()[:, cols]) * s.t()[:, cols]).to(dtype).float()  # [N, K]
    return x.to(dtype).float().cpu() @ wq.t()


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _cubin(nvcc: str) -> Path:
    """The kernel's cubin for this GPU, built by nvcc once into the user's cache."""
    h = hashlib.sha256(SOURCE.read_bytes() + f"{compiler_stamp(nvcc)}:{_arch()}".encode())
    path = cache_root("cuda-kernels") / f"mma_int4-{h.hexdigest()[:16]}.cubin"
    failed = build_once(path, lambda out: [nvcc, f"-arch={_arch()}", "-cubin", "-O3", "-o", str(out), str(SOURCE)], 300)
    if failed:
        raise RuntimeError(failed)
    return path


@functools.lru_cache(maxsize=None)
def _kernels() -> "dict[tuple[str, int], object] | str":
    """{(dtype name, m16 tiles): the launchable kernel}, built at first use; or why not (one line)."""
    if not torch.cuda.is_available():
        return "the int4 MMA kernel needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"the int4 MMA kernel needs bf16 tensor cores (sm_80+), not {_arch()}"
    variants = [(d, t) for d, _ in DTYPES.values() for t in TILES]
    names = [f"mma_int4_{d}_{t}" for d, t in variants]
    try:
        from torch.cuda._utils import _cuda_load_module
    except ImportError:
        return f"this torch ({torch.__version__}) cannot load CUDA modules (torch.cuda._utils)"
    why = []
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc:
        try:
            mods = _cuda_load_module(_cubin(nvcc).read_bytes(), names)
            return {v: mods[name] for v, name in zip(variants, names)}
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why.append(f"nvcc: {first_line(e)}")
    try:
        from torch.cuda._utils import _nvrtc_compile

        ptx, _ = _nvrtc_compile(SOURCE.read_text(), names[0], None, None, None)
        mods = _cuda_load_module(ptx, names)
        return {v: mods[name] for v, name in zip(variants, names)}
    except Exception as e:  # NVRTC missing or failing: the reason, for the plan's line
        why.append(f"NVRTC: {first_line(e)}")
    return "the int4 MMA kernel could not be built (" + "; ".join(why) + ")"


def available() -> str | None:
    """None where the kernel runs here, else why not."""
    k = _kernels()
    return k if isinstance(k, str) else None


@functools.lru_cache(maxsize=None)
def split_for(n: int, k: int) -> tuple[int, int]:
    """(blocks along K, chunks each): about two blocks per SM, at least one chunk each."""
    blocks, chunks = n // BLOCK_N, k // CHUNK_K
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    split = max(1, min(chunks, -(-2 * sms // blocks)))
    per = -(-chunks // split)
    return -(-chunks // per), per


@torch.library.custom_op("llamactl::mma_int4", mutates_args=())
def mma_int4(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16 or fp16 (M <= MAX_ROWS) on the GPU, qw/sz from pack for x's dtype (on the GPU)
    -> [M, N] in x's dtype."""
    kernels = _kernels()
    if isinstance(kernels, str):
        raise RuntimeError(kernels)
    m, k = x.shape
    n = qw.shape[0] * 8
    if not (0 < m <= MAX_ROWS and x.dtype in DTYPES and qw.shape[1] * CHUNK_K == k):
        raise ValueError(f"mma_int4: x {tuple(x.shape)} {x.dtype} against qw {tuple(qw.shape)}")
    x = x.contiguous()
    if x.data_ptr() % 16:  # a view that starts mid-row of its storage: the kernel loads 16 bytes at a time
        x = x.clone()
    tiles = next(t for t in TILES if m <= 16 * t)
    split, per = split_for(n, k)
    out = (torch.zeros if split > 1 else torch.empty)(m, n, dtype=torch.float32, device=x.device)
    kernels[(DTYPES[x.dtype][0], tiles)](grid=(n // BLOCK_N, split, 1), block=(128, 1, 1),
                   args=[x, qw, sz, out, m, n, k, group, per, int(split > 1)])
    return out.to(x.dtype)


@mma_int4.register_fake
def _(x, qw, sz, group):
    return x.new_empty(x.shape[0], qw.shape[0] * 8)
