"""The convert stage: sniff what SRC is (a Meta checkpoint, a GGUF file, a Hugging Face folder),
convert it, check the result loads, and record the source's hash like every other stage."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from llamactl.folder.artifact import (ShardWriter, check_output, check_output_file, open_artifact, sha256_file, staged_file,
                               staged_output, write_manifest)
from llamactl.convert.gguf_read import is_gguf, convert_gguf
from llamactl.convert.gguf_write import TYPES, write_gguf
from llamactl.convert.meta import is_meta_checkpoint, shard_files, convert_meta
from llamactl.convert.tokenizer import convert_meta_tokenizer, copy_hf_tokenizer
from llamactl.errors import CheckpointError, InputError, MissingDependencyError
from llamactl.folder.checkpoint import load_tensor_pickle
from llamactl.quality import measure, no_progress
from llamactl.runtime.load import check_tensors, resolve_model_path

DTYPES = {"auto": None, "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@dataclass(frozen=True)
class ConvertOptions:
    to: str = "auto"  # hf or gguf; auto: gguf when -o ends in .gguf
    type: str = "auto"  # GGUF tensor type (gguf_write.TYPES)
    dtype: str = "auto"  # 16-bit dtype of an HF output: the source's (bf16 for GGUF and Meta's bf16 releases)
    tokenizer: str | None = None  # an HF folder whose tokenizer a Meta checkpoint takes
    context: int | None = None  # max_position_embeddings of a Meta checkpoint that does not say it
    keep_quantized: bool = True  # GGUF Q4_0/Q8_0 linears stay quantized in the HF folder
    allow_pickle: bool = False  # Meta's consolidated.NN.pth are pickles
    eval_tokens: int = 4096  # tokens of the KL check of a requantized GGUF export; 0 skips it


def source_kind(src: Path) -> str:
    if is_gguf(src):
        return "gguf"
    if is_meta_checkpoint(src):
        return "meta"
    if src.is_dir() and (src / "config.json").is_file():
        return "hf"
    if src.is_file() and src.suffix == ".gguf":
        raise CheckpointError(f"{src} does not start with GGUF's magic bytes", "the file is damaged or not GGUF; download it again")
    raise CheckpointError(f"{src} is not a Meta checkpoint, a GGUF file or a Hugging Face folder",
                          "point at a folder with params.json and consolidated.00.pth, a .gguf file, or a folder with config.json")


def _target(kind: str, out: Path, opts: ConvertOptions) -> str:
    to = opts.to if opts.to != "auto" else ("gguf" if out.suffix == ".gguf" else "hf")
    if to not in ("hf", "gguf"):
        raise InputError(f"--to {opts.to!r} is not known", "use hf or gguf")
    if kind == "hf" and to == "hf":
        raise InputError(f"{out}: the source is already a Hugging Face folder", "write GGUF with -o FILE.gguf or --to gguf")
    if kind != "hf" and to == "gguf":
        raise InputError(f"a {kind} source converts to a Hugging Face folder first",
                         f"run `llamactl convert SRC -o FOLDER`, then `llamactl convert FOLDER -o {out}`")
    if opts.dtype not in DTYPES:
        raise InputError(f"--dtype {opts.dtype!r} is not known", f"use one of {', '.join(DTYPES)}")
    return to


def _source_hashes(src: Path, kind: str) -> dict[str, str]:
    if kind == "gguf":
        return {src.name: sha256_file(src)}
    if kind == "meta":
        files = [src / "params.json", *shard_files(src)] + [src / "tokenizer.model"] * (src / "tokenizer.model").is_file()
        return {f.name: sha256_file(f) for f in files}
    return {"llamactl.json" if (src / "llamactl.json").is_file() else "config.json":
            sha256_file(src / ("llamactl.json" if (src / "llamactl.json").is_file() else "config.json"))}


def convert(src: str | Path, out: str | Path, opts: ConvertOptions, *, force: bool = False,
            log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Convert `src` into `out`; returns the manifest (an HF output) or the GGUF's facts."""
    src, out = Path(resolve_model_path(str(src)) if str(src) == "embedded" else src), Path(out)
    if not src.exists():
        raise InputError(f"{src} does not exist", "give a Meta checkpoint folder, a .gguf file or a Hugging Face folder")
    kind = source_kind(src)
    to = _target(kind, out, opts)
    if "gguf" in (kind, to):
        from importlib.util import find_spec

        if find_spec("gguf") is None:
            raise MissingDependencyError("gguf", "convert", "reading or writing GGUF")
    if kind == "hf":
        return _to_gguf(src, out, opts, force, log)
    check_output(out, force, [src])
    if kind == "meta":
        _check_meta_inputs(src, opts)
    hashes = _source_hashes(src, kind)
    dtype = DTYPES[opts.dtype]
    with staged_output(out, force, log) as tmp:
        writer = ShardWriter(tmp)
        if kind == "meta":
            config, facts = _meta(src, tmp, writer, dtype, opts, log)
        else:
            config, facts = convert_gguf(src, tmp, writer, dtype, opts.keep_quantized, log)
        writer.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        check_tensors(open_artifact(tmp))  # every tensor the config implies, with its shape
        params = {"source": {"kind": kind, "path": str(src.resolve()), "sha256": hashes}, "to": to,
                  "options": {k: v for k, v in asdict(opts).items() if k not in ("to", "type", "eval_tokens")}, **facts}
        return write_manifest(tmp, "convert", None, params, {}) | {"output": str(out)}


