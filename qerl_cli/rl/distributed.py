"""Data-parallel training on ``torch.distributed``: ``torchrun --nproc-per-node N -m qerl_cli train``.

Every rank holds the whole policy (the packed 4-bit base and the LoRA) and its own colocated rollout
engine. A step's prompts are drawn identically on every rank from the seeded stream and split into
contiguous blocks of whole prompts (so every GRPO group lives on one rank); each rank generates and
grades its block. What must be global is made global with small collectives:

- dynamic sampling decides on the gathered rewards of every rank, in rank order (= the single-process
  row order), so the kept groups are those a single process would keep;
- the loss normaliser (sequences, tokens, or rows x max length) is summed over ranks, so each rank's
  loss is its share of the global loss and the *sum* of the ranks' gradients is the global gradient;
- the gradients of the trainable (LoRA) parameters are summed with one flat ``all_reduce`` before
  clipping, so every rank clips the same gradient and takes the same optimizer step. A flat buffer
  rather than DDP: the number of micro-batches differs between ranks (a rank may even have no kept
  row), which DDP's per-backward hooks do not allow, and QuantLinear's custom autograd needs nothing
  from it;
- metrics are gathered and merged, and written once, by rank 0, as are checkpoints.

NCCL on GPUs (one GPU per rank, ``cuda:LOCAL_RANK``), gloo on CPUs. Without ``WORLD_SIZE`` in the
environment (no torchrun) everything here is a no-op on a world of one.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from qerl_cli.errors import QerlError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Long enough for a rank to finish a slow rollout round or checkpoint while the others wait.
TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class Distributed:
    """This process's place in the job; a world of one when not launched by torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    owns_group: bool = False  # this object started the process group and ends it in close()

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---- work split ---------------------------------------------------------------------------
    def shard(self, count: int, rank: int | None = None) -> slice:
        """This rank's contiguous block of ``count`` items (block sizes differ by at most one)."""
        rank = self.rank if rank is None else rank
        base, extra = divmod(count, self.world_size)
        start = rank * base + min(rank, extra)
        return slice(start, start + base + (1 if rank < extra else 0))

    def device(self, resolved: torch.device) -> torch.device:
        """The GPU of this rank (``cuda:LOCAL_RANK``) when training on CUDA, else ``resolved``."""
        if self.enabled and resolved.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return resolved

    # ---- collectives (identity on a world of one) ---------------------------------------------
    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        if not self.enabled:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(tensor)
        return tensor.cpu().tolist()

    def any(self, flag: bool) -> bool:
        return self.sum([float(flag)])[0] > 0 if self.enabled else flag

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def on_main(self, work: Callable[[], T], what: str) -> T | None:
        """``work()`` on rank 0 while the others wait; if it fails, every rank raises (rank 0 its own
        error), so no rank is left waiting for one that has gone (NCCL would hang until its timeout)."""
        result, error = None, None
        if self.is_main:
            try:
                result = work()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
                error = exc
        if self.any(error is not None):
            if error is not None:
                raise error
            raise QerlError(f"rank 0 could not {what}; its own error says why")
        return result

    def broadcast_parameters(self, params: list[tuple[str, nn.Parameter]]) -> None:
        """Rank 0's values for ``params`` on every rank (the LoRA init draws from the global RNG)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for _, param in params:
                buffer = param.data.to(self._comm_device())
                torch.distributed.broadcast(buffer, src=0)
                param.data.copy_(buffer)

    def all_reduce_gradients(self, params: list[tuple[str, nn.Parameter]]) -> None:
        """Sum the gradients of ``params`` over ranks in one flat float32 buffer.

        A parameter without a gradient on this rank (no kept rows, or an unused adapter) counts as
        zeros and gets the summed gradient, so the optimizer steps every parameter on every rank.
        """
        if not self.enabled:
            return
        device = self._comm_device()
        parts = [p.grad.detach().float() if p.grad is not None else torch.zeros(p.shape) for _, p in params]
        flat = torch.cat([g.reshape(-1).to(device) for g in parts])
        torch.distributed.all_reduce(flat)
        offset = 0
        for _, p in params:
            size = p.numel()
            summed = flat[offset : offset + size].view(p.shape).to(device=p.device, dtype=p.dtype)
            if p.grad is None:
                p.grad = summed.clone()
            else:
                p.grad.copy_(summed)
            offset += size

    def close(self) -> None:
        if self.owns_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.owns_group = False

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")


def _leave_the_agent_store() -> None:
    """A world of one under torchrun trains as a plain process, but torchrun tells every process group
    created in it to join torchrun's own store (``TORCHELASTIC_USE_AGENT_STORE=True``): a later
    ``tcp://`` rendezvous then only connects as a client to an address nobody serves, and waits until its
    timeout. vLLM's in-process engine starts such a group of one; under ``torchrun --nproc-per-node 1`` it
    hung there for minutes (vLLM 0.26). Without the variable it serves its own store, as it does
    without torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        log.info("torchrun world of one: process groups started here serve their own store")


def init_distributed(device_setting: str = "auto") -> Distributed:
    """Join the job torchrun started (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment), or a world of one without them.

    NCCL when ranks train on CUDA (``train.device`` auto or cuda with a GPU visible), gloo otherwise.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        _leave_the_agent_store()
        return Distributed()
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise QerlError(
            f"WORLD_SIZE={world} is set but RANK is not: start distributed runs with "
            "torchrun --nproc-per-node N -m qerl_cli train RECIPE.yaml"
        ) from None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = str(torch.distributed.get_backend())
        size = torch.distributed.get_world_size()
        return Distributed(torch.distributed.get_rank(), size, local_rank, backend)
    cuda = device_setting != "cpu" and torch.cuda.is_available()
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise QerlError(
                f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s): start at "
                "most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    backend = "nccl" if cuda else "gloo"
    torch.distributed.init_process_group(backend, timeout=TIMEOUT)
    log.info("rank %d of %d (%s, local rank %d)", rank, world, backend, local_rank)
    return Distributed(rank, world, local_rank, backend, owns_group=True)
