"""Errors about IR graphs."""

from kiln.errors import KilnError


class IRError(KilnError):
    """A graph breaks a rule: a node whose types do not fit its op, an undefined value, bad text."""
