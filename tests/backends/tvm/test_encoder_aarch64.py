"""An image encoder (LLaVA-1.5's CLIP tower and projector, tiny and random) compiled by TVM for
`cpu:cortex-a76` on this x86-64 machine: an aarch64 library that runs under qemu-aarch64 and gives the
interpreter's rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.backends.targets import Target
from kiln.backends.tvm.backend import elf_machine
from kiln.backends.tvm.encoder import DESCRIPTION, LIBRARY, ROW_BLOCK, compile_encoder
from kiln.backends.tvm.layouts import apply_layout
from kiln.frontend.models.clip_vision import (
    encoder_inputs,
)
from kiln.ir.interpreter import interpret

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_the_cortex_a76_encoder_under_qemu_matches_the_interpreter(
    tmp_path: Path, run_aarch64, tiny_llava, llava_encoder
) -> None:
    tiny_llava(tmp_path / "hf")
    config, program = llava_encoder(tmp_path / "hf")
    graph, weights = program.graph, program.weights

    compile_encoder(graph, Target.parse("cpu:cortex-a76"), tmp_path / "a76")
    assert elf_machine(tmp_path / "a76" / LIBRARY) == "aarch64"
    description = json.loads((tmp_path / "a76" / DESCRIPTION).read_text())
    pixels = torch.randn(3, 28, 28, generator=torch.Generator().manual_seed(4)).numpy()
    inputs = encoder_inputs(pixels, config.patch_size, row_block=ROW_BLOCK)
    (expected,) = interpret(graph, weights, inputs)
    rows = inputs["patches"].shape[0]
    args = [
        inputs[name].reshape(rows // ROW_BLOCK, ROW_BLOCK, *inputs[name].shape[1:])
        if name in description["padded"]
        else inputs[name]
        for name in description["inputs"]
    ]
    args.append(np.array([rows, rows], dtype=np.int64))
    args += [apply_layout(p["transform"], weights[p["source"]]).numpy() for p in description["params"]]
    np.savez(tmp_path / "inputs.npz", **{f"arg_{i}": np.ascontiguousarray(a) for i, a in enumerate(args)})
    job = {
        "library": str(tmp_path / "a76" / LIBRARY),
        "function": description["function"],
        "vm": True,
        "inputs": str(tmp_path / "inputs.npz"),
        "output": str(tmp_path / "rows.npy"),
    }
    run_aarch64([job], "cortex-a76")
    ours = np.load(tmp_path / "rows.npy")
    assert ours.shape == tuple(expected.shape)
    assert np.allclose(ours, expected.numpy(), atol=1e-4, rtol=0), float(
        np.abs(ours - expected.numpy()).max()
    )
