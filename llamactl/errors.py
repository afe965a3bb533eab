"""Errors a user can act on. The CLI's one error boundary turns them into one line and exit 1."""

from __future__ import annotations


class LlamactlError(Exception):
    """A known failure: `message` says what and where, `hint` what to do next."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class CheckpointError(LlamactlError):
    """A model folder is missing, incomplete, corrupt or not a LLaMA."""


class OutputExistsError(LlamactlError):
    """An output folder exists and --force was not given."""


class InputError(LlamactlError):
    """A prompt, option combination or data file cannot be used."""


class MissingDependencyError(LlamactlError):
    """An optional library is not installed."""

    def __init__(self, package: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the '{package}' package, which is not installed",
            f"install it with: pip install 'llamactl[{extra}]'",
        )
