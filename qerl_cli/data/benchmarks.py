"""Evaluation benchmarks: the registered datasets marked ``benchmark`` (see ``datasets.REGISTRY``).

``load_benchmark`` reads a benchmark's evaluation split in its published order (no shuffle), from
the Hub or from a local file that follows the benchmark's field names. ``synthetic-...`` names use
the task's held-out test split (tiny models, ``qerl demo``); any other name is a custom benchmark
that must come from a file (``qerl eval --data-file NAME=PATH``).
"""

from __future__ import annotations

from qerl_cli.data.datasets import REGISTRY, SYNTHETIC_PREFIX, DatasetSpec, load_problems
from qerl_cli.data.problem import Problem
from qerl_cli.errors import QerlError

# Samples per problem for benchmarks not in the registry (a custom --data-file).
CUSTOM_DEFAULT_SAMPLES = 4


def benchmark_names() -> list[str]:
    return [name for name, spec in REGISTRY.items() if spec.benchmark]


def benchmark_spec(name: str) -> DatasetSpec | None:
    spec = REGISTRY.get(name)
    return spec if spec is not None and spec.benchmark else None


def default_samples(name: str) -> int:
    """Paper defaults: 4 per problem for gsm8k / math500, 16 for aime24 / aime25 / amc23."""
    spec = benchmark_spec(name)
    return spec.default_samples if spec else CUSTOM_DEFAULT_SAMPLES


def benchmark_source(name: str, data_file: str | None = None) -> str:
    """Where the problems come from, for the results file."""
    if data_file:
        return str(data_file)
    if name.startswith(SYNTHETIC_PREFIX):
        return f"{name}:test"
    spec = benchmark_spec(name)
    if spec is None:
        raise QerlError(f"benchmark '{name}' is not built in; give its file with --data-file {name}=PATH")
    src = spec.sources[0]
    return f"{src.hub_id}:{src.split or spec.eval_split}"


def load_benchmark(name: str, data_file: str | None = None, max_problems: int | None = None) -> list[Problem]:
    """The problems of benchmark ``name`` in their published order (first ``max_problems``)."""
    spec = benchmark_spec(name)
    if name.startswith(SYNTHETIC_PREFIX) and not data_file:  # held-out split of a synthetic task
        return load_problems(name, split="test", max_samples=max_problems, seed=0, shuffle=False)
    if data_file:
        return load_problems(
            data_file, split="test", like=spec.name if spec else None, max_samples=max_problems, shuffle=False
        )
    if spec is None:
        raise QerlError(
            f"unknown benchmark '{name}': choose from {', '.join(benchmark_names())} "
            f"or give a file with --data-file {name}=PATH"
        )
    return load_problems(name, split=spec.eval_split, max_samples=max_problems, shuffle=False)
