"""The user's signing key for cached native code (folder.signing)."""

from __future__ import annotations

import pytest

from llamactl.errors import InputError
from llamactl.folder import signing


def test_a_key_is_made_once_and_a_truncated_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    key = signing.signing_key()
    path = tmp_path / "llamactl" / "compile-cache.key"
    assert len(key) == signing.KEY_BYTES and signing.signing_key() == key and (path.stat().st_mode & 0o777) == 0o600
    path.write_bytes(b"")  # an empty key would let anyone sign a planted cache
    with pytest.raises(InputError, match="holds 0 bytes, not 32"):
        signing.signing_key()
    path.write_bytes(key[:5])
    with pytest.raises(InputError, match="holds 5 bytes"):
        signing.signing_key()
    path.unlink()
    assert len(signing.signing_key()) == signing.KEY_BYTES  # deleted: a new one
