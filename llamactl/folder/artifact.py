"""Artifact folders: a Hugging Face model folder plus a `llamactl.json` manifest.

Opening validates what a stage needs before any work starts; writing goes through a temporary
folder beside the output that is renamed into place only when everything is written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from llamactl import __version__
from llamactl.folder.config import LlamaArgs
from llamactl.folder.headers import check_floating, check_regular_file, read_safetensors_header
from llamactl.errors import CheckpointError, InputError, OutputExistsError, check_not_stopped

MANIFEST = "llamactl.json"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "docs-llama-17m"
EMBEDDED_NAMES = ("embedded", "docs-llama-17m")  # what a user may type for the embedded model
SCHEMA_VERSION = 1
ST_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
SIDE_FILES = ("generation_config.json", "README.md")


@dataclass
class Artifact:
    """A validated model folder. Nothing in it is ever modified."""

    path: Path
    config: dict[str, Any]
    manifest: dict[str, Any] | None
    weight_files: list[Path]
    weight_format: str  # "safetensors" or "pickle"

    @property
    def args(self) -> LlamaArgs:
        return LlamaArgs.from_hf(self.config, where=str(self.path / "config.json"))

    @property
    def quantization(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    @property
    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)

    def tensor_index(self) -> dict[str, dict[str, Any]]:
        """name -> {dtype, shape, file} read from safetensors headers, without loading data."""
        index: dict[str, dict[str, Any]] = {}
        for f in self.weight_files:
            if self.weight_format != "safetensors":
                raise InputError(f"{f}: tensor headers are only readable from safetensors files")
            for name, meta in read_safetensors_header(f).items():
                if name != "__metadata__":
                    index[name] = {"dtype": meta["dtype"], "shape": meta["shape"], "file": f.name}
        return index


def user_path(path: str | Path) -> Path:
    """A path as the user typed it, ~ and ~user expanded; an unknown user is an InputError."""
    try:
        return Path(path).expanduser()
    except RuntimeError:  # "Could not determine home directory."
        raise InputError(f"{path}: no such user's home directory", "give the path in full") from None


def _read_json(path: Path, what: str) -> Any:
    """A JSON file's value; CheckpointError naming it when it is not readable UTF-8 JSON."""
    check_regular_file(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid {what} ({type(e).__name__}: {str(e)[:120]})",
                              "restore it from the original checkpoint") from None


def _weight_files(path: Path, allow_pickle: bool, floating: bool) -> tuple[list[Path], str]:
    """The folder's weight files and their format, each checked (a regular file in the folder, a
    safetensors header that tiles its data; floating: an unquantized model's, float weights)."""
    for index_name, fmt in ((ST_INDEX, "safetensors"), (PICKLE_INDEX, "pickle")):
        index = path / index_name
        if index.exists():
            wmap = _read_json(index, "JSON")
            wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
            if not isinstance(wmap, dict) or not wmap or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
                raise CheckpointError(f"{index} is not a valid weight index (no weight_map of tensor -> file names)",
                                      "restore it from the original checkpoint")
            shards = sorted(set(wmap.values()))
            odd = [s for s in shards if Path(s).name != s or s in (".", "..")]
            if odd:
                raise CheckpointError(f"{index} names shard files outside the folder: {odd[:3]}",
                                      "shards must be plain file names in the model folder")
            missing = [s for s in shards if not (path / s).exists() and not (path / s).is_symlink()]
            if missing:
                raise CheckpointError(f"{path} is missing the files: {missing} (listed in {index_name})",
                                      "copy the complete checkpoint")
            files = [path / s for s in shards]
            break
    else:
        files = sorted(path.glob("*.safetensors"))
        fmt = "safetensors"
        if not files:
            files = sorted(list(path.glob("*.bin")) + list(path.glob("*.pth")) + list(path.glob("*.pt")))
            fmt = "pickle"
    if not files:
        raise CheckpointError(
            f"{path} is missing the files: ['model.safetensors' or '{ST_INDEX}' with its shards]",
            "point at a Hugging Face checkpoint folder",
        )
    if fmt == "pickle" and not allow_pickle:
        raise CheckpointError(
            f"{path} holds pickled weights ({files[0].name}), which can run code when loaded",
            "convert them to safetensors (generate, inspect and bench also load them with --allow-pickle, "
            "through torch.load(weights_only=True))",
        )
    for f in files:
        check_regular_file(f, path)
    if fmt == "safetensors":
        for f in files:
            header = read_safetensors_header(f)
            if floating:
                check_floating(f, header)
    return files, fmt


