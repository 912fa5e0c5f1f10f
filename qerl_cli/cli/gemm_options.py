"""``qerl bench kernels``' flags of its GEMM section (:mod:`qerl_cli.bench.gemm`): which model shapes,
token counts and backends it times, and whether it first sweeps qerl's kernel's tile configs."""

from __future__ import annotations

from typing import Annotated

import typer

from qerl_cli.bench.gemm_settings import BACKENDS, DEFAULT_ROWS, DEFAULT_SHAPES, GemmSettings
from qerl_cli.bench.preflight import summary
from qerl_cli.cli.app import csv, positive_ints

GemmShapesOption = Annotated[
    str | None,
    typer.Option(
        "--gemm-shapes",
        metavar="SHAPE,...",
        help="Model shapes whose linears the GEMM section times.",
        show_default=",".join(DEFAULT_SHAPES),
    ),
]
GemmRowsOption = Annotated[
    str | None,
    typer.Option(
        "--gemm-rows",
        metavar="N,...",
        help="Token counts of the GEMM section.",
        show_default=",".join(map(str, DEFAULT_ROWS)),
    ),
]
GemmBackendsOption = Annotated[
    str | None,
    typer.Option(
        "--gemm-backends",
        metavar="NAME,...",
        help=f"GEMM section backends: {', '.join(BACKENDS)}.",
        show_default="all",
    ),
]
GemmTuneOption = Annotated[
    bool,
    typer.Option(
        "--gemm-tune/--no-gemm-tune", help="Time qerl's NVFP4 GEMM in each candidate tile config first."
    ),
]


def gemm_settings(shapes: str | None, rows: str | None, backends: str | None, tune: bool) -> GemmSettings:
    """The GEMM section's settings from its flags, each wrong value refused naming its flag."""
    names = None
    if shapes is not None:  # the shape registry imports torch: only asked when the flag is given
        from qerl_cli.bench.models import shape_names

        names = shape_names()
    return GemmSettings.from_flags(
        csv(shapes), positive_ints(rows, "--gemm-rows"), csv(backends), tune, names or []
    )


def gemm_plan(gemm: GemmSettings, formats: list[str], device: str) -> list[str]:
    """``qerl bench kernels --dry-run``'s plan: whether the GEMM section runs, and its flags' values (as
    ``bench concurrency``'s plan is printed)."""
    if "nvfp4" not in formats:
        runs = "skipped (nvfp4 is not among --formats)"
    elif device.startswith("cpu"):
        runs = f"skipped (--device {device}: the GEMMs are timed on a CUDA GPU only)"
    else:
        runs = "on a CUDA GPU (skipped on the CPU)"
    items = {
        "GEMM section": runs,
        "--gemm-shapes": gemm.shapes,
        "--gemm-rows": gemm.rows,
        "--gemm-backends": gemm.backends,
        "--gemm-tune": gemm.tune,
    }
    return ["plan:", *(f"  {line}" for line in summary(items))]
