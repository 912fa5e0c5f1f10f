"""The recipes have one home, the repository's top-level ``recipes/``, and the wheel carries the same files.

A clone (or an editable install) reads ``recipes/NAME.yaml`` where it is; an installed wheel has them as
the package ``qerl_cli.recipes`` (setup.py lists it, pyproject's package-dir maps it onto ``recipes/``).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_cli.config import SHIPPED_RECIPES, resolve_recipe, shipped_recipes

REPO = Path(__file__).resolve().parents[1]
# What building the wheel reads: the project's metadata, the package and the recipes.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "qerl_cli", "recipes")


def test_a_clone_reads_the_recipes_from_the_top_level_folder() -> None:
    assert SHIPPED_RECIPES == REPO / "recipes"
    assert not (REPO / "qerl_cli" / "recipes").exists()  # one home: no second copy inside the package
    assert shipped_recipes() == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert resolve_recipe("bigmath_14b") == REPO / "recipes" / "bigmath_14b.yaml"


NO_SETUPTOOLS = importlib.util.find_spec("setuptools") is None


@pytest.mark.skipif(NO_SETUPTOOLS, reason="building a wheel needs setuptools")
def test_the_wheel_carries_the_recipes_and_finds_them_by_name(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:  # a copy, so the build's build/ and egg-info stay out of the checkout
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)]
    subprocess.run(build, check=True, capture_output=True)
    (wheel,) = wheels.glob("qerl-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True)  # fmt: skip

    installed = target / "qerl_cli" / "recipes"
    recipes = sorted(SHIPPED_RECIPES.glob("*.yaml"))
    assert sorted(p.name for p in installed.glob("*.yaml")) == [p.name for p in recipes]
    for recipe in recipes:
        assert (installed / recipe.name).read_bytes() == recipe.read_bytes(), recipe.name
    assert (target / "qerl_cli" / "rollout" / "crossover.json").is_file()
    assert (target / "qerl_cli" / "bench" / "gpus.json").is_file()  # the roofline's GPU table
    # The tuned LoRA kernel configs: the folder and every config file a clone ships.
    shipped = REPO / "qerl_cli" / "rollout" / "lora_configs"
    carried = target / "qerl_cli" / "rollout" / "lora_configs"
    assert (carried / "README.md").is_file()
    assert sorted(p.name for p in carried.glob("*.json")) == sorted(p.name for p in shipped.glob("*.json"))

    # From a folder that is no clone, the installed qerl finds a recipe by name and by its clone path.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = "from qerl_cli.config import resolve_recipe as r; print(r('bigmath_14b'), r('recipes/tiny.yaml'))"
    found = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env={"PYTHONPATH": str(target)},
                           check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    assert found == [str(installed / "bigmath_14b.yaml"), str(installed / "tiny.yaml")]
