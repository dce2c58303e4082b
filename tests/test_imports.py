"""The layer rules of docs/design.md, read from the source with `ast` (nothing of kiln is imported): each
file imports only the layers its own may import, and no modules import one another in a cycle. Imports
inside functions count as much as those at the top of a file."""

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# In the repository's folder but not in the package (setup.py keeps them out of the wheel too).
NOT_PACKAGE = {"tests", "bench", "scripts", "docs", "examples", "build", "dist", "tuning_logs", "setup.py"}
EVERY_LAYER = (
    "errors",
    "support",
    "ir",
    "frontend",
    "passes",
    "backends",
    "runtime",
    "server",
    "compiler",
    "root",
)


@dataclass(frozen=True)
class Layer:
    members: tuple[str, ...]  # the package's top-level modules and folders in the layer
    may_import: tuple[str, ...]  # the other layers its modules may import


LAYERS: dict[str, Layer] = {
    "errors": Layer(members=("errors", "digests"), may_import=()),
    "support": Layer(members=("console", "version"), may_import=()),
    "ir": Layer(members=("ir",), may_import=("errors",)),
    "frontend": Layer(members=("frontend",), may_import=("ir", "errors")),
    "passes": Layer(members=("passes",), may_import=("ir", "errors")),
    "backends": Layer(members=("backends",), may_import=("ir", "passes", "errors")),
    "runtime": Layer(members=("runtime",), may_import=("ir", "backends", "errors")),
    "server": Layer(members=("server",), may_import=("runtime", "ir", "errors")),
    "compiler": Layer(
        members=("compiler",),
        may_import=("errors", "support", "ir", "frontend", "passes", "backends", "runtime"),
    ),
    "root": Layer(
        members=("__init__", "cli", "serve_command", "llm", "bundle", "weight_sync"),
        may_import=EVERY_LAYER,
    ),
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # dotted name of the kiln module it loads
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE_DIR)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kiln", *parts))


@functools.cache
def package_files() -> tuple[Path, ...]:
    files = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR)
        folders = relative.parts[:-1]
        if relative.as_posix() not in NOT_PACKAGE and not any(p in NOT_PACKAGE or "." in p for p in folders):
            files.append(path)
    return tuple(files)


def resolve(name: str, modules: set[str]) -> str:
    """The module `name` loads: itself, or the longest prefix of it that is a module."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(path: Path, modules: set[str]) -> Iterator[Import]:
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # `from kiln.x import y` loads kiln.x.y where y is a module, else kiln.x.
            names = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name == "kiln" or name.startswith("kiln."):
                yield Import(importer, resolve(name, modules), path, node.lineno)


def layer_of(module: str) -> str:
    top = module.split(".")[1] if "." in module else "__init__"
    return next((name for name, layer in LAYERS.items() if top in layer.members), f"<no layer: {top}>")


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Each file's imports of kiln modules, one per (line, module)."""
    files = package_files()
    modules = {module_name(path) for path in files}
    return tuple(dict.fromkeys(found for path in files for found in imports_of(path, modules)))


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for following in edges.get(todo.pop(), ()):
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module: those that reach each other."""
    reach = {module: reachable(edges, module) for module in edges}
    found: dict[str, list[str]] = {}
    for module in sorted(edges):
        together = sorted(other for other in reach[module] if module in reach.get(other, ()))
        if len(together) > 1:
            found.setdefault(together[0], together)
    return list(found.values())


def test_every_module_has_a_layer() -> None:
    layers = {module_name(path): layer_of(module_name(path)) for path in package_files()}
    unplaced = sorted(module for module, layer in layers.items() if layer not in LAYERS)
    assert not unplaced, f"add these to LAYERS in {Path(__file__).name}: {unplaced}"
    assert set(layers.values()) == set(LAYERS), "the scan missed a layer's files"


def test_imports_follow_the_layers() -> None:
    broken = []
    for found in all_imports():
        own, theirs = layer_of(found.importer), layer_of(found.target)
        if theirs != own and own in LAYERS and theirs not in LAYERS[own].may_import:
            broken.append(f"{found.where()}: imports {found.target} ({own} may not import {theirs})")
    assert not broken, "imports against the layer rules (docs/design.md):\n" + "\n".join(broken)


def test_no_import_cycles() -> None:
    edges: dict[str, set[str]] = {}
    for found in all_imports():
        edges.setdefault(found.importer, set()).add(found.target)
    report = []
    for cycle in cycles(edges):
        report.append("cycle between " + ", ".join(cycle) + ":")
        report += [
            f"  {found.where()}: imports {found.target}"
            for found in all_imports()
            if found.importer in cycle and found.target in cycle and found.target != found.importer
        ]
    assert not report, "\n".join(report)
