"""The greedy decode step compiled ahead of time (AOTInductor): one C++ call a step on the CPU.

torch.compile's step still runs Python around every call (Dynamo's cache lookup and guards,
AOTAutograd's wrapper: about 100 us of a 0.9 ms step of the embedded model, docs/bench/cpu.md).
Here the step (tokens [B, 1] at one position [1] -> the next tokens [B], argmax) is exported
once with torch.export and compiled by AOTInductor into a shared library that the runtime calls
directly. The model's parameters and buffers, its KV cache among them, become the library's
constants by reference (user-managed, never copied), so a prefill run by PyTorch and the compiled
steps read and write one cache: the step is bound to the tensors the model holds when it is built
(a later setup_caches on the model, as another Decoder makes, leaves this one's step stale). Built
at the first step, in a temporary folder kept while the step lives; nothing is cached between
processes yet (tens of seconds for a small model).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn


class _Greedy(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # tok: [B, 1], pos: [1] -> next token [B]
        return self.model(tok, pos)[:, -1].argmax(-1)


class AotStep:
    """Decoder's step for mode "aot": __call__(tok [B, 1], pos [1], kv_len) -> next token [B]."""

    def __init__(self, model):
        self.step = _Greedy(model).eval()
        self.runner = None
        self._dir: tempfile.TemporaryDirectory | None = None

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        if self.runner is None:
            self.runner = self._build(tok, pos)
        return self.runner(tok, pos)

    def _build(self, tok: torch.Tensor, pos: torch.Tensor):
        program = torch.export.export(self.step, (tok, pos), strict=False)
        self._dir = tempfile.TemporaryDirectory(prefix="llamactl-aot-")
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(Path(self._dir.name) / "step.pt2"),
            inductor_configs={"aot_inductor.package_constants_in_so": False})  # the model's own tensors, below
        runner = torch._inductor.aoti_load_package(path)
        state = {**dict(self.step.named_parameters()), **dict(self.step.named_buffers())}
        runner.load_constants({name: state[name] for name in runner.get_constant_fqns()}, check_full_update=True,
                              user_managed=True)
        return runner
