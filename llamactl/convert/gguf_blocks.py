"""llama.cpp's 32-weight blocks (Q4_0, Q4_1, Q8_0) to and from GPTQ-style codes, exactly.

  Q4_0: fp16 d, 16 bytes of nibbles (byte j: weight j low, weight j + 16 high); w = d * (q - 8)
  Q4_1: fp16 d, fp16 m, the same nibbles;                                        w = d * q + m
  Q8_0: fp16 d, 32 int8;                                                          w = d * q
A GPTQ group of g columns (g a multiple of 32) with scale s and zero point z is g / 32 blocks with
d = s: Q4_0 when z = 8, Q8_0 when z = 128 (q = code - 128), Q4_1 with m = -s * z (rounded to fp16).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32


def _blocks(codes: torch.Tensor) -> np.ndarray:
    """codes: [out, in] -> uint8 [out, in / 32, 32]."""
    out, width = codes.shape
    return codes.to(torch.uint8).numpy().reshape(out, width // BLOCK, BLOCK)


def _per_block(x: torch.Tensor, group_size: int) -> np.ndarray:
    """Per-group values [groups, out] -> fp16 bytes per block [out, in / 32, 2]."""
    rep = group_size // BLOCK
    v = x.t().to(torch.float16).repeat_interleave(rep, dim=1).contiguous()  # [out, in / 32]
    return v.numpy().view(np.uint8).reshape(v.shape[0], v.shape[1], 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes [out, n, 32] in 0..15 -> [out, n, 16] bytes."""
    return q[..., :16] | (q[..., 16:] << 4)


def encode_q4_0(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> np.ndarray:
    """Symmetric 4-bit codes [out, in] (zero point 8), scales [groups, out] -> Q4_0 bytes [out, in / 32 * 18]."""
    q = _blocks(codes)
    raw = np.concatenate([_per_block(scales, group_size), _nibbles(q)], axis=-1)
    return raw.reshape(codes.shape[0], -1)


def encode_q4_1(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> np.ndarray:
    """Asymmetric 4-bit codes, zeros/scales [groups, out] -> Q4_1 bytes [out, in / 32 * 20]."""
    q = _blocks(codes)
    m = -(scales.float() * zeros.float())
    raw = np.concatenate([_per_block(scales, group_size), _per_block(m, group_size), _nibbles(q)], axis=-1)
    return raw.reshape(codes.shape[0], -1)


def encode_q8_0(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> np.ndarray:
    """Symmetric 8-bit codes [out, in] in 0..255 (zero point 128) -> Q8_0 bytes [out, in / 32 * 34]."""
    q = (codes.to(torch.int16) - 128).to(torch.int8).numpy().view(np.uint8).reshape(codes.shape[0], -1, BLOCK)
    raw = np.concatenate([_per_block(scales, group_size), q], axis=-1)
    return raw.reshape(codes.shape[0], -1)


def decode_q4_0(raw: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 bytes [out, in / 32 * 18] -> (codes [out, in] int32, scales [in / 32, out] fp16)."""
    b = raw.reshape(raw.shape[0], width // BLOCK, 18)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0])  # [out, blocks]
    qs = b[..., 2:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(raw.shape[0], width)
    return torch.from_numpy(q.astype(np.int32)), d.t().contiguous()


def decode_q8_0(raw: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes [out, in / 32 * 34] -> (codes [out, in] int32 in 0..255, scales [in / 32, out] fp16)."""
    b = raw.reshape(raw.shape[0], width // BLOCK, 34)
    d = torch.from_numpy(b[..., :2].copy().view(np.float16)[..., 0])
    q = b[..., 2:].copy().view(np.int8).reshape(raw.shape[0], width).astype(np.int32) + 128
    return torch.from_numpy(q), d.t().contiguous()
