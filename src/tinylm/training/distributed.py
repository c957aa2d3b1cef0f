"""Multi-process training: the only module that touches ``torch.distributed``.

Launched by ``torchrun`` (or ``python -m torch.distributed.run``), each process finds
RANK, WORLD_SIZE and LOCAL_RANK in its environment. :func:`init_from_env` then joins
the process group (nccl on CUDA, gloo on CPU) and :func:`wrap_model` applies the
strategy (``TrainConfig.strategy``) from outside the model:

* ``ddp``: DistributedDataParallel; every rank holds the whole model, its gradients
  and the whole optimizer state; gradients are averaged in backward.
* ``zero1``: DDP, plus :func:`zero_optimizer` (``ZeroRedundancyOptimizer``): each rank
  keeps the optimizer state of its share of the parameters (whole tensors, so Muon's
  matrices stay whole) and broadcasts its updated share after the step.
* ``fsdp``: FSDP2 ``fully_shard`` on each block, then on the root: parameters,
  gradients and optimizer state are DTensors sharded on dim 0 across ranks; a block's
  parameters are gathered for its forward/backward only. Mixed precision: bf16
  parameters with fp32 gradient reduction on CUDA, fp32 throughout on CPU.

Without those variables (or with WORLD_SIZE=1) everything here is a no-op, so the
training loop has one code path.

Sharded checkpoints (zero1/fsdp): :func:`sharded_state` names every tensor of the
model and optimizer by parameter name (``model.<name>``, ``optim.<name>.<key>``);
:func:`save_shards` writes it with torch.distributed.checkpoint, every rank its own
shard, as safetensors files whose JSON header holds each shard's offsets (no pickle);
:func:`load_shards` reads it back into any layout (any number of ranks, any strategy,
or one process with no process group), resharding as it reads.

Data sampling is designed so that N ranks with batch B train exactly like one
process with batch N·B: every rank draws the same global batch of N·B windows from
one shared generator and keeps its own slice (:meth:`DistContext.shard`). Only rank 0
writes checkpoints, logs and plots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError, ConfigError, TinyLMError

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


def wrap_model(model: nn.Module, ctx: DistContext, device: torch.device,
               strategy: str = "ddp") -> nn.Module:
    """``model`` under ``strategy`` when distributed, else ``model`` itself.

    ddp/zero1: DistributedDataParallel, which broadcasts rank 0's parameters at
    construction, so every rank starts equal. fsdp: ``fully_shard`` each of
    ``model.blocks`` and then the root, in place (the returned module is ``model``,
    whose parameters are now DTensors); every rank built the same initial weights (same
    seed) or loads them afterwards, so nothing is broadcast.
    """
    if not ctx.enabled:
        return model
    if strategy == "fsdp":
        return _fully_shard(model, device)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def _fully_shard(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if device.type == "cuda" else MixedPrecisionPolicy())
    for block in getattr(model, "blocks", []):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def zero_optimizer(cls: type, groups: list[dict[str, Any]], kwargs: dict[str, Any],
                   ctx: DistContext) -> torch.optim.Optimizer:
    """``cls(groups, **kwargs)`` with its state sharded over the ranks (zero1): a
    ZeroRedundancyOptimizer whose ``optim`` is this rank's ``cls`` over its share."""
    if not ctx.enabled:
        return cls(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state (ZeroRedundancyOptimizer's ``optim``)."""
    return getattr(optimizer, "optim", optimizer)


def gradient_sync(model: nn.Module, ctx: DistContext, sync: bool) -> Any:
    """A context for one micro-batch's backward: gradients are reduced across ranks
    only when ``sync`` (the last micro-batch of an optimizer step)."""
    if not ctx.enabled or sync:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    model.set_requires_gradient_sync(False)  # FSDP2: accumulate unsharded, reduce later
    return contextlib.nullcontext()


@contextlib.contextmanager
def root_unsharded(model: nn.Module) -> Iterator[None]:
    """An fsdp model's root parameters (embeddings, final norm, head) gathered for the
    block: FSDP2 gathers them in the root's forward hook only, and a use that calls the
    model's methods instead (evaluation's ``hidden_states``) would see the shards. The
    blocks gather their own in their forward. A no-op for an unsharded model."""
    if not hasattr(model, "unshard"):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor (an all-gather of its shards), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of ``full`` as a DTensor laid out like ``like`` (every rank
    holds the same ``full``: sliced locally, no communication), else ``full``."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def local_bytes(tensors: Any) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


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
    """Leave the process group if this context created it (quietly when a peer is gone:
    the error that says so is already on its way)."""
    if ctx.enabled and ctx.owns_group:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError as exc:
                log.debug("leaving the process group: %s", exc)


class PeerLostError(TinyLMError):
    """Another rank of the process group died or was killed during a collective."""


#: What gloo and nccl say when a collective fails because a peer's connection is gone.
_PEER_GONE = re.compile(r"connection (?:reset|closed|refused)(?: by peer)?|read error|"
                        r"broken pipe|socket (?:closed|timeout)|remote process exited|"
                        r"communicator was aborted", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")


def reraise(exc: BaseException, ctx: DistContext) -> NoReturn:
    """Raise ``exc`` again, or, when it is a collective's failure because another rank
    died or was killed (gloo: "Connection reset by peer", "Read error", ...), a one-line
    :class:`PeerLostError` in its place (what a training's ``except`` calls)."""
    text = " ".join(str(exc).split())
    gone = _PEER_GONE.search(text)
    if (not ctx.enabled or not isinstance(exc, RuntimeError) or isinstance(exc, TinyLMError)
            or gone is None):
        raise exc
    peer = _PEER_ADDRESS.search(text)
    seen = f"{gone.group(0).lower()}" + (f" from {peer.group(1)}:{peer.group(2)}" if peer else "")
    raise PeerLostError(
        f"rank {ctx.rank} of {ctx.world_size}: another rank of the run died or was killed "
        f"({seen}); its own output says why. The run folder keeps its last checkpoint: "
        f"launch the same command again with --resume, or use torchrun --max-restarts N "
        f"to restart lost ranks by themselves") from None


def _comm_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- sharded checkpoints (torch.distributed.checkpoint) --------------------------------------


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Every tensor of ``model`` and of this rank's optimizer state, named by parameter:
    ``model.<name>`` (DTensor shards under fsdp) and ``optim.<name>.<key>`` for the
    parameters whose state this rank holds (all of them, or its share under zero1).
    Tensors that every rank holds whole are written once (by torch's deduplication)."""
    state: dict[str, Tensor] = {}
    inner = local_optimizer(optimizer)
    for name, p in model.named_parameters():
        state[f"model.{name}"] = p.detach()
        for key, value in inner.state.get(p, {}).items():
            if isinstance(value, Tensor):
                state[f"optim.{name}.{key}"] = value
    return state


def save_shards(state: dict[str, Tensor], folder: Path, ctx: DistContext) -> None:
    """Write ``state`` into ``folder`` (collective: every rank calls it, each writes its
    own safetensors file; fsynced). One process writes one file, with no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    folder.mkdir(parents=True, exist_ok=True)
    with _single_process_quiet():
        dcp.save(state, no_dist=not ctx.enabled,
                 storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes the intent is to load in a single process" even when
    told so (no_dist=True); one process is a supported layout here, not a mistake."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def shard_metadata(folder: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(global shape, dtype) of every tensor in a sharded checkpoint's ``folder``."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        meta = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # safetensors/DCP raise their own types for a corrupt file
        raise CheckpointError(f"cannot read the sharded checkpoint in {folder} ({exc}); "
                              f"the folder is corrupt or incomplete") from exc
    return {k: (tuple(v.size), v.properties.dtype) for k, v in meta.items()
            if hasattr(v, "size")}


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path,
                ctx: DistContext) -> None:
    """Fill ``model``'s parameters and (optionally) the optimizer state from ``folder``,
    whatever the number of ranks and the strategy that wrote it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = shard_metadata(folder)
    params = dict(model.named_parameters())
    missing = [n for n in params if f"model.{n}" not in meta]
    if missing:
        raise CheckpointError(f"the sharded checkpoint in {folder} has no weights for "
                              f"{missing[:3]}; it belongs to another model")
    state: dict[str, Tensor] = {f"model.{n}": p.detach() for n, p in params.items()}
    wanted = _optimizer_destinations(params, optimizer, meta) if optimizer is not None else {}
    state.update({key: t for key, (_, _, t) in wanted.items()})
    with torch.no_grad(), _single_process_quiet():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)),
                 no_dist=not ctx.enabled)
    if optimizer is not None:
        _set_optimizer_state(local_optimizer(optimizer), wanted)


def _optimizer_destinations(params: dict[str, Tensor], optimizer: torch.optim.Optimizer,
                            meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
                            ) -> dict[str, tuple[Tensor, str, Tensor]]:
    """key -> (parameter, state key, empty tensor to load into) for this rank's share."""
    inner = local_optimizer(optimizer)
    mine = {id(p) for g in inner.param_groups for p in g["params"]}
    out: dict[str, tuple[Tensor, str, Tensor]] = {}
    for name, p in params.items():
        if id(p) not in mine:
            continue
        prefix = f"optim.{name}."
        for key, (shape, dtype) in meta.items():
            sub = key[len(prefix):]
            if not key.startswith(prefix) or "." in sub:
                continue
            if shape == tuple(p.shape):
                dest = torch.zeros_like(p, dtype=dtype)  # a DTensor under fsdp
            else:
                dest = torch.zeros(shape, dtype=dtype)
            out[key] = (p, sub, dest)
    return out


def _set_optimizer_state(inner: torch.optim.Optimizer,
                         wanted: dict[str, tuple[Tensor, str, Tensor]]) -> None:
    """Through ``load_state_dict``, which casts and places each value as torch does."""
    sd = inner.state_dict()
    index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for p, sub, value in wanted.values():
        state.setdefault(index[id(p)], {})[sub] = value
    inner.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def full_model_state(model: nn.Module, ctx: DistContext) -> dict[str, Tensor]:
    """The whole weights of an fsdp model on rank 0 (CPU; collective), {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return state if ctx.is_main else {}


def broadcast_text(text: str, ctx: DistContext) -> str:
    """Rank 0's ``text`` on every rank (e.g. the name of a temporary folder)."""
    if not ctx.enabled:
        return text
    import torch.distributed as dist

    data = torch.zeros(4096, dtype=torch.uint8)
    raw = text.encode("utf-8")[:4095] if ctx.is_main else b""
    data[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    data = data.to(_comm_device())
    dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).rstrip(b"\0").decode("utf-8")


def all_gather_floats(values: list[float], ctx: DistContext) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), in rank order."""
    if not ctx.enabled:
        return [values]
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t)
    return [p.cpu().tolist() for p in parts]
