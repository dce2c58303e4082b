"""Kiln's version, in a module of its own so that the modules recording it need not import the package
root (whose `LLM` imports them)."""

__version__ = "0.1.0"
