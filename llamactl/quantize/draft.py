"""Draft models for speculative decoding (runtime.speculate): a folder with the target's tokenizer,
or the target's own round-to-nearest copy (self-int4, self-int8), made at start."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from llamactl.errors import InputError
from llamactl.quantize.options import QuantOptions
from llamactl.quantize.stage import quantize
from llamactl.runtime.load import load

SELF_COPIES = ("self-int4", "self-int8")


def load_draft(draft: str, folder: Path | None, tok, target, allow_pickle: bool, options,
               log: Callable[[str], None] = lambda m: None):
    """--draft FOLDER: its model on the target's device and in its dtype, its tokenizer the target's
    (proposals are token ids); self-int4 / self-int8: the RTN copy (group 128 / per channel) of
    the target's folder, made now into a temporary folder (None: the target has no folder)."""
    device, dtype = str(target.device), str(target.dtype).replace("torch.", "")
    if draft in SELF_COPIES:
        if folder is None:
            raise InputError(f"--draft {draft} quantizes the model's folder, and random weights have none",
                             "serve a model folder, or pass --draft ngram or a draft folder")
        bits = int(draft[-1])
        with tempfile.TemporaryDirectory(prefix="llamactl-draft-") as tmp:
            log(f"--draft {draft}: quantizing a round-to-nearest copy of {folder}")
            quantize(folder, Path(tmp) / "draft", QuantOptions(method="rtn", bits=bits, group_size=128 if bits == 4 else -1),
                     eval_tokens=0, device=device, log=lambda m: None)
            return load(str(Path(tmp) / "draft"), device, dtype, allow_pickle, options)[1]
    _, model, dtok, _ = load(draft, device, dtype, allow_pickle, options)
    if dtok.get_vocab() != tok.get_vocab():
        raise InputError(f"--draft {draft}: its tokenizer is not the model's (proposals are token ids)",
                         "draft with a model of the same family and tokenizer, or --draft ngram")
    if model.args.vocab_size > target.args.vocab_size:  # (a padded head could propose ids the model has no row for)
        raise InputError(f"--draft {draft}: its vocabulary has {model.args.vocab_size} rows, the model's "
                         f"{target.args.vocab_size}", "draft with a model whose vocabulary is no larger than the model's")
    return model
