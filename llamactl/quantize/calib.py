"""Calibration sets: named specs, spec files or local text files -> token samples [n, seq_len]."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from llamactl.errors import InputError, MissingDependencyError
from llamactl.folder.artifact import user_path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # llamactl/
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def calib_dir() -> Path:
    """Specs ship inside the wheel as llamactl/calib; an editable install reads the repo's calib/."""
    packaged = PACKAGE_DIR / "calib"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "calib"


@dataclass(frozen=True)
class CalibSpec:
    name: str
    source: dict[str, Any]
    text_field: str = "text"
    n_samples: int = 64  # 64 x 512: chosen from the measured curve in docs/quantize-quality.md
    seq_len: int = 512
    seed: int = 0
    base_dir: str = field(default="", compare=False)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "text_field": self.text_field,
                "n_samples": self.n_samples, "seq_len": self.seq_len, "seed": self.seed}


def available_specs() -> list[str]:
    return sorted(p.stem for p in calib_dir().glob("*.json"))


def _spec_from_file(path: Path) -> CalibSpec:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"calibration spec {path} is not valid JSON ({e})")
    if not isinstance(raw, dict) or "source" not in raw:
        raise InputError(f"calibration spec {path} has no 'source'", "see calib/README.md for the fields")
    _check_fields(raw, path)
    keys = {"name", "source", "text_field", "n_samples", "seq_len", "seed"}
    return CalibSpec(**{k: v for k, v in raw.items() if k in keys} | {"name": raw.get("name", path.stem)},
                     base_dir=str(path.parent))


def _check_fields(raw: dict, path: Path) -> None:
    """A spec's fields of the types CalibSpec holds: InputError naming the first that is not."""
    src = raw["source"]
    checks = [(k, raw.get(k), "a string", lambda v: isinstance(v, str)) for k in ("name", "text_field")]
    checks += [(k, raw.get(k), f"an integer >= {least}", lambda v, least=least: type(v) is int and v >= least)
               for k, least in (("n_samples", 1), ("seq_len", 8), ("seed", 0))]
    checks.append(("source", src, 'an object with one of "file" or "hub"',
                   lambda v: isinstance(v, dict) and ("file" in v) != ("hub" in v)))
    if isinstance(src, dict):
        checks += [(f"source.{k}", src.get(k), "a string", lambda v: isinstance(v, str))
                   for k in ("file", "hub", "config", "split")]
    for key, value, want, ok in checks:
        if value is not None and not ok(value):
            raise InputError(f"calibration spec {path}: {key} is {json.dumps(value)[:80]}, not {want}",
                             "see calib/README.md for the fields")


def resolve_spec(spec: str, n_samples: int | None = None, seq_len: int | None = None,
                 seed: int | None = None) -> CalibSpec:
    """A spec name, a spec .json file, or a data file; raises InputError naming the choices."""
    path = user_path(spec)
    named = calib_dir() / f"{spec}.json"
    if "/" not in spec and not path.suffix and named.is_file():
        s = _spec_from_file(named)
    elif path.suffix == ".json" and path.is_file() and _looks_like_spec(path):
        s = _spec_from_file(path)
    elif path.suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise InputError(f"calibration file {path} does not exist",
                             f"pass an existing file or one of the named sets: {', '.join(available_specs())}")
        s = CalibSpec(name=path.name, source={"file": str(path.resolve())})
    else:
        raise InputError(f"--calib {spec!r} is neither a named set ({', '.join(available_specs())}) nor a "
                         f".jsonl/.json/.parquet/.txt file", "pass --calib docs for the offline default")
    overrides = {k: v for k, v in (("n_samples", n_samples), ("seq_len", seq_len), ("seed", seed)) if v is not None}
    return replace(s, **overrides)


def _looks_like_spec(path: Path) -> bool:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and "source" in raw


def check_spec(spec: CalibSpec) -> None:
    """Cheap checks before any work: a local source exists and is not empty."""
    if "file" in spec.source:
        path = _source_path(spec)
        if not path.is_file():
            raise InputError(f"calibration file {path} does not exist",
                             f"pass an existing file or one of the named sets: {', '.join(available_specs())}")
        if path.stat().st_size == 0:
            raise InputError(f"calibration file {path} is empty", "pass a file with text in it")


def _source_path(spec: CalibSpec) -> Path:
    path = user_path(spec.source["file"])
    return path if path.is_absolute() else Path(spec.base_dir) / path


def load_texts(spec: CalibSpec) -> list[str]:
    """The documents of a spec, through `datasets`; raises InputError when there are none."""
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("datasets", "dev", "loading calibration data")
    datasets.disable_progress_bars()
    src = spec.source
    if "file" in src:
        check_spec(spec)
        path = _source_path(spec)
        if path.suffix == ".txt":  # one document per blank-line separated paragraph block
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"calibration file {path} is not UTF-8 text (byte {e.start} is not)",
                                 "pass a text file: calibrating on other bytes would measure nothing real")
            blocks = [b.strip() for b in text.split("\n\n")]
            return [b for b in blocks if b]
        kind = LOCAL_SUFFIXES.get(path.suffix)
        if kind is None:
            raise InputError(f"calibration file {path}: unsupported type {path.suffix!r}", "use .jsonl, .json, .parquet or .txt")
        try:
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as e:
            raise InputError(f"calibration file {path} could not be read ({type(e).__name__}: {str(e)[:200]})")
    else:
        try:
            ds = datasets.load_dataset(src["hub"], src.get("config"), split=src.get("split", "train"),
                                       data_files=src.get("data_files"))
        except Exception as e:
            raise InputError(
                f"calibration set {spec.name!r} ({src['hub']}) could not be loaded from the hub "
                f"({type(e).__name__}: {str(e)[:160]})",
                "without a network use --calib docs (ships with llamactl) or a local file",
            )
    if spec.text_field not in ds.column_names:
        raise InputError(f"calibration set {spec.name!r} has no field {spec.text_field!r}; it has {ds.column_names}",
                         "set text_field in the spec")
    texts = [t for t in ds[spec.text_field] if isinstance(t, str) and t.strip()]
    if not texts:
        raise InputError(f"calibration set {spec.name!r} holds no text", "pass a file with text in it")
    return texts


def build_samples(spec: CalibSpec, tokenizer, progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Token samples [n, seq_len]: shuffled documents, tokenized, packed and cut to seq_len."""
    texts = load_texts(spec)
    random.Random(spec.seed).shuffle(texts)
    need = spec.n_samples * spec.seq_len
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, verbose=False).input_ids)  # cut into samples below: no length warning
        if progress:
            progress(len(stream))
        if len(stream) >= need:
            break
    n = min(spec.n_samples, len(stream) // spec.seq_len)
    if n == 0:
        raise InputError(f"calibration set {spec.name!r} has {len(stream)} tokens, fewer than one sample of "
                         f"{spec.seq_len}", "lower --seq-len or use more text")
    return torch.tensor(stream[: n * spec.seq_len]).view(n, spec.seq_len)
