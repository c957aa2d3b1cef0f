"""Multi-process training: the only module that touches ``torch.distributed``.

Launched by ``torchrun`` (or ``python -m torch.distributed.run``), each process finds
RANK, WORLD_SIZE and LOCAL_RANK in its environment. :func:`init_from_env` then joins
the process group (nccl on CUDA, gloo on CPU) and :func:`wrap_model` wraps the model
in DistributedDataParallel, which averages gradients across ranks in backward.
Without those variables (or with WORLD_SIZE=1) everything here is a no-op, so the
training loop has one code path.

Data sampling is designed so that N ranks with batch B train exactly like one
process with batch N·B: every rank draws the same global batch of N·B windows from
one shared generator and keeps its own slice (:meth:`DistContext.shard`). Only rank 0
writes checkpoints, logs and plots.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from tinylm.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank in [0, world_size), local_rank on its node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this context initialised the process group

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes checkpoints, metrics, plots and logs."""
        return self.rank == 0

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's slice of a global batch (N·B, ...) -> (B, ...)."""
        if not self.enabled:
            return batch
        per_rank = batch.shape[0] // self.world_size
        return batch[self.rank * per_rank:(self.rank + 1) * per_rank]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; "
                          f"launch with torchrun, which sets it") from exc


def init_from_env(device_type: str = "cpu") -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1; else a single-process context.

    ``device_type`` picks the backend: nccl for "cuda", gloo otherwise. On CUDA each
    process uses GPU LOCAL_RANK (see :func:`device_for`).
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistContext()
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("WORLD_SIZE > 1 but this torch build has no torch.distributed; "
                          "run a single process or install a torch with distributed support")
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        _join(dist, backend)
        owns = True
        log.debug("rank %d/%d joined the %s process group", rank, world, backend)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, owns)


def _join(dist: Any, backend: str) -> None:
    """init_process_group from torchrun's environment. After a torchrun restart the
    agent's store still holds the previous attempt's keys (each rank's address): a rank
    that reads one before its peer rewrites it connects to a dead process. Each attempt
    therefore gets keys of its own (a prefix with TORCHELASTIC_RESTART_COUNT)."""
    restarts = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    if restarts == 0:
        dist.init_process_group(backend=backend)
        return
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"tinylm-attempt-{restarts}/", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)


def device_for(ctx: DistContext, device: torch.device) -> torch.device:
    """The device of this rank: cuda:LOCAL_RANK under multi-process CUDA, else ``device``."""
    if ctx.enabled and device.type == "cuda":
        return torch.device("cuda", ctx.local_rank)
    return device


def wrap_model(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """DistributedDataParallel around ``model`` when distributed, else ``model`` itself.

    DDP broadcasts rank 0's parameters at construction, so every rank starts equal.
    """
    if not ctx.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def all_reduce_max(values: list[float], ctx: DistContext) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (a consensus on stop flags)."""
    if not ctx.enabled:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_mean(t: Tensor, ctx: DistContext) -> Tensor:
    """The mean of a tensor over all ranks (``t`` itself when not distributed)."""
    if not ctx.enabled:
        return t
    import torch.distributed as dist

    out = t.detach().to(_comm_device(), torch.float64).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out / ctx.world_size


def broadcast_floats(values: list[float], ctx: DistContext) -> list[float]:
    """Rank 0's ``values`` on every rank (e.g. a schedule length estimated from its clock)."""
    if not ctx.enabled:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.broadcast(t, src=0)
    return t.tolist()


def all_gather_bytes(t: Tensor, ctx: DistContext) -> list[Tensor]:
    """Every rank's copy of a same-shaped uint8 tensor (e.g. RNG states), in rank order."""
    if not ctx.enabled:
        return [t]
    import torch.distributed as dist

    dev = _comm_device()
    parts = [torch.empty_like(t, device=dev) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.to(dev))
    return [p.cpu() for p in parts]


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    """Leave the process group if this context created it."""
    if ctx.enabled and ctx.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
