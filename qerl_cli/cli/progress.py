"""What a long command prints as it goes: stage lines and CPU time estimates, on stderr and plain, so
a log (CI, ``| tee``, ``nohup``) shows them as they happen while stdout keeps the command's result."""

from __future__ import annotations

import os
import sys

from rich.markup import escape

from qerl_cli.cli.app import err_console
from qerl_cli.config import EvalConfig


def stage_log(line: str) -> None:
    """A long stage's progress line, on stderr and plain (paths hold brackets): a log reads it as is."""
    err_console.print(line, markup=False, highlight=False)


def quiet_library_bars() -> None:
    """Outside a terminal (a log, a pipe) the progress bars of transformers, huggingface_hub and
    llm-compressor are carriage-return noise beside the stage lines, which say what runs. tqdm reads its
    setting when it is imported: ``cli.main`` calls this once, for every command, before any imports them."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def say_estimate(line: str | None) -> None:
    """A CPU time estimate at a long command's start (stderr: stdout stays the command's result)."""
    if line:
        err_console.print(escape(line), highlight=False)


def eval_cpu_estimate(conf: EvalConfig) -> str | None:
    """What sampling on this CPU should take: per 100 completions of up to ``max_new_tokens``, and for
    each benchmark when ``--max-problems`` fixes the count (an estimate from the configuration)."""
    import torch

    from qerl_cli.data.benchmarks import default_samples
    from qerl_cli.rl.preflight import model_parameters
    from qerl_cli.torch_utils import cpu_seconds, estimated_duration, parameter_count

    sized = model_parameters(conf.model) if conf.model else None
    if sized is None:
        return None
    params, four_bit = sized
    prompt_tokens = 256  # a question in the chat template, about
    one = cpu_seconds(
        params, forward_tokens=prompt_tokens, decode_tokens=conf.max_new_tokens, four_bit=four_bit
    )
    per = f"{estimated_duration(100 * one)} per 100 completions of up to {conf.max_new_tokens} tokens"
    if conf.max_problems:
        counts = {
            name: conf.max_problems * (conf.samples or default_samples(name)) for name in conf.benchmarks
        }
        per += "; " + ", ".join(
            f"{name} ({n} completions) {estimated_duration(n * one)}" for name, n in counts.items()
        )
    threads, size = torch.get_num_threads(), parameter_count(params)
    return (
        f"estimate on this CPU ({threads} threads, {size} parameters): {per} "
        "(worked out from the configuration, it may be off 2x either way; --max-problems N evaluates fewer)"
    )
