"""The one user-facing error type. Every layer raises a subclass; the CLI prints it on one line."""


class KilnError(Exception):
    """An error a user can act on: `str()` says what was wrong, `hint` says what to do."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def one_line(self) -> str:
        text = str(self).replace("\n", " ")
        return f"{text} ({self.hint})" if self.hint else text


class UsageError(KilnError):
    """A request for something impossible (options that contradict each other or what a backend
    builds, an output that would destroy files): the CLI exits with code 2."""


class OptionsError(UsageError):
    """Options that contradict each other, the backend, or the artifact they were given with."""


class ModelLoadError(KilnError):
    """A model source is missing, corrupt, or of an unsupported kind."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one Kiln defines."""
