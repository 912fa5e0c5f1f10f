"""One home per fact: a constant, a piece of shape arithmetic or a setting's list of values is defined
once in the package, and every other module imports it (a second copy drifts, or takes its arguments
in another order)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

from qerl_cli.config import choices

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qerl_cli"

# Each name with the one module that may define it (at module level, or as a method of a class there).
HOMES = {
    "GIB": "qerl_cli/torch_utils.py",
    "lora_params": "qerl_cli/modeling/model_shape.py",
    "linear_shapes": "qerl_cli/modeling/model_shape.py",
    "fused_linears": "qerl_cli/modeling/model_shape.py",
    "gpu_file_prefix": "qerl_cli/rollout/lora_kernel_configs.py",
    "rollout_weight_format": "qerl_cli/rollout/backends.py",
    "completion_texts": "qerl_cli/rollout/base.py",  # every engine's completion text
    "BaseCompute": "qerl_cli/config/choices.py",
    "FusedKernels": "qerl_cli/config/choices.py",
    "LinearBackend": "qerl_cli/config/choices.py",
}
# The config aliases whose values no module spells out again as a literal list (it checks membership
# with ``get_args(alias)`` instead).
ALIASES = {
    "BaseCompute": choices.BaseCompute,
    "FusedKernels": choices.FusedKernels,
    "LinearBackend": choices.LinearBackend,
}


def _definitions(tree: ast.Module) -> set[str]:
    """Names a module defines at its top level or as a method of one of its top-level classes."""
    found: set[str] = set()
    bodies = [tree.body] + [node.body for node in tree.body if isinstance(node, ast.ClassDef)]
    for body in bodies:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                found.add(node.name)
            elif isinstance(node, ast.Assign):
                found.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found.add(node.target.id)
    return found


def _sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(REPO)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_each_fact_is_defined_in_its_home_only() -> None:
    where: dict[str, list[str]] = {name: [] for name in HOMES}
    for path, tree in _sources().items():
        for name in _definitions(tree) & HOMES.keys():
            where[name].append(path)
    assert where == {name: [home] for name, home in HOMES.items()}


def test_no_module_spells_out_an_alias_values() -> None:
    """``("bf16", "fp8", "auto")`` beside ``BaseCompute`` is a second list of its values, in any order."""
    value_sets = {name: set(get_args(alias)) for name, alias in ALIASES.items()}
    copies = []
    for path, tree in _sources().items():
        if path == HOMES["BaseCompute"]:  # the aliases themselves
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Tuple | ast.List | ast.Set):
                continue
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) != len(node.elts) or not all(isinstance(v, str) for v in values):
                continue
            copies += [f"{path}:{node.lineno} {name}" for name, vs in value_sets.items() if set(values) == vs]
    assert copies == []


def test_the_check_sees_a_second_definition_and_a_copied_list() -> None:
    tree = ast.parse("GIB = 2**30\nclass S:\n    def lora_params(self): ...\nX = ('off', 'auto', 'liger')\n")
    assert {"GIB", "lora_params"} <= _definitions(tree)
    literal = next(n for n in ast.walk(tree) if isinstance(n, ast.Tuple))
    assert {e.value for e in literal.elts} == set(get_args(choices.FusedKernels))


# A line of the package naming a GPU, a date or a model of a recorded run: such figures and their story
# live in benchmarks/<run>/README.md and docs/*.md, and the code says the rule and the remedy. (Model
# aliases used as data, "gemma3-270m", are spelled so that this does not match them.)
RUN_MENTION = re.compile(r"H100|H200|A100|20[0-9]{2}-[0-9]{2}-[0-9]{2}|Gemma 3 270M|SmolLM2")
MAX_RUN_MENTIONS = 10  # the model name of a shipped alias, and what is left to strip (may only go down)


def _run_mentions(text: str) -> int:
    return sum(1 for line in text.splitlines() if RUN_MENTION.search(line))


def test_the_code_names_few_gpus_dates_or_run_models() -> None:
    found = {str(p.relative_to(REPO)): _run_mentions(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert sum(found.values()) <= MAX_RUN_MENTIONS, {path: n for path, n in found.items() if n}


def test_the_mention_count_sees_gpus_dates_and_models() -> None:
    text = "on an H200\nbenchmarks/run-2026-11-27\nGemma 3 270M\nSmolLM2-135M\nalias gemma3-270m\nH20\n"
    assert _run_mentions(text) == 4
