"""The `qerl` command line: parse, load the typed config, call the library, render with rich.

``app`` is the Typer app and ``main`` the console entry point (``qerl = "qerl_cli.cli:main"``).
The package splits by responsibility: ``app`` (the app and what every command shares), ``stages``
(quantize, train, eval, demo, compare), ``bench``, ``bench_tools``, ``bench_lora`` and ``bench_gap`` (the
``qerl bench`` group and its benchmarks), ``tools`` (env, tiny-base, tiny-model, models, quality),
``render`` (what the commands print beside each stage's own table), ``progress`` (stage lines and CPU
estimates) and ``main`` (exit codes).
"""

from __future__ import annotations

from qerl_cli.cli import bench, bench_gap, bench_lora, bench_tools, stages, tools
from qerl_cli.cli.app import QerlCommand, app
from qerl_cli.cli.main import main

# Registered here, in the order `qerl --help` lists them (Typer keeps the order of registration); each
# with qerl's command class (help without a type column for flags).
app.command(cls=QerlCommand)(stages.quantize)
app.command(cls=QerlCommand)(stages.train)
app.command("eval", cls=QerlCommand)(stages.eval_)
app.add_typer(bench.bench_app, name="bench")  # a group: its benchmarks are registered below
app.command(cls=QerlCommand)(stages.demo)
app.command(cls=QerlCommand)(tools.env)
app.command("tiny-base", cls=QerlCommand)(tools.tiny_base)
app.command("tiny-model", cls=QerlCommand)(tools.tiny_model)
app.command("models", cls=QerlCommand)(tools.models_)
app.command(cls=QerlCommand)(stages.compare)
app.command(cls=QerlCommand)(tools.quality)
BENCHMARKS = {
    "rollout": bench.rollout,
    "concurrency": bench.concurrency,
    "e2e": bench.e2e,
    "kernels": bench_tools.kernels,
    "update": bench_tools.update,
    "scaling": bench_tools.scaling,
    "quality": bench_tools.quality,
    "lora-tune": bench_lora.lora_tune,
    "gap": bench_gap.gap,
}
for name, benchmark in BENCHMARKS.items():  # `qerl bench --help` lists them in this order
    bench.bench_app.command(name, cls=QerlCommand)(benchmark)

__all__ = ["app", "main"]
