"""vLLM's environment as qerl reads it, apart from vLLM's own modules (so nothing here imports vLLM): the
switch that keeps vLLM's engine core in this process, qerl's default for it, and the check of the installed
vLLM's version against a feature's first release. A leaf of ``rollout``: the engine's setup
(:mod:`~qerl_cli.rollout.vllm_setup`), qerl's kernel in vLLM (:mod:`~qerl_cli.rollout.vllm_nvfp4`) and the
backend choice all read it."""

from __future__ import annotations

import os

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# What qerl sets before it imports vLLM (vllm_setup._import_vllm) unless the environment says otherwise.
QERL_MULTIPROCESSING_DEFAULT = "0"


def vllm_too_old(version: tuple[int, int] | None, need: tuple[int, int], what: str) -> str | None:
    """Why the installed vLLM ``version`` cannot serve ``what`` (None: it can, or the version is unknown),
    with the upgrade command."""
    if version is None or version >= need:
        return None
    have, wanted = ".".join(map(str, version)), ".".join(map(str, need))
    return f'needs vLLM {wanted}+ ({what}); this is vLLM {have}: pip install -U "vllm>={wanted}"'


def vllm_in_process(*, before_import: bool = False) -> bool:
    """Whether a ``vllm.LLM`` built now keeps its engine core (its model and memory) in this process.
    ``before_import``: asked before qerl's first engine, whose import sets qerl's default where the
    environment names none (vLLM's own default, unset, is another process)."""
    default = QERL_MULTIPROCESSING_DEFAULT if before_import else "1"
    return os.environ.get(MULTIPROCESSING_ENV, default) == "0"
