"""Package discovery, the one thing pyproject.toml cannot declare for this layout.

The repository root is the `kiln` package (pyproject.toml: package-dir {"kiln" = "."}), and
setuptools' `[tool.setuptools.packages.find]` names what it finds relative to `where` with no way to
prefix it, so it would install `frontend`, `ir`, ... as top-level packages. Here every folder with an
`__init__.py` under the root becomes `kiln.<folder>`; the rest (metadata, package data) is in
pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Not part of the installed package. Folders whose names hold a dot (.venv, .venv-peers, .git,
# kiln.egg-info) and folders without an __init__.py are never entered by find_packages anyway.
NOT_PACKAGES = ("tests", "bench", "scripts", "docs", "examples", "build", "dist", "tuning_logs")


class BuildPy(build_py):
    """This file sits in the `kiln` package's folder: keep it out of the package (no `kiln.setup`)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("kiln", "setup")]


setup(
    packages=[
        "kiln",
        *(
            f"kiln.{name}"
            for name in find_packages(
                where=str(ROOT), exclude=[p for n in NOT_PACKAGES for p in (n, f"{n}.*")]
            )
        ),
    ],
    cmdclass={"build_py": BuildPy},
)
