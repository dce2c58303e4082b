"""Kiln: compile an LLM ahead of time into an artifact per target, serve it from a small runtime."""

__version__ = "0.1.0"
