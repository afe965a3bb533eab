"""Reading a model folder's files safely: what a file must be before it is opened (a regular file,
inside the folder), and a safetensors header checked entry by entry before any tensor is read."""

from __future__ import annotations

import json
import math
import stat
import struct
from pathlib import Path
from typing import Any

from llamactl.errors import CheckpointError


def check_regular_file(path: Path, folder: Path | None = None) -> None:
    """Raise CheckpointError unless `path` is a regular file (a folder, a FIFO, a device or a
    dangling link would hang or crash a reader); with `folder`, a link must stay inside it or point
    into a Hugging Face hub cache's blobs/."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is a link to nothing" if path.is_symlink() else f"{path} does not exist",
                              "copy the complete checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror})", "check its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        raise CheckpointError(f"{path} is {kind}, not a weight file", "copy the complete checkpoint")
    if folder is not None and path.is_symlink():
        target, root = path.resolve(), folder.resolve()
        if root not in target.parents and "blobs" not in target.parts:
            raise CheckpointError(f"{path} links outside the model folder (to {target})",
                                  "copy the weights into the folder instead of linking them")


ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked entry by entry (dtype, shape, offsets that
    tile the data exactly); raises CheckpointError naming the file and the entry at fault."""
    check_regular_file(path)
    size = path.stat().st_size

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path} is truncated or corrupt: {what}", "re-download or re-export it")

    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)", "re-download or re-export it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise bad(f"header length {n}, file {size} bytes")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad(f"its header is a {type(header).__name__}, not an object")
    spans = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in ST_DTYPES:
            raise bad(f"entry {name!r} has dtype {dtype!r}, not one of {', '.join(ST_DTYPES)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise bad(f"entry {name!r} has shape {shape!r}, not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
            raise bad(f"entry {name!r} has data_offsets {offsets!r}, not [begin, end]")
        numel = math.prod(shape)
        if offsets[1] - offsets[0] != numel * ST_DTYPES[dtype]:
            raise bad(f"entry {name!r} of shape {shape} {dtype} spans {offsets[1] - offsets[0]} bytes, "
                      f"not {numel * ST_DTYPES[dtype]}")
        spans.append(tuple(offsets))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise bad(f"its tensors do not tile the data (a gap or an overlap at byte {begin})")
        end = stop
    if 8 + n + end != size:
        raise bad(f"its header describes {8 + n + end} bytes, the file has {size}")
    return header


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def check_floating(path: Path, header: dict[str, Any]) -> None:
    """A model without quantization_config holds floating-point weights alone: an integer dtype in
    a header (a damaged entry of the right size) would load as its integers' values, silently.
    (Other entries, such as an old export's position_ids buffer, the loader ignores.)"""
    for name, meta in header.items():
        if name.endswith((".weight", ".bias")) and meta["dtype"] not in FLOAT_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} is {meta['dtype']}; an unquantized model's tensors are "
                                  "floating point (config.json has no quantization_config)",
                                  "the file's header is damaged: re-download or re-export it")
