"""TVMScript's macro expansion without its stack inspection cost.

Each `T.macro` call inside a kernel finds the parser by walking the caller frames for the global the
parser sets (`ScriptMacro._find_parser_def`). TVM 0.27 walks them with `inspect.getouterframes`, which
reads every frame's source line and looks its module up among all loaded modules: with torch and
transformers loaded that was 35 of a tiny int8 model's 55-second compile (250 macro calls, about 85
frames each). The same walk over `f_back`, without source lines, finds the same frame."""

from __future__ import annotations

import inspect
from typing import Any

from tvm.script.parser.core.parser import ScriptMacro


def _find_parser_def(self: ScriptMacro) -> Any:
    frame = inspect.currentframe()
    while frame is not None:
        parser = frame.f_globals.get(ScriptMacro.parser_object_name)
        if parser is not None:
            return parser
        frame = frame.f_back
    raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")


def install() -> None:
    """Replace TVM's lookup (where this TVM has it: a version without it keeps its own)."""
    if callable(getattr(ScriptMacro, "_find_parser_def", None)):
        ScriptMacro._find_parser_def = _find_parser_def  # type: ignore[method-assign]
