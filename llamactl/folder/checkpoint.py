"""Reading a model folder's tensors, dtype and tokenizer: what the loader and the quantization
writers share (below both, so neither imports the other)."""

from __future__ import annotations

from typing import Iterator

import torch

from llamactl.folder.artifact import Artifact
from llamactl.errors import CheckpointError, first_line

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def checkpoint_dtype(art: Artifact) -> torch.dtype:
    name = art.config.get("dtype") or art.config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32) or torch.float32


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
            yield from load_tensor_pickle(f).items()


def load_tensor_pickle(f) -> dict[str, torch.Tensor]:
    """A pickled dict of tensors, memory-mapped, through torch.load(weights_only=True): nothing in
    the file runs; anything but plain tensors is refused with one line."""
    try:
        sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a pickle that weights_only refuses, or a corrupt file
        raise CheckpointError(f"{f} could not be loaded safely ({_refusal(e)})",
                              "only plain tensor files load; convert it to safetensors with the tool that made it")
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{f} is not a plain dict of tensors", "convert it to safetensors")
    return sd


def load_tokenizer(art: Artifact):
    """The folder's tokenizer through transformers' AutoTokenizer, offline."""
    from transformers import AutoTokenizer

    if not any((art.path / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        raise CheckpointError(f"{art.path} is missing the files: ['tokenizer.json' or 'tokenizer.model']",
                              "copy the tokenizer files from the original checkpoint into this folder")
    try:
        tok = AutoTokenizer.from_pretrained(str(art.path), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{art.path}: the tokenizer could not be loaded ({first_line(e, 200)})",
                              "check tokenizer.json / tokenizer_config.json, or copy them from the original checkpoint")
    vocab = art.args.vocab_size
    if len(tok) > vocab:
        raise CheckpointError(f"{art.path}: the tokenizer has {len(tok)} tokens, the model's vocab_size is {vocab}",
                              "use the tokenizer that came with this checkpoint")
    return tok


def _refusal(e: Exception) -> str:
    """Why torch refused a pickle, without torch's advice to load it unsafely."""
    import re

    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    return f"it needs {found.group(1)}, which is not a tensor" if found else type(e).__name__
