"""Tokenizers for converted checkpoints: Meta's tokenizer.model (SentencePiece for Llama 1/2,
tiktoken for Llama 3) or the files of another Hugging Face folder, saved in transformers' form."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from llamactl.errors import CheckpointError, MissingDependencyError

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "chat_template.jinja", "chat_template.json")
TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+$")
# Meta's Llama 3 reference tokenizer: 256 special tokens after the 128,000 ordinary ones
LLAMA3_SPECIAL = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
                  + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])


def copy_hf_tokenizer(src: Path, dst: Path, vocab_size: int) -> list[str]:
    """Copy a Hugging Face folder's tokenizer files, checked: they load (transformers, offline) and
    their tokens fit the model's vocab_size embedding rows; returns their names."""
    if not src.is_dir():
        raise CheckpointError(f"--tokenizer {src} is not a folder", "point at a Hugging Face folder with tokenizer.json")
    names = [n for n in HF_TOKENIZER_FILES if (src / n).is_file()]
    if not {"tokenizer.json", "tokenizer.model"} & set(names):
        raise CheckpointError(f"--tokenizer {src} has no tokenizer.json or tokenizer.model",
                              "point at a Hugging Face folder with a tokenizer")
    for n in names:
        shutil.copyfile(src / n, dst / n)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(dst), local_files_only=True)
    except Exception as e:
        why = str(e).splitlines()[0][:200] if str(e) else ""
        raise CheckpointError(f"--tokenizer {src}: its tokenizer does not load ({type(e).__name__}: {why})",
                              "point at a folder whose tokenizer transformers loads")
    _check_fits(tok, vocab_size, f"--tokenizer {src}")
    return names


def _check_fits(tok, vocab_size: int, what: str) -> None:
    """CheckpointError where the tokenizer has more tokens than the model's embedding rows."""
    if len(tok) > vocab_size:
        raise CheckpointError(f"{what} has {len(tok)} tokens but the model's embedding has {vocab_size} rows",
                              "use the tokenizer of this release (--tokenizer DIR to take another)")


def kind_of(model_file: Path) -> str:
    """'tiktoken' (base64 token and rank per line) or 'sentencepiece' (a protobuf)."""
    with open(model_file, "rb") as fh:
        head = fh.readline().rstrip(b"\r\n")
    return "tiktoken" if TIKTOKEN_LINE.match(head) else "sentencepiece"


def convert_meta_tokenizer(model_file: Path, dst: Path, vocab_size: int, context: int) -> dict[str, Any]:
    """Save the tokenizer of tokenizer.model into dst (tokenizer.json and its config); returns
    what the manifest records. vocab_size is the model's embedding rows (checked against it)."""
    kind = kind_of(model_file)
    if kind == "tiktoken":
        tok = _tiktoken(model_file, context)
    else:
        tok = _sentencepiece(model_file, dst)
    _check_fits(tok, vocab_size, str(model_file))
    tok.save_pretrained(str(dst))
    return {"kind": kind, "tokens": len(tok)}


def _sentencepiece(model_file: Path, dst: Path):
    """The pieces and merges through transformers' SentencePiece converter, around them the
    normalizer of SentencePiece itself (a "▁" before the text, every space a "▁"), so that text
    starting with spaces encodes as sentencepiece encodes it, and <s> first."""
    from importlib.util import find_spec

    if find_spec("sentencepiece") is None:
        raise MissingDependencyError("sentencepiece", "convert", "reading a SentencePiece tokenizer.model")
    from tokenizers import decoders, normalizers, processors
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    staging = dst / ".tokenizer-src"
    staging.mkdir()
    try:
        shutil.copyfile(model_file, staging / "tokenizer.model")
        converted = LlamaTokenizer.from_pretrained(str(staging), legacy=False)
    except Exception as e:  # a corrupt protobuf
        raise CheckpointError(f"{model_file} is not a SentencePiece model ({e})", "restore tokenizer.model from the release")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    backend = converted.backend_tokenizer
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    bos, eos, unk = converted.bos_token or "<s>", converted.eos_token or "</s>", converted.unk_token or "<unk>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, backend.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=unk,
                                   model_input_names=["input_ids", "attention_mask"])


def _tiktoken(model_file: Path, context: int):
    from importlib.util import find_spec

    if find_spec("tiktoken") is None:
        raise MissingDependencyError("tiktoken", "convert", "reading a Llama 3 (tiktoken) tokenizer.model")
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        backend = TikTokenConverter(str(model_file), extra_special_tokens=LLAMA3_SPECIAL).converted()
    except Exception as e:
        raise CheckpointError(f"{model_file} is not a tiktoken file ({e})", "restore tokenizer.model from the release")
    from tokenizers import processors

    bos = LLAMA3_SPECIAL[0]
    backend.post_processor = processors.Sequence([  # Meta's reference prepends <|begin_of_text|>
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, backend.token_to_id(bos))])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|end_of_text|>",
                                   model_input_names=["input_ids", "attention_mask"], model_max_length=context)
