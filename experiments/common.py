"""Shared by the experiment scripts: CPU devices, model presets, result tables."""

from __future__ import annotations

import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def use_cpu_devices(count: int = 8) -> None:
    """Must run before jax is imported."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def provenance(command: str) -> str:
    """Where and how a result was produced, for the top of a results file."""
    import jax

    return (
        f"Produced by `{command}` with jax {jax.__version__} on {platform.machine()} "
        f"({jax.devices()[0].platform}, {len(jax.devices())} devices): compiled memory analysis, "
        "nothing allocated."
    )


def write_result(name: str, text: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path