def open_artifact(path: str | Path, allow_pickle: bool = False) -> Artifact:
    """Validate a model folder; raises CheckpointError saying exactly what is wrong."""
    path = user_path(path)
    if not path.exists():
        raise CheckpointError(f"model folder {path} does not exist",
                              "pass a folder holding a Hugging Face LLaMA checkpoint")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a model folder",
                              "pass the folder that holds config.json and the weights")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path} is missing the files: ['config.json']",
                              "point at a Hugging Face checkpoint folder")
    config = _read_json(cfg_path, "JSON")
    LlamaArgs.from_hf(config, where=str(cfg_path))  # validates model_type, types and ranges
    quant = config.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("quant_method"), str)):
        raise CheckpointError(f"{cfg_path}: quantization_config is {quant!r}; expected an object with a quant_method")
    files, fmt = _weight_files(path, allow_pickle, floating=quant is None)
    gen = path / "generation_config.json"
    if gen.exists() or gen.is_symlink():
        gcfg = _read_json(gen, "JSON")
        eos = gcfg.get("eos_token_id") if isinstance(gcfg, dict) else None
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not isinstance(gcfg, dict) or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list):
            raise CheckpointError(f"{gen}: not an object with token ids for eos_token_id (it holds {str(gcfg)[:80]})",
                                  "fix or delete generation_config.json")
    manifest = None
    if (path / MANIFEST).exists():
        manifest = _read_json(path / MANIFEST, "llamactl manifest")
        parent = manifest.get("parent") if isinstance(manifest, dict) else None
        if (not isinstance(manifest, dict) or not isinstance(manifest.get("stage"), (str, type(None)))
                or (parent is not None and not (isinstance(parent, dict) and isinstance(parent.get("path"), str)))):
            raise CheckpointError(f"{path / MANIFEST} is not a llamactl manifest (stage, parent.path)",
                                  "delete it to use the folder as a plain Hugging Face model")
    return Artifact(path=path, config=config, manifest=manifest, weight_files=files, weight_format=fmt)


def resolve_model_path(model: str | Path | None) -> Path:
    """A model argument -> its folder: None or one of EMBEDDED_NAMES (when no such folder exists
    here) is the embedded model."""
    if model is None or (str(model) in EMBEDDED_NAMES and not Path(model).exists()):
        return DEFAULT_MODEL
    return Path(model)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def lineage(art: Artifact, max_depth: int = 32) -> list[dict[str, Any]]:
    """The manifest chain from this artifact up to its root, checking each parent's manifest hash."""
    chain: list[dict[str, Any]] = []
    path, manifest = art.path, art.manifest
    while manifest is not None:
        entry = {"path": str(path), "stage": manifest.get("stage"), "params": manifest.get("params", {})}
        parent = manifest.get("parent")
        chain.append(entry)
        if not parent:
            break
        ppath = path / Path(parent["path"])  # a relative path (a hand-made manifest's): from the folder
        pman = ppath / MANIFEST
        entry["parent_path"] = str(ppath)
        if len(chain) == max_depth:
            entry["parent_status"] = f"not followed (the chain is longer than {max_depth} stages)"
            break
        if not ppath.is_dir():
            entry["parent_status"] = "missing"
            break
        if parent.get("manifest_sha256") is None:
            chain.append({"path": str(ppath), "stage": "source", "params": {}})
            break
        if not pman.is_file() or sha256_file(pman) != parent["manifest_sha256"]:
            entry["parent_status"] = "changed since this artifact was made"
            break
        entry["parent_status"] = "ok"
        path, manifest = ppath, json.loads(pman.read_text())
    return chain


def check_output(out: Path, force: bool, inputs: list[Path] = ()) -> None:
    """Refuse, before any work: an output that is an input, inside one or holding one; an existing
    output without --force; with --force, anything but a folder llamactl wrote (one with a
    llamactl.json) or an empty folder; and an output whose parent cannot be written."""
    out = Path(out)
    if _existing(out, force, inputs):
        if out.is_symlink() or not out.is_dir():
            raise OutputExistsError(f"output {out} exists and is not a folder", "--force replaces only folders: choose another -o path")
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise OutputExistsError(f"output {out} is a folder llamactl did not write (no {MANIFEST})",
                                    "--force replaces only llamactl's outputs or empty folders: choose another -o path")
    check_writable_dir(out.parent, "-o")


def _existing(out: Path, force: bool, inputs: list[Path]) -> bool:
    """What check_output and check_output_file share: refuse an output that is an input, inside
    one or holding one, and an existing output without --force; whether it exists."""
    target = out.resolve()
    for src in inputs:
        src = Path(src).resolve()
        if target == src or src in target.parents:
            raise InputError(f"output {out} is the input folder or inside it", "inputs are never modified: choose another -o")
        if target in src.parents:
            raise InputError(f"output {out} contains the input {src}", "replacing it would delete the input: choose another -o")
    if not (out.exists() or out.is_symlink()):
        return False
    if not force:
        raise OutputExistsError(f"output {out} already exists", "pass --force to replace it, or choose another -o path")
    return True


