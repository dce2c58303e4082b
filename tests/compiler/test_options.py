"""ModelOptions: every option declared once, validated before anything loads, the same for the CLI and
kiln.LLM."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln.compiler import ModelOptions, OptionsError, add_arguments
from kiln.compiler.options import compiled_options


@pytest.fixture
def unloadable_model(tmp_path: Path) -> Path:
    """A model folder whose config.json does not parse: anything that loads it fails, so a refusal that
    names the options proves nothing was loaded first."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    return folder


ONNX_KV_REFUSAL = "(--kv-cache-dtype f16, bf16, fp8) runs on tvm and reference, not onnxruntime"


def test_a_bad_combination_is_refused_by_kiln_llm_before_the_model_loads(unloadable_model: Path) -> None:
    with pytest.raises(OptionsError, match=re.escape(ONNX_KV_REFUSAL)):
        kiln.LLM(str(unloadable_model), backend="onnxruntime", kv_cache_dtype="fp8")


_REFUSED_IN_A_FRESH_PROCESS = """
import json, sys, time
started = time.perf_counter(), time.process_time()
import kiln
try:
    kiln.LLM(sys.argv[1], backend="onnxruntime", kv_cache_dtype="fp8")
except Exception as error:
    wall, cpu = time.perf_counter() - started[0], time.process_time() - started[1]
    refused = {"error": type(error).__name__, "message": str(error), "torch": "torch" in sys.modules}
    print(json.dumps({**refused, "seconds": wall, "cpu_seconds": cpu}))
"""


def test_kiln_llm_refuses_a_bad_combination_in_a_fresh_process_without_torch(unloadable_model: Path) -> None:
    """The refusal needs the options and the backend's capabilities, not torch (1.2 s to import). Timed
    in the process's CPU seconds: the wall clock of a shared machine measures its neighbours too."""
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_IN_A_FRESH_PROCESS, str(unloadable_model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    refused = json.loads(done.stdout)
    assert refused["error"] == "OptionsError" and ONNX_KV_REFUSAL in refused["message"]
    assert not refused["torch"], "torch was imported on the way to the refusal"
    assert refused["cpu_seconds"] < 1.0, f"refused after {refused['cpu_seconds']:.2f} s of CPU"


@pytest.mark.parametrize("command", ["generate", "serve", "compile"])
def test_a_bad_combination_is_refused_by_the_cli_before_the_model_loads(
    unloadable_model: Path, command: str, tmp_path: Path
) -> None:
    extra = {"generate": ["--prompt", "hi"], "serve": [], "compile": ["-o", str(tmp_path / "out")]}[command]
    args = [str(unloadable_model), "--backend", "onnxruntime", "--kv-cache-dtype", "fp8", *extra]
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli", command, *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert ONNX_KV_REFUSAL in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_values_outside_an_options_choices_are_refused_naming_the_flag() -> None:
    with pytest.raises(OptionsError, match=r"kv_cache_dtype 'fp9' \(--kv-cache-dtype\) is not one of"):
        ModelOptions("m", kv_cache_dtype="fp9")
    with pytest.raises(OptionsError, match=r"activation_bits 4 \(--activation-bits\)"):
        ModelOptions("m", activation_bits=4)
    with pytest.raises(OptionsError, match="unknown option kv_dtype"):
        ModelOptions.create("m", kv_dtype="fp8")


def test_the_fp8_alias_is_resolved_in_the_options() -> None:
    assert ModelOptions("m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(OptionsError, match="calibrated on the whole model"):
        ModelOptions("m", kv_cache_dtype="fp8", tensor_parallel_size=2)


def test_the_cli_flags_and_the_llm_keywords_are_the_options_fields() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_arguments(parser, "compile")
    args = parser.parse_args(["m", "--kv-cache-dtype", "fp8", "--activation-bits", "8", "--group-size", "64"])
    options = ModelOptions.from_args(args)
    assert options == ModelOptions.create("m", kv_cache_dtype="fp8", activation_bits=8, group_size=64)
    flags = {action.dest for action in parser._actions} - {"help", "model"}
    compile_flags = {
        f.name
        for f in dataclasses.fields(ModelOptions)
        if f.name != "model" and "compile" in f.metadata["flag"].commands
    }
    assert flags == compile_flags
    assert set(compiled_options()) == {
        "backend",
        "quantization",
        "group_size",
        "dtype",
        "kv_cache_dtype",
        "activation_bits",
        "opt_level",
        "tensor_parallel_size",
        "enable_lora",
        "lora_dtype",
    }
    assert ModelOptions.from_args(parser.parse_args(["m", "--enable-lora"])).enable_lora
    assert options.asked() == {"kv_cache_dtype": "fp8_e4m3", "activation_bits": 8, "group_size": 64}
