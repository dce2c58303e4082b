"""Target names: the host machine each implies or names, their folders, and what refuses them here."""

from __future__ import annotations

import pytest

from kiln.backends import targets
from kiln.backends.targets import Target, TargetError, bfloat16_refusal, cross_compiler, mismatch


@pytest.mark.parametrize(
    ("text", "name", "machine", "folder"),
    [
        ("cpu:znver3", "cpu:znver3", "x86_64", "cpu-znver3"),
        ("cpu:cortex-a76", "cpu:cortex-a76", "aarch64", "cpu-cortex-a76"),
        ("cpu:neoverse-v1@aarch64", "cpu:neoverse-v1", "aarch64", "cpu-neoverse-v1"),
        ("cpu@aarch64", "cpu@aarch64", "aarch64", "cpu@aarch64"),
        ("cuda:sm_87", "cuda:sm_87", "aarch64", "cuda-sm_87"),  # Orin: a Jetson, aarch64 only
        ("cuda:sm_72", "cuda:sm_72", "aarch64", "cuda-sm_72"),  # Xavier
        ("cuda:sm_87@x86_64", "cuda:sm_87@x86_64", "x86_64", "cuda-sm_87@x86_64"),
        ("cuda:sm_75", "cuda:sm_75", "x86_64", "cuda-sm_75"),
        ("cuda:sm_90@aarch64", "cuda:sm_90@aarch64", "aarch64", "cuda-sm_90@aarch64"),  # GH200
    ],
)
def test_names_machines_and_folders(text: str, name: str, machine: str, folder: str) -> None:
    target = Target.parse(text)
    assert (target.name, target.machine, target.folder) == (name, machine, folder)
    assert Target.parse(target.name) == target
    assert target.triple == f"{machine}-unknown-linux-gnu"


def test_plain_cpu_is_this_machine_and_constructed_targets_take_the_default_host() -> None:
    assert Target.parse("cpu").machine == targets.host_machine()
    assert Target("cuda", "sm_87") == Target.parse("cuda:sm_87@aarch64")


@pytest.mark.parametrize("text", ["cpu@riscv64", "cuda:sm_61", "cuda:sm_87@", "gpu:sm_90"])
def test_unknown_names_are_refused(text: str) -> None:
    with pytest.raises(TargetError):
        Target.parse(text)


def test_another_machines_host_code_does_not_run_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(targets, "host_machine", lambda: "x86_64")
    reason = mismatch(Target.parse("cpu:cortex-a76"))
    assert reason is not None
    assert "aarch64-unknown-linux-gnu" in reason and "this machine is x86_64-unknown-linux-gnu" in reason
    assert cross_compiler(Target.parse("cuda:sm_87")) == "aarch64-linux-gnu-gcc"
    assert cross_compiler(Target.parse("cuda:sm_87@x86_64")) is None
    monkeypatch.setattr(targets, "host_machine", lambda: "aarch64")
    assert mismatch(Target.parse("cpu:cortex-a78ae")) is None
    assert cross_compiler(Target.parse("cpu:znver4")) == "x86_64-linux-gnu-gcc"


@pytest.mark.parametrize(
    ("arch", "refused"), [("sm_70", True), ("sm_72", True), ("sm_75", True), ("sm_80", False)]
)
def test_bfloat16_needs_ampere(arch: str, refused: bool) -> None:
    refusal = bfloat16_refusal(Target.parse(f"cuda:{arch}"))
    assert (refusal is not None) == refused
    if refused:
        assert f"cuda:{arch} has no bfloat16" in str(refusal)
    assert bfloat16_refusal(Target.parse("cpu")) is None
