"""Sharing one GPU between vLLM runs: each child's ``--set`` list (its slice of the GPU, vLLM's sleep
mode off, an explicit vLLM share inside the slice), checked before any child starts."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from qerl_cli.compare.runs import SHARE_KEY, arm_config, train_sets
from qerl_cli.config import TrainConfig, apply_overrides, from_dict
from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)
# Of the GPU's memory, what vLLM runs sharing it divide among themselves (the rest: CUDA contexts,
# fragmentation, what a run holds beyond its plan).
SHARED_GPU_FRACTION = 0.92


def _thousandths(fraction: float, parts: int) -> float:
    """``fraction / parts`` rounded down to thousandths (0.92 / 3 -> 0.306)."""
    return round(fraction * 1000) // parts / 1000


_ABSENT = object()


def _given_by_sets(key: str, sets: list[str]) -> Any:
    """The value the ``--set`` list gives ``key`` (the last one wins, parsed as every --set is), or
    ``_ABSENT``."""
    node: Any = apply_overrides({}, list(sets), None)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _explicit(
    key: str, arms: dict[str, dict[str, Any]], sets: list[str], todo: list[tuple[str, int]]
) -> list[tuple[str, Any]]:
    """Where this invocation sets ``key`` itself (``--set`` or an arm's override), with the value."""
    given = _given_by_sets(key, sets)
    found = [] if given is _ABSENT else [("--set", given)]
    found += [(f"arm {a}", arms[a][key]) for a in dict.fromkeys(a for a, _ in todo) if key in arms[a]]
    return found


def planning_sets(sets: list[str]) -> list[str]:
    """The training ``sets`` to plan the runs with: where ``--set`` gives no vLLM share, ``auto`` stands in
    for the recipe's (or the default's), which runs sharing a GPU get replaced (:func:`_child_vllm_share`
    checks a given one and sets the rest), so a ``train.gpu_fraction`` given below it is not refused before
    compare has set the share it would refuse."""
    if _given_by_sets(SHARE_KEY, sets) is not _ABSENT:
        return sets
    return [*sets, f"{SHARE_KEY}=auto"]


def _child_vllm_share(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], all_sets: list[str], todo: list[tuple[str, int]],
    fraction: float, width: int,
) -> tuple[float | None, str]:  # fmt: skip
    """vLLM's share (a fraction of the whole GPU) each run sharing it gets, and why: half its
    ``fraction``, or the recipe's smaller explicit share; None where ``--set`` gives one (kept, checked).
    An arm's own share is kept (checked). With sleep mode off the share must be a number."""
    key = SHARE_KEY
    half = _thousandths(fraction, 2)
    for where, value in _explicit(key, arms, all_sets, todo):
        if value == "auto":
            raise QerlError(
                f"{key}=auto ({where}) with --jobs {width}: vLLM runs sharing the GPU run without sleep "
                f"mode, and then need an explicit share. Leave it out (each vLLM then gets {half}, half of "
                f"its train.gpu_fraction={fraction}) or give a fraction of the whole GPU of at most "
                f"{fraction}"
            )
        if isinstance(value, int | float) and value > fraction:
            raise QerlError(
                f"{key}={value} ({where}) is more than train.gpu_fraction={fraction}, the part of the GPU "
                f"each of the {width} runs sharing it may use: give at most {fraction}, or leave it out "
                f"(each vLLM then gets {half}, half of its fraction)"
            )
    if _given_by_sets(key, all_sets) is not _ABSENT:
        return None, "--set's"
    recipe = from_dict(
        TrainConfig, apply_overrides(copy.deepcopy(data), train_sets(all_sets), None)
    ).rollout.gpu_memory_utilization
    if recipe != "auto" and float(recipe) <= half:
        return float(recipe), "the recipe's"
    why = "the recipe's auto needs sleep mode" if recipe == "auto" else f"the recipe's {recipe} is larger"
    return half, f"half of train.gpu_fraction; {why}"


def shared_gpu_sets(
    data: dict[str, Any], arms: dict[str, dict[str, Any]], all_sets: list[str], todo: list[tuple[str, int]],
    out: Path, bases: dict[str, str], confs: list[TrainConfig], width: int,
) -> list[str]:  # fmt: skip
    """The children's ``--set`` list when ``width`` vLLM runs share the GPU: each gets
    ``train.gpu_fraction`` = SHARED_GPU_FRACTION / width (or keeps the user's if it is at most 1 / width),
    vLLM's sleep mode off and an explicit vLLM share inside that fraction (:func:`_child_vllm_share`): the
    trainer plans its update within what the share leaves of the slice.

    Sleep mode cannot stay on: vLLM's ``sleep()`` compares the whole device's free memory before and
    after, and stops the run when a neighbour allocated meanwhile. A user who turns it on explicitly
    (``--set`` or an arm) is refused (exit 2) rather than overridden. Every run's config is checked with
    these settings now, not in a child."""
    given = (
        "gpu_fraction" in (data.get("train") or {})
        or _given_by_sets("train.gpu_fraction", all_sets) is not _ABSENT
        or any("train.gpu_fraction" in arms[a] for a, _ in todo)
    )
    if given:
        most = max(conf.train.gpu_fraction for conf in confs)
        if most > 1 / width:
            raise QerlError(
                f"train.gpu_fraction={most} is more than 1/{width} of the GPU, but --jobs runs {width} "
                f"runs on it at once: set it to at most {_thousandths(1.0, width)}, or leave it out "
                f"(compare then gives each {_thousandths(SHARED_GPU_FRACTION, width)})"
            )
        sets, fraction = list(all_sets), most
    else:
        fraction = _thousandths(SHARED_GPU_FRACTION, width)
        sets = [*all_sets, f"train.gpu_fraction={fraction}"]
    for where, value in _explicit("rollout.enable_sleep_mode", arms, all_sets, todo):
        if value is True:
            raise QerlError(
                f"rollout.enable_sleep_mode=true ({where}) with --jobs {width}: vLLM runs sharing the GPU "
                "cannot sleep. vLLM's sleep() compares the whole device's free memory before and after, and "
                "stops the run ('Memory usage increased after sleeping') when a neighbour allocated "
                "meanwhile; compare turns sleep mode off for each of them (vLLM keeps an explicit share "
                "through the update). Remove the setting, or run one at a time (--jobs 1) to keep sleep mode"
            )
    # Arms may give different fractions: the share fits the smallest.
    smallest = min(conf.train.gpu_fraction for conf in confs) if given else fraction
    share, why = _child_vllm_share(data, arms, all_sets, todo, smallest, width)
    sets.append("rollout.enable_sleep_mode=false")
    if share is not None:
        sets.append(f"rollout.gpu_memory_utilization={share}")
    trained = train_sets(sets)
    for arm, seed in todo:
        arm_config(data, arms[arm], trained, seed, out, arm, bases)
    if share is None:  # the user's --set
        share = _given_by_sets("rollout.gpu_memory_utilization", all_sets)
    log.info(
        "%d vLLM runs share the GPU at a time: each plans its memory within train.gpu_fraction=%s of it, "
        "with vLLM's sleep mode off and its share rollout.gpu_memory_utilization=%s of the whole GPU (%s), "
        "its KV cache sized from that share; each starts once the previous one's vLLM engine is up or "
        "compare.engine_ready_timeout_s after it started",
        width, fraction, share, why,
    )  # fmt: skip
    return sets
