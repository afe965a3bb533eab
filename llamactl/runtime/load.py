"""Artifact folder -> runtime model and tokenizer, without a second copy of the weights.

The model is built on the meta device, a quantized format swaps its modules in (looked up by
quant_method), then each checkpoint tensor is read (memory-mapped), cast to the target dtype and
device, and assigned in place of the meta parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llamactl.errors import CheckpointError, InputError
from llamactl.folder.artifact import DEFAULT_MODEL, EMBEDDED_NAMES, Artifact, open_artifact, resolve_model_path  # noqa: F401
from llamactl.folder.checkpoint import DTYPES, checkpoint_dtype, iter_checkpoint, load_tokenizer  # noqa: F401
from llamactl.layers.cpu import bf16_fast
from llamactl.layers.formats import for_checkpoint
from llamactl.layers.plan import linear_kernels
from llamactl.options import RuntimeOptions
from llamactl.runtime.model import LlamaModel
from llamactl.runtime.tp import ROW, group_of, local_args, plan_shard, shard_offset, slices

# Tensors some checkpoints carry that the runtime recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name}: no CUDA device is visible here", "use --device cpu or --device auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise InputError(f"--device {name!r} is not a device", "use auto, cpu, cuda or cuda:N")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, art: Artifact, kernels: bool = True) -> torch.dtype:
    """`auto`: the checkpoint's dtype on a GPU; on the CPU bfloat16 where llamactl's CPU kernels
    (`kernels`) have their AVX-512 BF16 product, and for GPTQ-format (int4/int8) checkpoints,
    whose torch kernels take bf16 (in float32 every layer dequantizes each call); else float32
    for models under 2B parameters (torch's bf16 matrix-vector product was slower than its
    float32 one at such widths: docs/bench/cpu.md)."""
    if name not in DTYPES:
        raise InputError(f"--dtype {name!r} is not supported", f"use one of {', '.join(DTYPES)}")
    if DTYPES[name] is not None:
        return DTYPES[name]
    stored = checkpoint_dtype(art)
    if device.type == "cpu":
        if (art.quantization or {}).get("quant_method") == "gptq":
            return torch.bfloat16
        if kernels:
            if bf16_fast():
                return torch.bfloat16
        a = art.args
        approx_params = a.num_hidden_layers * (4 * a.hidden_size**2 + 3 * a.hidden_size * a.intermediate_size)
        return torch.float32 if approx_params < 2e9 else torch.bfloat16
    return stored


def _skeleton(art: Artifact, args=None):
    """The runtime model on the meta device with the format's modules swapped in, its renamer and
    format; args: another shape than the folder's (a tensor-parallel rank's, tp.local_args)."""
    with torch.device("meta"):
        model = LlamaModel(args or art.args)
    fmt = None
    if art.quantization:
        fmt = for_checkpoint(art)
        fmt.swap(art, model)
    return model, (fmt.rename if fmt else (lambda name: name)), fmt


def _runtime_name(art: Artifact, rename, expected: dict[str, tuple], name: str, shape) -> str | None:
    """A checkpoint tensor's runtime name (None: dropped), or CheckpointError when the runtime has
    no such tensor or config.json implies another shape."""
    name = rename(name)
    if name is None or name.endswith(IGNORED_SUFFIXES):
        return None
    if name not in expected:
        raise CheckpointError(f"{art.path}: unexpected tensor {name!r} in the checkpoint",
                              "is this a LLaMA checkpoint with the standard module names?")
    if tuple(shape) != expected[name]:
        raise CheckpointError(f"{art.path}: tensor {name} has shape {tuple(shape)}, config.json implies {expected[name]}")
    return name


def _check_complete(art: Artifact, expected: dict[str, tuple], seen) -> None:
    missing = [k for k in expected if k not in seen and not (k == "lm_head.weight" and art.args.tie_word_embeddings)]
    if missing:
        raise CheckpointError(f"{art.path}: the checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}",
                              "the weight files do not match config.json")


def check_tensors(art: Artifact) -> None:
    """Check the folder's tensor names and shapes (from the safetensors headers, no data read)
    against what config.json implies; raises CheckpointError as loading would, but at once."""
    if art.weight_format != "safetensors":
        return
    model, rename, _ = _skeleton(art)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    seen = {_runtime_name(art, rename, expected, name, meta["shape"]) for name, meta in art.tensor_index().items()}
    _check_complete(art, expected, seen)


def load_model(art: Artifact, device: torch.device, dtype: torch.dtype,
               options: RuntimeOptions | None = None) -> "LlamaModel":
    """Build the runtime model for `art` on `device`; raises CheckpointError on missing tensors.
    options.kernels: quantized layers on llamactl's kernels where they run (else torch's)."""
    check_tensors(art)  # before reading any data
    model, rename, fmt = _skeleton(art)
    return _assemble(art, model, rename, fmt, iter_checkpoint(art), device, dtype, options)


def _assemble(art: Artifact, model, rename, fmt, tensors, device: torch.device, dtype: torch.dtype,
              options: RuntimeOptions | None) -> "LlamaModel":
    """Assign (name, tensor) pairs of the checkpoint to the skeleton `model` (named and checked as
    the runtime names them, cast, complete), tie, and put the format's fast layers in."""
    refs = dict(model.state_dict())
    expected = {k: tuple(v.shape) for k, v in refs.items()}
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        name = _runtime_name(art, rename, expected, name, t.shape)
        if name is None:
            continue
        ref = refs[name]
        # Floating tensors take the runtime dtype; packed integer tensors keep theirs.
        target = dtype if t.is_floating_point() and ref.is_floating_point() and ref.dtype == torch.float32 else ref.dtype
        state[name] = t.to(device=device, dtype=target)
    if art.args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _check_complete(art, expected, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if fmt:
        fmt.finish(art, model, dtype, linear_kernels(device, options or RuntimeOptions()))
    return model.eval()


def load_shard(art: Artifact, device: torch.device, dtype: torch.dtype, group, rank: int, world: int,
               options: RuntimeOptions | None = None, read=None) -> "LlamaModel":
    """Tensor parallelism (tp.py): rank `rank`'s model of `world` (its heads and features, the
    rest replicated), reading only its slices of the safetensors files; the row-parallel layers'
    outputs are summed over `group`. read(name, n) is called with the elements read of each
    tensor (tests count what a rank reads)."""
    from safetensors import safe_open

    if art.weight_format != "safetensors":
        raise InputError(f"{art.path}: --tp reads safetensors shards", "convert the weights to safetensors")
    bits, group_size = group_of(art)
    args = art.args
    shard = plan_shard(args, rank, world, group_size if bits else None, 32 // bits if bits else 1)
    model, rename, fmt = _skeleton(art, local_args(args, shard))

    def sliced():
        for f in art.weight_files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    view = fh.get_slice(name)
                    cut = slices(name, tuple(view.get_shape()), shard, args.head_dim, bits, group_size)
                    t = view[cut] if cut is not None else view[:]
                    if read is not None:
                        read(name, t.numel())
                    if name.endswith(".g_idx") and cut is not None and group_size and group_size > 0:
                        t = t - shard_offset(name, shard, args.head_dim) // group_size  # groups from 0 on this rank
                    if name.endswith(".bias") and name.rpartition(".")[0].endswith(ROW) and rank:
                        t = torch.zeros_like(t)  # a row-parallel bias is added once, by rank 0
                    yield name, t

    model = _assemble(art, model, rename, fmt, sliced(), device, dtype, options)
    for layer in model.model.layers:
        layer.self_attn.tp_group = layer.mlp.tp_group = group
    model.tp = shard
    return model


def load(model: str | None, device: str = "auto", dtype: str = "auto", allow_pickle: bool = False,
         options: RuntimeOptions | None = None, world=None) -> tuple[Artifact, Any, Any, torch.device]:
    """Open, validate and load an artifact: (artifact, model, tokenizer, device). world: a
    tensor-parallel group (tp.join): this rank's shard of the model."""
    art = open_artifact(resolve_model_path(model), allow_pickle=allow_pickle)
    dev = resolve_device(device)
    if world is not None:
        if dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        check_tensors(art)
        model_ = load_shard(art, dev, resolve_dtype(dtype, dev, art, (options or RuntimeOptions()).kernels), world.group, world.rank, world.size, options)
        return art, model_, load_tokenizer(art), dev
    model_ = load_model(art, dev, resolve_dtype(dtype, dev, art, (options or RuntimeOptions()).kernels), options)
    return art, model_, load_tokenizer(art), dev
