"""Calibration statistics for choosing bits per tensor (quantize --target-bpw) and for weighting
the rounding (llama.cpp calls the second an importance matrix).

- fisher[name]: [out, in] the diagonal of the Fisher information of each quantizable weight, per
  token: E[g^2] where g is the gradient of log p(y | context) and y is drawn from the model's own
  next-token distribution. To second order, moving weight w_ij by d_ij raises the mean per-token
  KL(parent || child) by 0.5 * sum F_ij d_ij^2, so the KL a quantization adds can be predicted
  tensor by tensor, and summed.
- act2[name]: [in] the mean square of each input column of a linear layer (its importance matrix).

One calibration pass serves many quantizations: `llamactl calibrate` writes them to a safetensors
file that `quantize --calib-stats` reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from llamactl.errors import CheckpointError, InputError
from llamactl.folder.checkpoint import load_tokenizer
from llamactl.quantize.calib import build_samples
from llamactl.quantize.options import EMBED
from llamactl.runtime.load import load_model
FORMAT = "llamactl-calib-stats/1"


@dataclass
class Stats:
    fisher: dict[str, torch.Tensor]  # tensor name (module path) -> [out, in] (the table: [vocab, hidden])
    act2: dict[str, torch.Tensor]  # linear name -> [in]
    tokens: int
    meta: dict[str, Any] = field(default_factory=dict)  # the calibration spec, the parent's shape

    def save(self, path: Path) -> None:
        """To `path` as it is (calibrate stages it beside its output: artifact.staged_file)."""
        from safetensors.torch import save_file

        tensors = {f"fisher/{k}": v.to(torch.bfloat16).contiguous() for k, v in self.fisher.items()}
        tensors |= {f"act2/{k}": v.float().contiguous() for k, v in self.act2.items()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "tokens": str(self.tokens),
                                                "meta": json.dumps(self.meta)})


def is_stats_file(path: Path) -> bool:
    """Whether path is a regular file that `calibrate` wrote (its safetensors header says so)."""
    from safetensors import safe_open

    if path.is_symlink() or not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("format") == FORMAT
    except Exception:  # not safetensors at all
        return False


def load_stats(path: str | Path, art) -> Stats:
    """A file `llamactl calibrate` wrote for a model of `art`'s shape; InputError otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--calib-stats {path} does not exist", "write one with `llamactl calibrate MODEL -o FILE`")
    try:
        with safe_open(str(path), "pt") as f:
            head = f.metadata() or {}
            if head.get("format") != FORMAT:
                raise InputError(f"--calib-stats {path} is not a llamactl calibration file",
                                 "write one with `llamactl calibrate MODEL -o FILE`")
            fisher, act2 = {}, {}
            for k in f.keys():
                kind, _, name = k.partition("/")
                (fisher if kind == "fisher" else act2)[name] = f.get_tensor(k).float()
    except SafetensorError as e:
        raise InputError(f"--calib-stats {path} cannot be read ({e})", "write it again with `llamactl calibrate`") from None
    bad = next((f"{kind}/{k}" for kind, d in (("fisher", fisher), ("act2", act2)) for k, t in d.items()
                if not bool(torch.isfinite(t).all()) or bool((t < 0).any())), None)
    if bad:  # squares and their sums: a negative or non-finite value is damage, and would steer the bit choice
        raise InputError(f"--calib-stats {path}: {bad} holds negative or non-finite values (squares cannot)",
                         "write it again with `llamactl calibrate`")
    stats = Stats(fisher, act2, int(head.get("tokens", 0)), json.loads(head.get("meta", "{}")))
    want = shape_of(art)
    if stats.meta.get("shape") != want:
        raise InputError(f"--calib-stats {path} was measured on a model of another shape ({stats.meta.get('shape')})",
                         f"calibrate this model ({want}) with `llamactl calibrate`")
    return stats


def shape_of(art) -> dict[str, int]:
    a = art.args
    return {"layers": a.num_hidden_layers, "hidden": a.hidden_size, "ffn": a.intermediate_size,
            "heads": a.num_attention_heads, "kv_heads": a.num_key_value_heads, "vocab": a.vocab_size}


def collect(art, spec, device: torch.device, progress, seed: int = 0) -> Stats:
    """Fisher diagonals and input second moments of every quantizable tensor of `art`, from the
    calibration samples of `spec` (one forward and backward a sample)."""
    samples = build_samples(spec, load_tokenizer(art))  # [n, L]
    model = load_model(art, device, torch.float32 if device.type == "cpu" else torch.bfloat16)
    targets = quantizable(model)
    for p in model.parameters():
        p.requires_grad_(False)
    for mod in targets.values():
        mod.weight.requires_grad_(True)
    fisher = {name: torch.zeros(mod.weight.shape, dtype=torch.float32, device=device) for name, mod in targets.items()}
    act2: dict[str, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(_square_sum(act2, name)) for name, mod in targets.items() if name != EMBED]
    gen = torch.Generator(device=device).manual_seed(seed)
    n, length = samples.shape
    try:
        with progress("calibration stats", n) as advance:
            for i in range(n):
                logits = model(samples[i : i + 1].to(device), torch.arange(length, device=device))[0].float()  # [L, V]
                if not torch.isfinite(logits).all():
                    raise CheckpointError(f"{art.path}: the model's logits on calibration sample {i + 1} are not finite "
                                          "(NaN or infinite weights?)", "check the checkpoint, or convert it again")
                with torch.no_grad():
                    y = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)[:, 0]  # [L] the model's own draws
                F.cross_entropy(logits, y, reduction="sum").backward()
                for name, mod in targets.items():
                    fisher[name] += mod.weight.grad.float() ** 2
                    mod.weight.grad = None
                advance(1)
    finally:
        for h in hooks:
            h.remove()
    tokens = n * length
    meta = {"calibration": spec.describe() | {"n_samples": n, "tokens": tokens}, "shape": shape_of(art),
            "parent": str(art.path), "device": str(device)}
    return Stats({k: (v / tokens).cpu() for k, v in fisher.items()}, {k: (v / tokens).cpu() for k, v in act2.items()},
                 tokens, meta)


def quantizable(model) -> dict[str, torch.nn.Module]:
    """name -> module of every tensor quantize may quantize: the decoder's linears, lm_head and
    the embedding table (one entry for a tied pair: the table, which the head reads too)."""
    out = {name: mod for name, mod in model.named_modules()
           if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}"}
    if not model.args.tie_word_embeddings:
        out["lm_head"] = model.lm_head
    out[EMBED] = model.model.embed_tokens
    return out


def _square_sum(acc: dict[str, torch.Tensor], name: str):
    def hook(module, args):
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [tokens, in]
        s = (x * x).sum(0)
        acc[name] = s if name not in acc else acc[name] + s

    return hook
