"""This user's key for the native code llamactl caches (compile caches, the AOT step): what it
loads must carry an HMAC made with it, so a cache changed by someone else is not run."""

from __future__ import annotations

import os
from pathlib import Path

from llamactl.errors import InputError

KEY_BYTES = 32


def signing_key() -> bytes:
    """This user's key for compile caches, kept outside every model folder (created on first use,
    readable by the user alone): a cache signed with it was built by this user on this machine.
    Raises InputError where the file is shorter than a key (truncated, emptied)."""
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "llamactl"
    path = base / "compile-cache.key"
    if not path.is_file():
        base.mkdir(parents=True, exist_ok=True)
        tmp = base / f".compile-cache.key.{os.getpid()}"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(KEY_BYTES))
        try:
            os.link(tmp, path)  # the first process to make one wins; others read it
        except FileExistsError:
            pass
        tmp.unlink(missing_ok=True)
    key = path.read_bytes()
    if len(key) < KEY_BYTES:  # truncated or emptied: anyone could sign with what is left
        raise InputError(f"the signing key {path} holds {len(key)} bytes, not {KEY_BYTES}: caches signed with it "
                         "cannot be trusted", f"delete {path} (a new key is made; compile caches are rebuilt)")
    return key
