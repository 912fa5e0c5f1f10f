"""The package's import layering: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "qerl_cli"


# -- layering ---------------------------------------------------------------------------------------
# Lower layers never import higher ones, and packages of one level never import each other. From the
# bottom: the base modules, formats, kernels, modeling, then data/rewards/rollout, then
# rl/evaluation/quantize, then bench/compare/demo, then the CLI.
BASE = {"errors", "torch_utils", "files", "config", "envinfo"}  # import nothing of qerl but each other
LEVELS = [
    {"formats"},
    {"kernels"},
    {"modeling"},
    {"data", "rewards", "rollout"},
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
# Same-level edges that exist on purpose.
ALLOWED_SIBLINGS = {("rewards", "data"), ("data", "rewards"), ("compare", "demo")}


def _forbidden(layer: str) -> set[str]:
    if layer in BASE:
        return {name for level in LEVELS for name in level} | (BASE - BASE_MAY_IMPORT)
    index = next(i for i, level in enumerate(LEVELS) if layer in level)
    higher = {name for level in LEVELS[index + 1 :] for name in level}
    siblings = {name for name in LEVELS[index] if (layer, name) not in ALLOWED_SIBLINGS} - {layer}
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
