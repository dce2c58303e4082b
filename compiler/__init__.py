"""From a request to an artifact: the options as asked (options.py), the plan that decides every
`auto` and asks the backends what they build (plan.py), the compile (codegen.py), the output-folder
rule (output.py) and the compile cache (cache.py, source_digest.py).

    request ─▶ ModelOptions ─resolve─▶ Plan ─compile_model─▶ artifact folder ─load─▶ engine
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.compiler.cache import load_or_compile, verdicts_folder
    from kiln.compiler.codegen import CompileLimits, CompileResult, compile_model
    from kiln.compiler.options import ModelOptions, OptionsError, add_arguments, check_artifact_options
    from kiln.compiler.output import OutputError, check_output
    from kiln.compiler.plan import Plan, compile_stages, default_tuning_logs, resolve

_MODULE_OF = {
    "load_or_compile": "cache",
    "verdicts_folder": "cache",
    "CompileLimits": "codegen",
    "CompileResult": "codegen",
    "compile_model": "codegen",
    "compile_stages": "plan",
    "ModelOptions": "options",
    "OptionsError": "options",
    "add_arguments": "options",
    "OutputError": "output",
    "check_output": "output",
    "Plan": "plan",
    "check_artifact_options": "options",
    "default_tuning_logs": "plan",
    "resolve": "plan",
}

__all__ = [
    "CompileLimits",
    "CompileResult",
    "ModelOptions",
    "OptionsError",
    "OutputError",
    "Plan",
    "add_arguments",
    "check_artifact_options",
    "check_output",
    "compile_model",
    "compile_stages",
    "default_tuning_logs",
    "load_or_compile",
    "resolve",
    "verdicts_folder",
]


def __getattr__(name: str) -> Any:
    """Names are imported on first use: serving an artifact needs the options, not the compiler."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kiln.compiler.{module}"), name)
    globals()[name] = value
    return value
