"""An option a recipe-driven command does not have, named as the recipe key that sets it.

`qerl train RECIPE --output DIR` (the other commands' ``-o``), ``--format nvfp4`` (quantize's) or
``--max-steps 5`` were "No such option" alone, though each is a recipe key that ``--set`` takes there.
"""

from __future__ import annotations

# The commands whose settings are a training recipe's keys (their --set takes them).
RECIPE_COMMANDS = ("qerl train", "qerl compare", "qerl bench scaling")
# Flags other commands spell that are no key's last part: the key each means in a recipe.
_FLAG_KEYS = {
    "o": "output.dir",
    "output": "output.dir",
    "model": "model.path",
    "lr": "train.learning_rate",
    "steps": "train.max_steps",
}


def recipe_key_hint(command_path: str, option: str) -> str | None:
    """``--set KEY=VALUE`` for the recipe key ``option`` (``--max-steps``, ``-o``) names on a recipe
    command; None where the command takes no recipe or no key is meant."""
    if command_path not in RECIPE_COMMANDS:
        return None
    from qerl_cli.config import TrainConfig
    from qerl_cli.config.keydocs import key_docs

    name = option.lstrip("-").partition("=")[0].replace("-", "_")
    keys = [doc.key for doc in key_docs(TrainConfig) if doc.key.rpartition(".")[2] == name]
    keys = keys or ([_FLAG_KEYS[name]] if name in _FLAG_KEYS else [])
    if not keys:
        return None
    given = " or ".join(f"--set {key}=VALUE" for key in keys)
    return (
        f"{command_path} takes it as a recipe key: {given} (`qerl train --keys {keys[0]}` says what it means)"
    )
