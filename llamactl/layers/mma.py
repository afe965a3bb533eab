"""What an int4, int8 or FP8 layer needs to multiply its decode batches on the tensor-core kernel
(kernels.mma, RuntimeOptions.mma): a second copy of its codes in the kernel's layout, made once
for the activations' dtype before any graph is captured, and the test of whether a batch takes it.
"""

from __future__ import annotations

import torch

from llamactl.kernels import mma as kmma


class MmaCodes:
    """Mixed into a low-bit layer that names its `mma_kind` (kernels.mma.KINDS) and gives
    `_mma_codes()`: (codes [N, K] in group order, zeros (None for fp8) and scales [K / group, N])."""

    mma_kind = ""
    mma: "tuple[torch.Tensor, torch.Tensor] | None" = None  # (qw, sz) in kernels.mma's layout
    mma_dtype: "torch.dtype | None" = None  # the activations' dtype they were laid out for

    def _mma_codes(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        raise NotImplementedError

    def _mma_shape(self) -> tuple[int, int, int]:
        """(N, K, group) of the codes the kernel would read."""
        raise NotImplementedError

    def use_mma(self, on: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        """2 to kernels.mma.MAX_ROWS rows of `dtype` (bf16 or fp16) on the tensor-core kernel (the
        codes laid out for it now) where it takes the layer's shape; off: the copy freed."""
        if not (on and kmma.supported(*self._mma_shape()) and dtype in kmma.DTYPES):
            self.mma = self.mma_dtype = None
            return
        if self.mma is None or self.mma_dtype != dtype:
            self.mma = kmma.pack(*self._mma_codes(), self._mma_shape()[2], dtype, self.mma_kind)
            self.mma_dtype = dtype

    def _mma_takes(self, rows: int, dtype: torch.dtype | None = None) -> bool:
        """Whether `rows` rows (of dtype, where given) run on the kernel."""
        return self.mma is not None and 1 < rows <= kmma.MAX_ROWS and dtype in (None, self.mma_dtype)

    def _mma(self, x2: torch.Tensor) -> torch.Tensor:
        return kmma.mma(x2, *self.mma, self._mma_shape()[2], self.mma_kind)
