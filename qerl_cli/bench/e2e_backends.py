"""Which (format, linear backend) pairs ``qerl bench e2e`` times: :func:`e2e_pairs`.

``--linear-backend`` (``linear_backend``) takes one backend or a comma list; every format is timed on
each backend of the list that means something for it, once, in one run on one GPU, so their ratios are
measured side by side. A backend a format serves under another name is folded into that name, by the
rule ``rollout.backends.choose_backend`` applies to a pinned backend: ``fp8-merged`` on a BF16 base is
``merged`` (its own BF16 weights: there is no 4-bit base to copy to FP8), and ``marlin`` or ``humming``
on a base without FP4 weights (BF16, NF4) keeps vLLM's default. The plan and the report say which were
folded into which. ``auto`` stays a pair of its own: what it resolves to is known only once the
trainer's engine has chosen, and the row records that (``linear_backend``).

The HF engine has no linear backends (it generates with the trainer's own layers): a backend other than
``auto`` asked of it is refused, since its row would time the trainer's layers under the backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qerl_cli import formats
from qerl_cli.bench.labels import e2e_label
from qerl_cli.bench.settings import E2EConfig, recipe_config
from qerl_cli.errors import QerlError
from qerl_cli.rollout.backends import served_backend

AUTO = "auto"
# The format every ratio of a bench.json report is set against (the report's speed-ups, e2e's step
# times): the registry's BF16.
REFERENCE_FORMAT = formats.DENSE


@dataclass(frozen=True)
class E2EPair:
    """One timed case: a base ``format`` on ``backend``, the name this format serves the backend under
    (the row's ``backend``, which the ratios and the gate match rows by); ``requested`` is the
    ``rollout.linear_backend`` value the trainer is given for it."""

    format: str
    backend: str
    requested: str

    @property
    def label(self) -> str:
        return e2e_label({"format": self.format, "backend": self.backend})


@dataclass(frozen=True)
class FoldedBackend:
    """A backend asked for that this format serves under another name (``backend``)."""

    format: str
    requested: str
    backend: str

    def to_dict(self) -> dict[str, str]:
        return {"format": self.format, "requested": self.requested, "backend": self.backend}

    def line(self) -> str:
        return f"{self.format} {self.requested} -> {self.backend}"


@dataclass
class E2EPlan:
    """The pairs ``qerl bench e2e`` times, in their order, and the backends folded on the way."""

    backends: list[str]  # rollout.linear_backend values asked for, in order
    pairs: list[E2EPair] = field(default_factory=list)
    folded: list[FoldedBackend] = field(default_factory=list)

    def notes(self) -> list[str]:
        """The plan's line naming the folded backends (none when nothing was folded)."""
        if not self.folded:
            return []
        return ["backends folded (run once, under the name the format serves): "
                + "; ".join(f.line() for f in self.folded)]  # fmt: skip

    def settings(self) -> dict[str, Any]:
        """What bench.json's settings record of the plan."""
        return {"e2e_backends": list(self.backends), "e2e_folded": [f.to_dict() for f in self.folded]}


def requested_backends(cfg: E2EConfig) -> list[str]:
    """The backends asked for: ``linear_backend``'s, else the recipe's one, else ``auto``."""
    if cfg.linear_backend:
        return list(dict.fromkeys(cfg.linear_backend))
    if cfg.recipe:
        return [recipe_config(cfg.recipe, "").rollout.linear_backend]
    return [AUTO]


def refuse_named_backends(flag: str, named: list[str], engine: str, leave_out: str) -> None:
    """Refuse linear backends named with ``flag`` (e2e's ``--linear-backend``, concurrency's
    ``--backends``) for an engine without them: the HF engine has none, and its rows would time the
    trainer's own layers under the backend's name (``auto`` names none). ``leave_out`` says how to ask
    for none."""
    if engine != "vllm" and [b for b in named if b != AUTO]:
        raise QerlError(
            f"{flag} {','.join(named)}: the {engine} engine has no linear backends (it generates with the "
            "trainer's own layers whatever the name, so the row would not be that backend's); "
            f"{leave_out}, or time the backends with --engine vllm on a GPU"
        )


def e2e_pairs(cfg: E2EConfig, engine: str, formats: list[str]) -> E2EPlan:
    """Every (format, backend) pair that means something, once, in a fixed order: BF16 first (the
    reference of the ratios), then the other formats as given, each on the backends in the order asked.
    The HF engine times each format once on its own layers (``auto``)."""
    refuse_named_backends(
        "--linear-backend", cfg.linear_backend or [], engine, "leave --linear-backend out (or give auto)"
    )
    ordered = sorted(formats, key=lambda f: f != REFERENCE_FORMAT)
    if engine != "vllm":
        return E2EPlan([AUTO], [E2EPair(fmt, AUTO, AUTO) for fmt in ordered])
    plan = E2EPlan(requested_backends(cfg))
    for fmt in ordered:
        served: dict[str, str] = {}  # backend -> the first name asked that runs it
        for requested in plan.backends:
            backend = served_backend(requested, fmt)
            if backend != requested:
                plan.folded.append(FoldedBackend(fmt, requested, backend))
            served.setdefault(backend, requested)
        plan.pairs += [E2EPair(fmt, backend, requested) for backend, requested in served.items()]
    return plan