def _check_meta_inputs(src: Path, opts: ConvertOptions) -> None:
    if not opts.allow_pickle:
        raise InputError(f"{src} holds pickled weights ({shard_files(src)[0].name}), which can run code when loaded",
                         "pass --allow-pickle to read them with torch.load(weights_only=True): plain tensors only, nothing runs")
    if opts.tokenizer is None and not (src / "tokenizer.model").is_file():
        raise InputError(f"{src} has no tokenizer.model", "pass --tokenizer DIR to take the tokenizer of a Hugging Face folder")


def _meta(src: Path, tmp: Path, writer, dtype, opts: ConvertOptions, log) -> tuple[dict, dict]:
    config, facts = convert_meta(src, writer, dtype, load_tensor_pickle, opts.context, log)
    if opts.tokenizer:
        facts["tokenizer"] = {"kind": "copied", "from": str(Path(opts.tokenizer).resolve()),
                              "files": copy_hf_tokenizer(Path(opts.tokenizer), tmp, config["vocab_size"])}
    else:
        facts["tokenizer"] = convert_meta_tokenizer(src / "tokenizer.model", tmp, config["vocab_size"],
                                                    config["max_position_embeddings"])
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return config, facts


def _to_gguf(src: Path, out: Path, opts: ConvertOptions, force: bool, log) -> dict[str, Any]:
    if opts.type not in TYPES:
        raise InputError(f"--type {opts.type!r} is not known", f"use one of {', '.join(TYPES)}")
    art = open_artifact(src)
    check_output_file(out, force, [src], "GGUF", is_gguf)
    source = {"kind": "hf", "path": str(src.resolve()), "sha256": _source_hashes(src, "hf")}
    with staged_file(out, force, "GGUF", is_gguf, log) as tmp:
        facts = write_gguf(art, tmp, opts.type, log, {"llamactl.source": json.dumps(source)})
        if facts["requantized_layers"] and opts.eval_tokens:
            facts["added_kl"] = _added_kl(art, tmp, opts.eval_tokens, log)
    return {"output": str(out), "stage": "convert", "params": {"source": source, "to": "gguf", "type": opts.type},
            "metrics": facts}


def _added_kl(art, gguf_file: Path, eval_tokens: int, log) -> dict[str, Any]:
    """KL of the GGUF's model (read back, dequantized) from the source's, on the eval text."""
    import tempfile

    log(f"measuring the KL the requantized layers add ({eval_tokens} eval tokens)")
    with tempfile.TemporaryDirectory(prefix=".llamactl-gguf-check-", dir=gguf_file.parent) as d:
        folder = Path(d)
        writer = ShardWriter(folder)
        config, _ = convert_gguf(gguf_file, folder, writer, torch.float32, False, lambda m: None)
        writer.close()
        (folder / "config.json").write_text(json.dumps(config) + "\n")
        q = measure(art, open_artifact(folder), torch.device("cpu"), None, eval_tokens, no_progress)
    return {"kl_mean": q.kl_mean, "top1_agreement": q.top1_agreement, "tokens": q.tokens}
