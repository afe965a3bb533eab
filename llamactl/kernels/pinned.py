"""Tuned launch configs of the GEMV kernels, per GPU, read from data files.

Triton's autotuner times each candidate alone and its pick for a shape changes from run to run;
inside the decode step's CUDA graph the picks differ by more than their lone timings say. So a
shape listed in `configs/<GPU name>.json` runs the config of the fastest measured decode run,
untimed; every other shape is tuned. `llamactl bench --tune FILE` writes such a file from the
autotuner's picks of a run (with the commit and the bench command); `--pins-file FILE` (or
LLAMACTL_PINS_FILE) runs a file's pins over the packaged ones.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from llamactl.errors import InputError
from llamactl.kernels import device as dev
from llamactl.kernels.arith import QUANT_INPUTS

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# the fields of a pin's key, in order: `third` is HAS_SCALE (int8 weights) for "gemv", G for "int4"
KEY_FIELDS = {
    "gemv": ("N", "K", "HAS_SCALE", "NORM", "GLU", "RESIDUAL", "GLU_OUT", "PDL", "inputs", "dtype"),
    "int4": ("N", "K", "G", "NORM", "GLU", "RESIDUAL", "GLU_OUT", "PDL", "inputs", "dtype"),
}


@dataclass(frozen=True)
class Pins:
    """The pins a model's layers launch with: `id` names a registered table ("" for none, the
    autotuner then tunes every shape); `source` says where they came from, for reports."""

    id: str = ""
    source: str | None = None
    count: int = 0


NONE = Pins()
_TABLES: dict[str, dict[tuple[str, tuple], dict]] = {}


def file_for(gpu: str) -> Path:
    """The packaged pins file of a GPU model (its name with spaces as underscores)."""
    return CONFIG_DIR / f"{gpu.replace(' ', '_').replace('/', '_')}.json"


def resolve(device: torch.device, on: bool = True, extra: str | None = None) -> Pins:
    """The pins for `device`'s GPU: the packaged file's rows with `extra`'s (a pins file) over
    them; NONE off CUDA or when `on` is False. Raises InputError for an unreadable extra file."""
    if device.type != "cuda" or not on:
        return NONE
    packaged = file_for(dev.name(dev.index(device)))
    rows = read(packaged) if packaged.is_file() else []
    if extra:
        rows = rows + read(Path(extra))
    if not rows:
        return NONE
    table = {(r["kernel"], tuple(r["key"][f] for f in KEY_FIELDS[r["kernel"]])): r["config"] for r in rows}
    pins_id = hashlib.sha256(json.dumps(sorted(map(repr, table.items()))).encode()).hexdigest()[:12]
    _TABLES[pins_id] = table
    names = ([f"kernels/configs/{packaged.name}"] if packaged.is_file() else []) + ([Path(extra).name] if extra else [])
    return Pins(pins_id, " + ".join(names), len(table))


def lookup(pins_id: str, kernel: str, key: tuple) -> dict | None:
    """The config pinned for a launch (key: KEY_FIELDS[kernel]'s values), or None."""
    return _TABLES.get(pins_id, {}).get((kernel, key)) if pins_id else None


def pick(pins_id: str, kernel: str, key: tuple, configs: list):
    """The autotuner candidate (a triton.Config of `configs`) pinned for this launch, or None
    (no pin, or a pin that is no longer among the candidates)."""
    want = lookup(pins_id, kernel, key)
    if want is None:
        return None
    for c in configs:
        have = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        if all(have.get(k) == v for k, v in want.items()):
            return c
    return None


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime: float) -> tuple:
    try:
        doc = json.loads(Path(path).read_text())
        rows = doc["pins"] if isinstance(doc, dict) else [_legacy_row(r) for r in doc]
        for r in rows:
            fields = KEY_FIELDS[r["kernel"]]  # KeyError: an unknown kernel
            if set(r["key"]) != set(fields) or r["key"]["inputs"] not in QUANT_INPUTS or not isinstance(r["config"], dict):
                raise ValueError(f"row {r}: a key of {', '.join(fields)} and a config")
        return tuple(rows)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise InputError(f"pins file {path}: not a readable pins file ({type(e).__name__}: {e})",
                         "write one with `llamactl bench --tune FILE`, or fix the file") from e


def read(path: Path) -> list[dict]:
    """The rows of a pins file: {"kernel", "key": {field: value}, "config": {...}, "from"?}. Files
    of the older form ([[kernel, key list, config], ...]) are read too."""
    mtime = path.stat().st_mtime if path.exists() else 0.0
    return list(_read(str(path), mtime))


def _legacy_row(row) -> dict:
    kernel, key, config = row
    if kernel not in KEY_FIELDS or len(key) != 10:
        raise ValueError(f"row {row}: kernel gemv or int4, a key of 10 values, a config")
    key = list(key)
    key[8] = {False: "float", True: "int8"}.get(key[8], key[8])  # files before the inputs were named
    return {"kernel": kernel, "key": dict(zip(KEY_FIELDS[kernel], key)), "config": config}


def write(path: Path, gpu: str, rows: list[dict], commit: str | None, bench: str) -> None:
    """A pins file for `gpu`, one row a line, with the commit and bench command they came from."""
    head = {"gpu": gpu, "commit": commit, "bench": bench}
    text = "{\n" + "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items())
    text += ' "pins": [\n' + ",\n".join("  " + json.dumps(r) for r in rows) + "\n ]\n}\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file
