"""The output-folder rule: a folder is only ever replaced when it is empty or a Kiln artifact (or
`force`), and the new artifact is written beside it and swapped in whole."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from kiln.errors import KilnError
from kiln.runtime.artifact import is_artifact


class OutputError(KilnError):
    """An output folder that compiling would have to destroy without knowing what it holds."""


def _protected(folder: Path) -> bool:
    """/, the home folder, the working directory and any folder holding one of them."""
    resolved = folder.resolve()
    return any(resolved == p or resolved in p.parents for p in (Path.cwd(), Path.home().resolve()))


def check_output(out: Path, force: bool = False) -> None:
    """Refuse an output that is not absent, an empty folder or a Kiln artifact (unless `force`)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and (is_artifact(out) or not any(out.iterdir())):
        return
    what = "a file" if not out.is_dir() else "a folder that is not a Kiln artifact"
    if force and not _protected(out):
        return
    if force:
        raise OutputError(
            f"{out}: refusing to replace it even with --force (it holds the current or home folder)"
        )
    raise OutputError(
        f"{out}: exists and is {what}; compiling would replace it",
        hint="choose another output, move it away, or pass --force to replace it",
    )


def scratch_beside(out: Path) -> Path:
    """A new empty folder next to `out`, to write the artifact into before it is swapped in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.kiln-", dir=out.parent))


def swap_in(scratch: Path, out: Path, force: bool, keep_existing: bool = False) -> None:
    """Move the finished `scratch` folder to `out`, replacing what `check_output` allows; with
    `keep_existing`, an artifact that appeared at `out` meanwhile (another process compiling the same
    cache entry) is kept and `scratch` is left for the caller to remove."""
    if keep_existing and is_artifact(out):
        return
    check_output(out, force)
    if out.exists() or out.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "replaced")
        scratch.rename(out)
        shutil.rmtree(old)
    else:
        scratch.rename(out)
