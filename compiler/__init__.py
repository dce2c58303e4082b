"""From a request to an artifact: the options as asked (options.py), the plan that decides every
`auto` and asks the backends what they build (plan.py), the compile (codegen.py), the output-folder
rule (output.py) and the compile cache (cache.py, source_digest.py).

    request ─▶ ModelOptions ─resolve─▶ Plan ─compile_model─▶ artifact folder ─load─▶ engine
"""

from kiln.compiler.cache import load_or_compile, verdicts_folder
from kiln.compiler.codegen import CompileLimits, CompileResult, compile_model, compile_stages
from kiln.compiler.options import ModelOptions, OptionsError, add_arguments
from kiln.compiler.output import OutputError, check_output
from kiln.compiler.plan import Plan, check_artifact_options, default_tuning_logs, resolve

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
