"""Host values to the device without waiting for it.

PyTorch copies pageable host memory to a GPU and then waits for the stream to drain: a block table,
a grammar's mask or a packed forward's positions written while a step runs held the host until that
step had ended, and the GPU then idled while the host made the next one ready. From pinned memory
the copy is queued on the stream as a kernel is, in order before the kernels that read it; the
caching host allocator keeps the pinned buffer until the copy has run, and nothing writes to it
after (each call pins a copy of its own).
"""

from __future__ import annotations

import torch


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """data (a list, or a tensor on the host) as a tensor on device, in dtype where given."""
    host = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def lists_to_device(lists: list[list[int]], device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Lists of ints as tensors on device in one copy (views of one buffer there)."""
    flat = to_device([x for xs in lists for x in xs], device, dtype)
    return list(torch.split(flat, [len(xs) for xs in lists]))


def copy_in(dst: torch.Tensor, host: torch.Tensor) -> None:
    """dst.copy_(host) for a device tensor dst (a CUDA graph's static input), queued as to_device's."""
    if dst.is_cuda and host.device.type == "cpu":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.is_cuda)
