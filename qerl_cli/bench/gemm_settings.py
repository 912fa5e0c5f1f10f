"""What ``qerl bench kernels``' GEMM section measures (:mod:`qerl_cli.bench.gemm`), checked without torch
so that the CLI refuses a wrong ``--gemm-*`` flag before any import of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qerl_cli.errors import QerlError

BACKENDS = ("bf16", "fp8", "marlin", "qerl-nvfp4")
DEFAULT_ROWS = (8, 16, 32, 64, 128, 256)
DEFAULT_SHAPES = ("qwen2.5-7b", "qwen2.5-32b")


@dataclass(frozen=True)
class GemmSettings:
    """Model shapes, token counts and backends, and whether the section first times qerl's kernel in
    each candidate tile config (``gemm_tuning``)."""

    shapes: tuple[str, ...] = DEFAULT_SHAPES
    rows: tuple[int, ...] = DEFAULT_ROWS
    tune: bool = True
    backends: tuple[str, ...] = BACKENDS

    def to_dict(self) -> dict[str, Any]:
        """Its entries of ``kernels.json``'s ``settings``."""
        return {
            "gemm_shapes": list(self.shapes),
            "gemm_rows": list(self.rows),
            "gemm_tune": self.tune,
            "gemm_backends": list(self.backends),
        }

    @classmethod
    def from_flags(
        cls,
        shapes: list[str] | None,
        rows: list[int] | None,
        backends: list[str] | None,
        tune: bool,
        shape_names: list[str],
    ) -> GemmSettings:
        """From ``--gemm-shapes``, ``--gemm-rows`` (already positive integers), ``--gemm-backends`` and
        ``--gemm-tune`` (None: the default); ``shape_names`` are the model shapes there are."""
        if shapes is not None:
            shapes = [s.lower() for s in shapes]
            unknown = [s for s in shapes if s not in shape_names]
            if unknown or not shapes:
                raise QerlError(
                    f"--gemm-shapes: unknown shape {', '.join(unknown) or '(none given)'}; "
                    f"choose from {', '.join(shape_names)}"
                )
        if backends is not None:
            backends = [b.lower() for b in backends]
            unknown = [b for b in backends if b not in BACKENDS]
            if unknown or not backends:
                raise QerlError(
                    f"--gemm-backends: unknown backend {', '.join(unknown) or '(none given)'}; "
                    f"choose from {', '.join(BACKENDS)}"
                )
        return cls(
            shapes=tuple(shapes) if shapes else DEFAULT_SHAPES,
            rows=tuple(rows) if rows else DEFAULT_ROWS,
            tune=tune,
            backends=tuple(b for b in BACKENDS if b in backends) if backends else BACKENDS,
        )
