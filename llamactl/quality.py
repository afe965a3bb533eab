"""Quality of a child model against its parent on an eval text: perplexity, KL divergence, top-1 agreement."""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from llamactl.errors import InputError, CheckpointError
from llamactl.folder.describe import params_from_config
from llamactl.runtime.cores import usable
from llamactl.runtime.kv_cache import StaticCache
from llamactl.runtime.load import load_model, load_tokenizer

DEFAULT_EVAL = Path(__file__).resolve().parent / "assets" / "docs-eval.txt"


@contextlib.contextmanager
def no_progress(description: str, total: int | None):
    """The progress protocol core functions accept (ui.progress is the real one): yields advance()."""
    yield lambda n=1, description=None: None


@dataclass
class Quality:
    ppl: float
    ppl_parent: float
    kl_mean: float  # mean over tokens of KL(parent || child), nats
    kl_p99: float
    top1_agreement: float
    tokens: int
    windows: int
    window_len: int
    eval_file: str

    def to_dict(self) -> dict:
        return asdict(self)


def check_eval_file(path: str | Path | None) -> Path:
    """The eval text's path (the packaged one for None); InputError, before any work, when it is
    not a readable file."""
    path = Path(path) if path else DEFAULT_EVAL
    if path.is_dir():
        raise InputError(f"--eval {path} is a folder", "pass --eval FILE with plain text")
    if not path.is_file():
        raise InputError(f"--eval {path} does not exist", "pass --eval FILE with plain text")
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as e:
        raise InputError(f"--eval {path} cannot be read ({e.strerror})", "pass --eval FILE with plain text") from None
    return path


