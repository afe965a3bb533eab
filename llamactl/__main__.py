"""`python -m llamactl` and the `llamactl` command. Until a command starts (the CLI's modules
importing, its arguments parsing: nothing is written yet), Ctrl-C ends the process at once with the
one line a later one gets; then the error boundary (cli.app.ErrorBoundary) takes it over."""

import os
import signal


def _interrupted_at_start(signum, frame) -> None:
    os.write(2, b"error: interrupted; nothing was written\n")
    os._exit(130)


def main() -> None:
    signal.signal(signal.SIGINT, _interrupted_at_start)
    from llamactl.cli.app import main as run

    run()


if __name__ == "__main__":
    main()
