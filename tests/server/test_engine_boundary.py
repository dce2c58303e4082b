"""The server talks to AsyncEngine only: no module under server/ imports or names LLMEngine, and every
attribute it reads off an engine is one of AsyncEngine's public ones (so no `.engine.engine` either)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kiln.server
from kiln.runtime.async_engine import AsyncEngine

SERVER_MODULES = sorted(Path(kiln.server.__file__).parent.rglob("*.py"))
ASYNC_ENGINE_SURFACE = frozenset(name for name in dir(AsyncEngine) if not name.startswith("_"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _is_engine(node: ast.expr) -> bool:
    """`engine` or `<anything>.engine`: how the server names its AsyncEngine."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def _engine_reads(tree: ast.AST) -> list[ast.Attribute]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_engine(node.value)]


@pytest.mark.parametrize("path", SERVER_MODULES, ids=lambda path: path.name)
def test_the_server_does_not_name_the_sync_engine(path: Path) -> None:
    for node in ast.walk(_parse(path)):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom):
            assert node.module != "kiln.runtime.engine", f"{where} imports kiln.runtime.engine"
            assert all(alias.name != "LLMEngine" for alias in node.names), f"{where} imports LLMEngine"
        elif isinstance(node, ast.Import):
            assert all(alias.name != "kiln.runtime.engine" for alias in node.names), where
        elif isinstance(node, ast.Name):
            assert node.id != "LLMEngine", f"{where} names LLMEngine"
        elif isinstance(node, ast.Attribute):
            assert node.attr != "LLMEngine", f"{where} names LLMEngine"


@pytest.mark.parametrize("path", SERVER_MODULES, ids=lambda path: path.name)
def test_the_server_uses_only_the_async_engines_public_surface(path: Path) -> None:
    for node in _engine_reads(_parse(path)):
        assert node.attr in ASYNC_ENGINE_SURFACE, (
            f"{path.name}:{node.lineno} reads engine.{node.attr}, which AsyncEngine does not offer "
            f"(it offers {', '.join(sorted(ASYNC_ENGINE_SURFACE))})"
        )


def test_the_check_sees_a_reach_through() -> None:
    reads = [node.attr for node in _engine_reads(ast.parse("self.engine.engine.scheduler\nengine._engine.x"))]
    assert sorted(reads) == ["_engine", "engine", "scheduler"]
    assert not set(reads) & ASYNC_ENGINE_SURFACE
