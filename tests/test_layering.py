"""The package's import layering: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qerl_cli"


# -- layering ---------------------------------------------------------------------------------------
# Lower layers never import higher ones, and packages of one level never import each other. From the
# bottom: the base modules, formats, kernels, modeling, rewards (text in, grade out), then
# data/rollout, then rl/evaluation/quantize, then bench/compare/demo, then the CLI.
# The base modules import nothing of qerl but each other.
BASE = {"errors", "torch_utils", "files", "config", "envinfo", "stats", "lazy"}
LEVELS = [
    {"formats"},
    {"kernels"},
    {"modeling"},
    {"rewards"},  # below data: datasets read gold answers with rewards.extract
    {"data", "rollout"},
    {"rl", "evaluation", "quantize"},
    {"bench", "compare", "demo"},
    {"cli"},
]
BASE_MAY_IMPORT = {"errors", "torch_utils", "files"}
# Edges the level rule allows but this code base keeps out (a reason each).
ALSO_FORBIDDEN = {
    "data": {"rollout"},  # datasets are plain data; generation uses them
    "quantize": {"rollout"},  # quantization never generates
}


def _forbidden(layer: str) -> set[str]:
    if layer in BASE:
        # A base package (config) may import its own modules.
        return {name for level in LEVELS for name in level} | (BASE - BASE_MAY_IMPORT - {layer})
    index = next(i for i, level in enumerate(LEVELS) if layer in level)
    higher = {name for level in LEVELS[index + 1 :] for name in level}
    siblings = set(LEVELS[index]) - {layer}
    return higher | siblings | ALSO_FORBIDDEN.get(layer, set())


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "qerl_cli" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_lower_layers_never_import_higher_ones() -> None:
    violations = []
    for file in PACKAGE.rglob("*.py"):
        layer = file.relative_to(PACKAGE).with_suffix("").parts[0]
        if layer in ("__init__", "__main__"):
            continue
        for target in sorted(_imports(file) & _forbidden(layer)):
            violations.append(f"{file.relative_to(REPO)} imports qerl_cli.{target}")
    assert violations == []


def test_the_layer_table_names_every_package() -> None:
    packages = {p.with_suffix("").name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    packages -= {"__init__", "__main__", "__pycache__"}
    assert packages == BASE | {name for level in LEVELS for name in level}
    assert {"rl", "data", "cli"} <= _forbidden("rollout") and "modeling" not in _forbidden("rollout")


def test_the_layering_check_sees_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from qerl_cli.rl.policy import Policy\n    import qerl_cli.bench\n")
    assert _imports(source) == {"rl", "bench"}


def _module_graph() -> dict[str, set[str]]:
    """qerl module -> the qerl modules it imports (lazy imports included). ``from pkg import sub``
    names the submodule, so a package that re-exports its own modules is no circle."""
    files = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    graph: dict[str, set[str]] = {}
    for module, file in files.items():
        targets = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                targets |= subs or {node.module}
                if len(subs) < len(node.names):
                    targets.add(node.module)
        graph[module] = targets - {module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other() -> None:
    assert _circles(_module_graph()) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- imports at the top of a module ------------------------------------------------------------------
# An import inside a function hides a module's dependencies and defers its errors to a run's middle, so
# imports go at the top. These may stay inside a function, and only these:
LAZY_PACKAGES = {
    # heavy optional dependencies: an extra may not install them, and each costs seconds to import
    "vllm", "llmcompressor", "transformers", "peft", "matplotlib", "triton", "bitsandbytes", "liger_kernel",
    "datasets", "math_verify", "pynvml", "gguf", "wandb", "torch.utils.tensorboard",
    # qerl's Triton kernels, which import triton at their top
    "qerl_cli.kernels._triton_dequant", "qerl_cli.kernels._triton_fp8_rows",
    "qerl_cli.kernels._triton_nvfp4_gemm",
}  # fmt: skip
# The CLI's start-up path: `qerl --help` imports the library (and torch) only in the command that needs it.
LAZY_FILES = {"qerl_cli/__main__.py"}
LAZY_FOLDERS = ("qerl_cli/cli/",)
# Function-level imports in all, the allowed ones above included (the figure may only go down).
MAX_FUNCTION_IMPORTS = 150


def _function_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, imported module) of every import inside a function body (a nested function's counted
    again, in each function around it)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    found.append((sub.lineno, sub.names[0].name))
                elif isinstance(sub, ast.ImportFrom):
                    module = sub.module or ""
                    names = [f"{module}.{a.name}" for a in sub.names]
                    lazy = next((n for n in names if n in LAZY_PACKAGES), module)
                    found.append((sub.lineno, "qerl_cli." + module if sub.level else lazy))
    return found


def _allowed(path: str, module: str) -> bool:
    if path in LAZY_FILES or path.startswith(LAZY_FOLDERS):
        return True
    parts = module.split(".")
    return any(".".join(parts[:n]) in LAZY_PACKAGES for n in range(1, len(parts) + 1))


def test_function_level_imports_stay_few() -> None:
    found = {
        str(p.relative_to(REPO)): _function_imports(ast.parse(p.read_text()))
        for p in sorted(PACKAGE.rglob("*.py"))
    }
    total = sum(map(len, found.values()))
    to_move = [f"{path}:{line} {module}" for path, imports in found.items() for line, module in imports
               if not _allowed(path, module)]  # fmt: skip
    assert total <= MAX_FUNCTION_IMPORTS, f"{total} imports inside functions; move to the top: {to_move}"


def test_the_import_count_sees_what_it_is_for() -> None:
    tree = ast.parse(
        "import os\ndef f():\n    import torch\n    from vllm import LLM\n    def g():\n        import json\n"
    )
    assert _function_imports(tree) == [(3, "torch"), (4, "vllm"), (6, "json"), (6, "json")]
    assert _allowed("qerl_cli/rl/x.py", "vllm.lora") and _allowed("qerl_cli/cli/app.py", "torch")
    assert not _allowed("qerl_cli/rl/x.py", "torch")
    assert not _allowed("qerl_cli/rl/x.py", "qerl_cli.rl.policy")


def test_the_cli_starts_without_torch() -> None:
    """``qerl --help`` and every command's --help import no torch: it costs seconds before the first line."""
    code = (
        "import sys\nfrom qerl_cli.cli import main\n"
        "helps = ([], ['train'], ['compare'], ['bench'], ['bench', 'kernels'])\n"
        "codes = [main([*argv, '--help']) for argv in helps]\n"
        "print(codes, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 0] False"
