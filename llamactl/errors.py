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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that staged outputs are removed as for Ctrl-C."""


_signalled: str | None = None  # "SIGINT" or "SIGTERM" once one came to the running command


def note_signal(name: str | None) -> None:
    """Record that SIGINT or SIGTERM came (None: a new command starts)."""
    global _signalled
    _signalled = name


def signalled() -> str | None:
    return _signalled


def check_not_stopped() -> None:
    """Raise the signal's interrupt again where it came but was lost on the way: a handler's
    exception raised inside a finalizer or a library's callback is printed and dropped, and the
    command would run on to write its output and exit 0."""
    if _signalled:
        raise Terminated() if _signalled == "SIGTERM" else KeyboardInterrupt()


def first_line(e: BaseException, width: int = 160) -> str:
    """An exception as one short line: its type and its message's first line (a failed kernel
    build or graph capture, kept beside the fallback it caused)."""
    text = str(e).splitlines()[0][:width] if str(e) else ""
    return f"{type(e).__name__}: {text}"
