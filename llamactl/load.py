"""Artifact folder -> runtime model and tokenizer, without a second copy of the weights.

The model is built on the meta device, then each checkpoint tensor is read (memory-mapped),
cast to the target dtype and device, and assigned in place of the meta parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from llamactl.artifact import Artifact, open_artifact
from llamactl.errors import CheckpointError, InputError

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = PACKAGE_DIR / "assets" / "docs-llama-17m"
DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# Tensors some checkpoints carry that the runtime recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Quantized formats register a hook here: (artifact, model) -> None, swapping modules before loading.
QuantHook = Callable[[Artifact, torch.nn.Module], None]
QUANT_HOOKS: dict[str, QuantHook] = {}


def _register_quant_hooks() -> None:
    from llamactl.quantize.runtime import bnb_hook, gptq_hook

    QUANT_HOOKS.setdefault("gptq", gptq_hook)
    QUANT_HOOKS.setdefault("bitsandbytes", bnb_hook)


def resolve_model_path(model: str | None) -> Path:
    return DEFAULT_MODEL if model is None else Path(model)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"--device {name}: no CUDA device is visible here", "use --device cpu or --device auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise InputError(f"--device {name!r} is not a device", "use auto, cpu, cuda or cuda:N")
    return torch.device(name)


def checkpoint_dtype(art: Artifact) -> torch.dtype:
    name = art.config.get("dtype") or art.config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def resolve_dtype(name: str, device: torch.device, art: Artifact) -> torch.dtype:
    """`auto`: the checkpoint's dtype on a GPU; float32 on the CPU for models under 2B parameters."""
    if name not in DTYPES:
        raise InputError(f"--dtype {name!r} is not supported", f"use one of {', '.join(DTYPES)}")
    if DTYPES[name] is not None:
        return DTYPES[name]
    stored = checkpoint_dtype(art)
    if device.type == "cpu":
        a = art.args
        approx_params = a.num_hidden_layers * (4 * a.hidden_size**2 + 3 * a.hidden_size * a.intermediate_size)
        return torch.float32 if approx_params < 2e9 else torch.bfloat16
    return stored


def iter_checkpoint(art: Artifact) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file, memory-mapped where the format allows."""
    if art.weight_format == "safetensors":
        from safetensors import safe_open

        for f in art.weight_files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)
    else:
        for f in art.weight_files:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # a pickle that weights_only refuses, or a corrupt file
                raise CheckpointError(f"{f} could not be loaded safely ({type(e).__name__}: {e})")
            yield from sd.items()


def load_model(art: Artifact, device: torch.device, dtype: torch.dtype) -> "LlamaModel":
    """Build the runtime model for `art` on `device`; raises CheckpointError on missing tensors."""
    from llamactl.model import LlamaModel

    args = art.args
    with torch.device("meta"):
        model = LlamaModel(args)
    quant = art.quantization
    if quant:
        _register_quant_hooks()
        method = quant.get("quant_method")
        if method not in QUANT_HOOKS:
            raise CheckpointError(f"{art.path}: quantization method {method!r} is not supported by this runtime")
        QUANT_HOOKS[method](art, model)

    rename = _key_renamer(art)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for name, t in iter_checkpoint(art):
        name = rename(name)
        if name is None or name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise CheckpointError(f"{art.path}: unexpected tensor {name!r} in the checkpoint",
                                  "is this a LLaMA checkpoint with the standard module names?")
        ref = expected[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise CheckpointError(f"{art.path}: tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(ref.shape)}")
        # Floating tensors take the runtime dtype; packed integer tensors keep theirs.
        target = dtype if t.is_floating_point() and ref.is_floating_point() and ref.dtype == torch.float32 else ref.dtype
        state[name] = t.to(device=device, dtype=target)
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{art.path}: the checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}",
                              "the weight files do not match config.json")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if quant and quant.get("quant_method") == "gptq" and int(quant.get("bits", 0)) == 4 and dtype == torch.bfloat16:
        # bf16 compute: run 4-bit layers through PyTorch's int4 kernels (tinygemm) instead of dequantizing
        from llamactl.quantize.int4 import use_int4_kernels

        use_int4_kernels(model, int(quant.get("group_size", 128)))
    if quant and dtype == torch.bfloat16:
        from llamactl.quantize.int8 import use_int8_kernels

        use_int8_kernels(model)  # per-channel int8 layers (LLM.int8, 8-bit GPTQ/RTN with group -1)
    return model.eval()


def _key_renamer(art: Artifact) -> Callable[[str], str | None]:
    if (art.quantization or {}).get("quant_method") == "bitsandbytes":
        from llamactl.quantize.bnb import rename_bnb_key

        return rename_bnb_key
    return lambda name: name


def load_tokenizer(art: Artifact):
    """The folder's tokenizer through transformers' AutoTokenizer, offline."""
    from transformers import AutoTokenizer

    if not any((art.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise CheckpointError(f"{art.path} is missing the files: ['tokenizer.json' or 'tokenizer.model']",
                              "copy the tokenizer files from the original checkpoint into this folder")
    try:
        return AutoTokenizer.from_pretrained(str(art.path), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{art.path}: the tokenizer could not be loaded ({type(e).__name__}: {e})")


def load(model: str | None, device: str = "auto", dtype: str = "auto",
         allow_pickle: bool = False) -> tuple[Artifact, Any, Any, torch.device]:
    """Open, validate and load an artifact: (artifact, model, tokenizer, device)."""
    art = open_artifact(resolve_model_path(model), allow_pickle=allow_pickle)
    dev = resolve_device(device)
    model_ = load_model(art, dev, resolve_dtype(dtype, dev, art))
    return art, model_, load_tokenizer(art), dev
