"""Running the qerl CLI in-process from a test, as the checks-before-work tests do."""

from __future__ import annotations

from pathlib import Path

import pytest

from qerl_cli.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The exit code, stdout as written (a dry run's YAML), and stderr with its whitespace folded to single
    spaces: rich wraps long messages at the console's width, which a test's substring must not depend on."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, " ".join(err.split())


def usage_error(rc: int, err: str) -> bool:
    """Exit 2 with qerl's error line, not a crash. ``err`` as :func:`run_cli` folds it: the error need not
    come first, since on a loaded machine the CPU-thread notice may be printed before it."""
    return rc == 2 and "error:" in err and "internal error" not in err and "Traceback" not in err


def tiny_cpu_recipe(path: Path, model: Path, output_dir: Path, *, max_steps: int, save_steps: int) -> Path:
    """A recipe that trains ``model`` (a tiny one) on the CPU in seconds a step, written to ``path``: what
    the tests that run `qerl train` in a subprocess give it."""
    path.write_text(
        f"model:\n  path: {model}\n  dtype: float32\n"
        "data:\n  dataset: synthetic-addition\n  template: plain\n"
        "rollout:\n  num_generations: 4\n  max_completion_length: 8\n  max_prompt_length: 64\n"
        f"train:\n  prompts_per_step: 2\n  max_steps: {max_steps}\n  micro_batch_size: 4\n  device: cpu\n"
        "  gradient_checkpointing: false\n"
        "lora:\n  rank: 4\n  alpha: 8\n"
        "reward:\n  grader_workers: 1\n"
        f"output:\n  dir: {output_dir}\n  save_steps: {save_steps}\n"
    )
    return path