def eval_windows(tokenizer, path: Path | None, window: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping token windows [n, window] from the start of the eval text."""
    path = check_eval_file(path)
    text = path.read_text(errors="replace")
    if not text.strip():
        raise InputError(f"eval file {path} is empty", "pass --eval FILE with plain text")
    # ~4 chars a token; 12 leaves room. verbose=False: the text is windowed below, so transformers'
    # "longer than the maximum sequence length" warning does not apply
    ids = tokenizer(text[: max_tokens * 12], verbose=False).input_ids
    n = min(len(ids) // window, max(1, max_tokens // window))
    if n == 0:
        raise InputError(f"eval file {path} has {len(ids)} tokens, fewer than one window of {window}")
    return torch.tensor(ids[: n * window]).view(n, window)


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [1, T] -> logits [1, T, V], the window in one forward (prefill)."""
    return model(ids.to(model.device), torch.arange(ids.shape[1], device=model.device)).float()


def decode_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [1, T] -> logits [1, T, V], one position at a time as decoding computes them: batch-1
    steps, which run llamactl's GEMV kernels where layers.prepare put them (prefill does not)."""
    cache = StaticCache.for_model(model, ids.shape[0], ids.shape[1])
    ids = ids.to(model.device)
    steps = [model(ids[:, i : i + 1], torch.tensor([i], device=model.device), cache)[:, -1]
             for i in range(ids.shape[1])]
    return torch.stack(steps, dim=1).float()  # [1, T, V]


def cache_logits(fmt):
    """A child_logits for the KL a KV cache format adds (runtime.kv_format.KVFormat): the window
    prefilled through a cache in fmt, every position attending over the K/V as the cache holds
    them (its own included), which is what a decode step reads."""

    def logits(model, ids: torch.Tensor) -> torch.Tensor:
        cache = StaticCache.for_model(model, ids.shape[0], ids.shape[1], fmt=fmt)
        return model(ids.to(model.device), torch.arange(ids.shape[1], device=model.device), cache).float()

    return logits


@torch.inference_mode()
def compare(parent, child, windows: torch.Tensor, eval_file: str = "",
            progress: Callable[[int], None] | None = None, child_logits=prefill_logits) -> Quality:
    """Score child against parent on windows [n, T]; both are llamactl runtime models.
    child_logits: how the child's logits are computed (prefill, or decode_logits)."""
    nll_p = nll_c = 0.0
    kls: list[torch.Tensor] = []
    agree = count = 0
    for i in range(windows.shape[0]):
        ids = windows[i : i + 1]
        lp = F.log_softmax(_finite(prefill_logits(parent, ids), "parent")[0, :-1], dim=-1)  # [T-1, V]
        lc = F.log_softmax(_finite(child_logits(child, ids), "child")[0, :-1].to(lp.device), dim=-1)
        target = ids[0, 1:].to(lp.device)
        nll_p += -lp.gather(1, target[:, None]).sum().item()
        nll_c += -lc.gather(1, target[:, None]).sum().item()
        kls.append((lp.exp() * (lp - lc)).sum(-1).cpu())  # [T-1]
        agree += (lp.argmax(-1) == lc.argmax(-1)).sum().item()
        count += target.numel()
        if progress:
            progress(1)
    kl = torch.cat(kls)
    return Quality(
        ppl=math.exp(nll_c / count), ppl_parent=math.exp(nll_p / count), kl_mean=kl.mean().item(),
        kl_p99=kl.quantile(0.99).item() if kl.numel() < 16_000_000 else float("nan"),
        top1_agreement=agree / count, tokens=count, windows=windows.shape[0], window_len=windows.shape[1],
        eval_file=eval_file,
    )


def _finite(logits: torch.Tensor, who: str) -> torch.Tensor:
    """logits, or a CheckpointError when they hold NaN or Inf: such a model has no score."""
    if not bool(torch.isfinite(logits).all()):
        raise CheckpointError(f"the {who} model's logits hold NaN or Inf on the eval text: its weights are broken",
                              "check the folder's weights (for example with `llamactl generate`), or re-create it")
    return logits


GPU_EVAL_TOKENS = 32768  # a quality report's tokens on a GPU (seconds for an 8B model)
# On the CPU the default follows the model: what parent and child score in about CPU_EVAL_S at
# CPU_EVAL_FLOPS (float32 on 2 cores; a 135M model scored 32,768 tokens in 24 minutes on 2 busy
# cores), between 2,048 and GPU_EVAL_TOKENS
CPU_EVAL_S, CPU_EVAL_FLOPS = 120, 20e9


def default_eval_tokens(device: torch.device, params: int) -> int:
    """The tokens a quality report scores when --eval-tokens is not given."""
    if device.type != "cpu":
        return GPU_EVAL_TOKENS
    n = int(CPU_EVAL_S * CPU_EVAL_FLOPS / (4 * max(params, 1)))  # parent and child: 2 FLOPs a weight a token each
    return max(2048, min(GPU_EVAL_TOKENS, n // 512 * 512))


def expected_cpu_seconds(params: int, tokens: int) -> float:
    """A rough time for a CPU quality report: parent and child at CPU_EVAL_FLOPS on 2 cores,
    scaled by the cores this process may use."""
    return 4 * params * tokens / CPU_EVAL_FLOPS * 2 / usable()


def announce(eval_tokens: int | None, device: torch.device, art, log) -> int:
    """The tokens to score (eval_tokens, or the device's default for this model), said in the log
    with the time to expect on the CPU."""
    params = params_from_config(art.args)
    n = eval_tokens if eval_tokens is not None else default_eval_tokens(device, params)
    why = "" if eval_tokens is not None else f" (the default on the {device.type} for this model; --eval-tokens sets it)"
    expect = ""
    if device.type == "cpu" and n:
        t = expected_cpu_seconds(params, n)
        expect = f": expect about {t:.0f} s" if t < 90 else f": expect about {t / 60:.0f} minutes"
    log(f"measuring quality against the parent on {n:,} tokens{why}{expect}")
    return n


def measure(parent_art, child_art, device: torch.device, eval_file: str | None, eval_tokens: int,
            progress=no_progress, parent_model=None, child_model=None, child_logits=prefill_logits) -> Quality:
    """Score child against parent on the eval text with llamactl's runtime (float32 on the CPU,
    bf16 on a GPU). Models already loaded may be passed in; the tokenizer is the parent's."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    windows = eval_windows(load_tokenizer(parent_art), eval_file,
                           min(512, parent_art.args.max_position_embeddings), eval_tokens)
    parent_model = parent_model or load_model(parent_art, device, dtype)
    child_model = child_model or load_model(child_art, device, dtype)
    with progress("eval", windows.shape[0]) as advance:
        return compare(parent_model, child_model, windows, str(eval_file or "docs-eval.txt (packaged)"), advance,
                       child_logits)
