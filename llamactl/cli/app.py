"""The Typer app: the one error boundary, the global options, and the commands in the order help
lists them (each command parses its options, calls one core function and hands the result to ui)."""

from __future__ import annotations

import errno
import traceback
from typing import Annotated

import typer
from typer.core import TyperGroup

from llamactl import __version__, ui
from llamactl.cli import measure, models, run
from llamactl import errors
from llamactl.errors import LlamactlError, Terminated
from llamactl.options import debug
from llamactl.runtime.cores import limit_threads_env


GLOBAL_FLAGS = ("-q", "--quiet")
# a full, read-only or forbidden disk: the machine's state, not a bug; one line, exit 1
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


class ErrorBoundary(TyperGroup):
    """The one error boundary: known errors become one line and exit 1; usage errors exit 2.
    Global flags (--quiet) work after the command name too."""

    def parse_args(self, ctx, args):
        cut = args.index("--") if "--" in args else len(args)
        flags = [a for a in args[:cut] if a in GLOBAL_FLAGS]
        rest = [a for a in args[:cut] if a not in GLOBAL_FLAGS] + args[cut:]
        return super().parse_args(ctx, flags + rest)

    def invoke(self, ctx):
        import signal
        import threading

        errors.note_signal(None)
        if threading.current_thread() is threading.main_thread():  # Ctrl-C: a KeyboardInterrupt from here on
            signal.signal(signal.SIGINT, _on_sigint)
        try:
            result = super().invoke(ctx)
            errors.check_not_stopped()  # a signal whose interrupt was dropped on the way still stops
            return result
        except KeyboardInterrupt as e:
            _stopped(e)
        except Exception as e:
            if errors.signalled():  # a library turned the Ctrl-C into an error of its own (transformers' imports)
                _stopped(Terminated() if errors.signalled() == "SIGTERM" else KeyboardInterrupt())
            if isinstance(e, LlamactlError):
                if debug():
                    traceback.print_exc()
                ui.error(e.message, e.hint)
                raise typer.Exit(1)
            said = _environment(e)
            if said is None:
                raise  # anything else is a bug: keep its traceback
            ui.error(*said)
            raise typer.Exit(1)


def _on_sigint(signum, frame):
    errors.note_signal("SIGINT")
    raise KeyboardInterrupt


def _stopped(e: BaseException):
    """Ctrl-C or SIGTERM: one line (where a command saved what it had finished, where), exit 130 or 143."""
    terminated = isinstance(e, Terminated)
    written = getattr(e, "written", None)
    ui.error(f"{'terminated' if terminated else 'interrupted'}; "
             + (f"what was finished is in {written}" if written else "nothing was written"))
    raise typer.Exit(143 if terminated else 130)


def _environment(e: Exception) -> tuple[str, str] | None:
    """(line, hint) where e is the machine's state (a full, read-only or forbidden disk), not a
    bug: an OSError of such an errno, or a library's wrapping of one (safetensors' Rust writer
    says "os error 28"; numpy's tofile a short write, "N requested and M written")."""
    if isinstance(e, OSError) and e.errno in _ENVIRONMENT_ERRNOS:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        return (f"{e.strerror}: {e.filename or 'writing the output'}",
                "free some space or choose another -o path" if full else "choose a path you can write")
    text = str(e)
    codes = {f"os error {n}" for n in (errno.ENOSPC, errno.EDQUOT)}
    if any(c in text for c in codes) or (isinstance(e, OSError) and e.errno is None and " requested and " in text
                                         and text.endswith(" written")):
        return "no space left on the device while writing the output", "free some space or choose another -o path"
    return None


def _on_sigterm(signum, frame):
    errors.note_signal("SIGTERM")
    raise Terminated()


app = typer.Typer(
    cls=ErrorBoundary,
    name="llamactl",
    help="Quantize, convert, compile, run and measure LLaMA checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain usage errors and help: one line a problem, readable when piped
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"llamactl {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or timing on stderr.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")] = False,
):
    ui.set_quiet(quiet)


for command, name in [(run.generate, None), (run.serve, None), (models.inspect, None), (models.quantize, None),
                      (models.calibrate, None), (models.convert_heads, "convert-heads"), (models.convert, None),
                      (models.compile_cmd, "compile"), (measure.bench, None)]:
    app.command(name)(command)


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, _on_sigterm)
    limit_threads_env()  # the cores this process may use, not the machine's; torch is not imported here
    app(prog_name="llamactl")
