"""What ``qerl bench kernels``' GEMM section measures (:mod:`qerl_cli.bench.gemm`), checked without torch
so that the CLI refuses a wrong ``--gemm-*`` flag before any import of it."""

from __future__ import annotations

from collections.abc import Sequence
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
        shapes = _known("--gemm-shapes", "shape", shapes, shape_names)
        backends = _known("--gemm-backends", "backend", backends, BACKENDS)
        return cls(
            shapes=tuple(shapes) if shapes else DEFAULT_SHAPES,
            rows=tuple(rows) if rows else DEFAULT_ROWS,
            tune=tune,
            backends=tuple(b for b in BACKENDS if b in backends) if backends else BACKENDS,
        )


def _known(flag: str, what: str, given: list[str] | None, known: Sequence[str]) -> list[str] | None:
    """``given`` lowercased (None: the flag was not given), each a member of ``known``, else refused naming
    the flag and the choices."""
    if given is None:
        return None
    given = [g.lower() for g in given]
    unknown = [g for g in given if g not in known]
    if unknown or not given:
        raise QerlError(
            f"{flag}: unknown {what} {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}"
        )
    return given