def check_writable_dir(folder: Path, option: str) -> None:
    """Raise InputError unless `folder` (made if missing) is a folder this process can write."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{option} {folder}: {probe} is not a folder", "choose an output path under a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InputError(f"{option} {folder}: {probe} is not writable", "choose an output path you can write")


def check_writable_file(path: Path, option: str) -> None:
    """Raise InputError, before any work, for a file path that cannot be written: a folder, or a
    parent that is not a writable folder."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder", f"give {option} a file name, for example {path / 'bench.json'}")
    check_writable_dir(path.parent, option)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(out: Path) -> list[Path]:
    """Remove the staging folders and locks beside `out` left by runs that died (kill -9, power
    loss): `.NAME.tmp-PID-*` and `.NAME.lock` of a process that no longer exists. Returns them."""
    out = Path(out)
    removed = []
    if not out.parent.is_dir():
        return removed
    for p in out.parent.glob(f".{out.name}.tmp-*"):
        pid = p.name[len(f".{out.name}.tmp-"):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    lock = out.parent / f".{out.name}.lock"
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        pid = None
    if lock.exists() and (pid is None or not _alive(pid)):
        lock.unlink(missing_ok=True)
        removed.append(lock)
    return removed


@contextlib.contextmanager
def _reserve(out: Path) -> Iterator[None]:
    """Hold `.NAME.lock` beside `out` (created exclusively) for the block: a second run writing the
    same output is refused at once instead of silently replacing the first one's result."""
    lock = out.parent / f".{out.name}.lock"
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        holder = lock.read_text().strip() if lock.exists() else "?"
        raise OutputExistsError(f"output {out} is being written by another llamactl run (pid {holder})",
                                "wait for it to finish, or choose another -o path") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def staged_output(out: Path, force: bool, log=lambda message: None) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; rename it into place only if the block succeeds.
    The output is reserved for the block (a concurrent writer is refused), leftovers of dead runs
    are cleaned first (and logged), and nothing half-written is ever at `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in clean_stale(out):
        log(f"removed {p}, left by a run that was killed")
    with _reserve(out):
        check_output(out, force)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the output is an ordinary folder
        try:
            yield tmp
            check_not_stopped()  # a Ctrl-C or SIGTERM whose interrupt was lost: no output
            if out.exists():
                if not force:  # another tool made it meanwhile
                    raise OutputExistsError(f"output {out} appeared while this run worked; nothing was replaced",
                                            "pass --force to replace it, or choose another -o path")
                check_output(out, force)
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-old-", dir=out.parent))
                old.rmdir()
                out.rename(old)
                tmp.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def check_output_file(out: Path, force: bool, inputs: list[Path], kind: str, is_kind: Callable[[Path], bool]) -> None:
    """check_output for a one-file output (a GGUF): --force replaces only a file of the same kind."""
    out = Path(out)
    if _existing(out, force, inputs):
        if out.is_symlink() or not out.is_file() or not is_kind(out):
            raise OutputExistsError(f"output {out} exists and is not a {kind} file",
                                    f"--force replaces only {kind} files: choose another -o path")
    check_writable_file(out, "-o")


@contextlib.contextmanager
def staged_file(out: Path, force: bool, kind: str, is_kind: Callable[[Path], bool], log=lambda message: None) -> Iterator[Path]:
    """Yield a temporary file name beside `out`; rename it into place only if the block succeeds
    (reserved and cleaned as staged_output does)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in clean_stale(out):
        log(f"removed {p}, left by a run that was killed")
    with _reserve(out):
        check_output_file(out, force, [], kind, is_kind)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent)
        os.close(fd)
        tmp = Path(name)
        try:
            yield tmp
            check_not_stopped()
            if out.exists() and not force:
                raise OutputExistsError(f"output {out} appeared while this run worked; nothing was replaced",
                                        "pass --force to replace it, or choose another -o path")
            _follow_umask(tmp)
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy tokenizer files and generation_config.json from a parent folder."""
    for name in TOKENIZER_FILES + SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def write_manifest(folder: Path, stage: str, parent: Artifact | None, params: dict[str, Any],
                   metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write llamactl.json into `folder`, hashing every weight file in it."""
    import torch

    parent_entry = None
    if parent is not None:
        pman = parent.path / MANIFEST
        parent_entry = {
            "path": str(parent.path.resolve()),
            "manifest_sha256": sha256_file(pman) if pman.is_file() else None,
        }
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt"))
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "parent": parent_entry,
        "params": params,
        "llamactl_version": __version__,
        "torch_version": torch.__version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "files": {p.name: sha256_file(p) for p in weights},
        "metrics": metrics or {},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _follow_umask(path: Path) -> None:
    """Give a written file the mode an ordinary file gets (safetensors writes them 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def save_weights(state: dict[str, Any], folder: Path, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Save a state dict as safetensors, sharded with an index when larger than max_shard_bytes."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in state.items()}
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        _follow_umask(folder / "model.safetensors")
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        _follow_umask(folder / fname)
        names.append(fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / ST_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


class ShardWriter:
    """Safetensors shards written as tensors arrive (so a conversion holds at most one shard in
    memory), named and indexed as save_weights names them when closed."""

    def __init__(self, folder: Path, max_shard_bytes: int = 2 << 30):
        self.folder, self.max = folder, max_shard_bytes
        self.pending: dict[str, Any] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary name, tensor names)
        self.total = 0

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> list[str]:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map = {}
        for (tmp, tensors), name in zip(self.files, names):
            os.replace(self.folder / tmp, self.folder / name)
            _follow_umask(self.folder / name)
            weight_map.update({t: name for t in tensors})
        if n > 1:
            (self.folder / ST_INDEX).write_text(
                json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2))
        return names


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes it private; the result is an ordinary file
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
