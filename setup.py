"""The one packaging setting pyproject.toml cannot say: the found packages plus the top-level recipes/.

`[tool.setuptools.packages.find]` would list only the packages under qerl_cli/; the recipes folder is
mapped onto qerl_cli.recipes by pyproject's package-dir table, so the wheel carries the files a clone
keeps at recipes/ (the one home of the recipes).
"""

from setuptools import find_packages, setup

# qerl_cli.rollout.lora_configs holds data only (no __init__.py): listed, so setuptools packages it as the
# package its files belong to rather than warning that an importable folder is left out.
setup(
    packages=[
        *find_packages(include=["qerl_cli", "qerl_cli.*"]),
        "qerl_cli.rollout.lora_configs",
        "qerl_cli.recipes",
    ]
)
