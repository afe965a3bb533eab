"""llamactl: quantize, convert, compile, run and measure LLaMA checkpoints."""

__version__ = "0.1.0"
