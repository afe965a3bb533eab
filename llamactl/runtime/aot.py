"""The greedy decode step compiled ahead of time (AOTInductor): one C++ call a step on the CPU.

torch.compile's step still runs Python around every call (Dynamo's cache lookup and guards,
AOTAutograd's wrapper: about 100 us of a 0.9 ms step of the embedded model, docs/bench/cpu.md).
Here the step (tokens [B, 1] at one position [1] -> the next tokens [B], argmax) is exported
once with torch.export and compiled by AOTInductor into a shared library that the runtime calls
directly. The model's parameters and buffers and the Decoder's KV cache become the library's
constants by reference (user-managed, never copied), so a prefill run by PyTorch and the compiled
steps read and write one cache.

Built at the first step (tens of seconds for a small model, minutes for 30 layers) and kept in
the user's cache (~/.cache/llamactl/aot, XDG_CACHE_HOME) under a hash of the exported program, its
tensors' shapes and dtypes, torch's version and the CPU's flags, so another process with a model of
the same structure exports again (seconds) and loads the library instead of compiling it. The
library is native code: it loads only with this user's signature (signing.signing_key) over its
checksum, as `llamactl compile` caches do.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from llamactl.folder.artifact import sha256_file
from llamactl.folder.signing import signing_key
from llamactl.kernels.cpu import cache_root, cpu_flags


class _Greedy(nn.Module):
    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache

    def forward(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # tok: [B, 1], pos: [1] -> next token [B]
        return self.model(tok, pos, self.cache)[:, -1].argmax(-1)


class AotStep:
    """Decoder's step for mode "aot": __call__(tok [B, 1], pos [1], kv_len) -> next token [B].
    cached: whether the library came from the cache (None before the first step)."""

    def __init__(self, model, kv_cache, cache: Path | None = None):
        self.step = _Greedy(model, kv_cache).eval()
        self.runner = None
        self.cache = cache or cache_dir()
        self.cached: bool | None = None

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, kv_len: int | None = None) -> torch.Tensor:
        if self.runner is None:
            self.runner = self._build(tok, pos)
        return self.runner(tok, pos)

    def _build(self, tok: torch.Tensor, pos: torch.Tensor):
        program = torch.export.export(self.step, (tok, pos), strict=False)
        # every name a tensor goes by: a tied head's weight is the embedding's, and the library asks
        # for it under both names
        state = {**dict(self.step.named_parameters(remove_duplicate=False)),
                 **dict(self.step.named_buffers(remove_duplicate=False))}
        path = self.cache / f"step-{_key(program, state)}.pt2"
        self.cached = _verified(path)
        if not self.cached:
            _compile_into(program, path)
        runner = torch._inductor.aoti_load_package(str(path))
        runner.load_constants({name: state[name] for name in runner.get_constant_fqns()}, check_full_update=True,
                              user_managed=True)  # the model's own tensors
        return runner


def cache_dir() -> Path:
    return cache_root("aot")


def _key(program, state: dict[str, torch.Tensor]) -> str:
    """What the library depends on: the program's code and signature, its tensors' layouts (not
    their values: they are loaded by reference), torch, the CPU."""
    h = hashlib.sha256()
    for part in (program.graph_module.code, str(program.graph_signature), torch.__version__, cpu_flags()):
        h.update(part.encode())
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}".encode())
    return h.hexdigest()[:24]


def _signature(path: Path) -> str:
    return hmac.new(signing_key(), sha256_file(path).encode(), hashlib.sha256).hexdigest()


def _verified(path: Path) -> bool:
    """Whether the cached library at path is there with this user's signature over its checksum."""
    sig = path.with_suffix(".json")
    if not (path.is_file() and sig.is_file()):
        return False
    try:
        return hmac.compare_digest(str(json.loads(sig.read_text()).get("signature", "")), _signature(path))
    except (OSError, ValueError):
        return False


def _compile_into(program, path: Path) -> None:
    """Compile the program's library to path (built in a temporary folder beside it, then moved
    in place, its signature last), so a reader sees a whole library or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    try:
        built = torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp / path.name),
            inductor_configs={"aot_inductor.package_constants_in_so": False})
        os.replace(built, path)
        (tmp / "sig.json").write_text(json.dumps({"signature": _signature(path)}))
        os.replace(tmp / "sig.json", path.with_suffix(".json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
