"""The command line: app.py holds the Typer app (`llamactl.cli.app:main` is the entry point) and its
error boundary; options.py the shared options; run.py (generate, serve), models.py (inspect,
quantize, calibrate, convert-heads, convert, compile) and measure.py (bench) the commands."""
