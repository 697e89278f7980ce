"""The trainer on torch.distributed: process group, model wrapping, the batch split, the rank protocol.

``dressage trainer`` started by ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` > 1 in the environment)
runs as N data-parallel ranks; started plainly it is one process and nothing here is initialised.

Invariants:
* the backend follows the device: NCCL when ``train.device`` is CUDA (rank ``r`` on ``cuda:LOCAL_RANK``),
  gloo otherwise. ``train.parallel`` picks DDP (weights replicated) or FSDP2 (``fully_shard``: every
  decoder layer and the root sharded, for models that do not fit one device). Under
  ``train.precision: bf16-mixed`` FSDP2 keeps the fp32 shards and computes in bf16
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; ``services.trainer.precision``);
* rank 0 alone talks to Redis. Every other rank only obeys rank 0's commands, one
  ``scatter_object_list`` per loop iteration: ``idle`` (no batch yet), ``step`` (its rows),
  ``export`` (join the gather of the full weights and optimizer state for a checkpoint), ``stop``;
* the split (``split_step``): rank 0 computes the step's rows with their advantages over whole
  groups and deals them to the minibatches (``batching.minibatches``); each minibatch's rows are sorted
  longest first (ties keep batch order) and row ``i`` goes to rank ``i % N`` (``split_rows``). Every rank
  gets one shard per minibatch, so every rank runs the same optimizer steps, and in each the same number
  of micro-batches (the largest any rank needs); a rank short of rows runs zero-weight ones (and empty
  proximal forwards), so DDP's and FSDP's collectives always pair up;
* each rank's loss is (its tokens' loss sum) / (the minibatch's loss tokens, all ranks) × N: torch
  averages gradients over ranks, so the reduced gradient is exactly the one-process gradient;
* rank 0 returns from a step only after an all-reduce that every rank enters after its
  ``optimizer.step()`` — a checkpoint, an acknowledgement or a version never precedes a rank's
  step. A rank that dies makes that collective raise on the others (gloo: at once; NCCL: after
  ``train.dist_timeout_s``): rank 0 exits non-zero with nothing acknowledged, and a restart
  re-reads the pending batch.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch

from services.trainer.batching import TrainRow, minibatches

log = logging.getLogger(__name__)

CommandKind = Literal["idle", "step", "export", "stop"]


@dataclass
class Shard:
    """One rank's part of a minibatch: its rows, the minibatch's loss-token count and the common micro-batch count."""

    rows: list[TrainRow]
    loss_tokens: int  # over every rank: the loss denominator of this minibatch's optimizer step
    n_micro: int  # micro-batches every rank runs for this minibatch
    micro_rows: int  # rows per micro-batch on this rank


@dataclass
class Command:
    kind: CommandKind
    shards: list[Shard] = field(default_factory=list)  # "step": this rank's part of each minibatch, in order
    meta: dict[str, Any] = field(default_factory=dict)


def split_rows(rows: Sequence[TrainRow], world: int, micro_rows: Any) -> list[Shard]:
    """Deal ``rows`` to ``world`` ranks (longest first, row i → rank i % world); ``micro_rows(n)`` sizes chunks."""
    ordered = sorted(range(len(rows)), key=lambda i: (-len(rows[i].token_ids), i))
    parts: list[list[TrainRow]] = [[] for _ in range(world)]
    for k, i in enumerate(ordered):
        parts[k % world].append(rows[i])
    loss_tokens = sum(sum(r.mask) for r in rows)
    sizes = [max(1, int(micro_rows(len(p)))) if p else 1 for p in parts]
    n_micro = max(1, max(-(-len(p) // s) for p, s in zip(parts, sizes, strict=True)))
    return [Shard(p, loss_tokens, n_micro, s) for p, s in zip(parts, sizes, strict=True)]


def split_step(rows: Sequence[TrainRow], world: int, n_minibatches: int, micro_rows: Any) -> list[list[Shard]]:
    """Per rank, its shard of every minibatch of the step (``minibatches``, then ``split_rows`` of each)."""
    per_minibatch = [split_rows(mb, world, micro_rows) for mb in minibatches(rows, n_minibatches)]
    return [[shards[r] for shards in per_minibatch] for r in range(world)]


def run_rank(run: Callable[[], int], parallel: Parallel) -> int:
    """``run()``'s exit code; under torchrun the process then ends with ``os._exit``.

    A gloo process group finalised by the interpreter can deadlock: the DDP reducer's destructor joins
    gloo's worker thread while holding the GIL, and that thread may need the GIL to release the last
    collective's tensors. A rank has nothing left to clean up once ``run`` returned (checkpoints are
    fsynced, Redis writes acknowledged), so it flushes its logs and leaves without finalisers; a rank
    that failed leaves with 1 the same way, its traceback logged.
    """
    if not parallel.distributed:
        return run()
    try:
        rc = run()
    except BaseException:
        log.exception("rank=%d failed", parallel.rank)
        rc = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def env_world_size(env: dict[str, str] | None = None) -> int:
    return int((env if env is not None else os.environ).get("WORLD_SIZE", "1"))


class Parallel:
    """This process's place among the ranks; world size 1 means a plain single process."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, mode: str = "ddp",
                 backend: str | None = None) -> None:
        self.rank, self.world, self.local_rank, self.mode, self.backend = rank, world, local_rank, mode, backend

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """The model is sharded by FSDP2 (which then casts parameters for compute itself)."""
        return self.distributed and self.mode == "fsdp"

    @classmethod
    def from_env(cls, device: str, mode: str, timeout_s: float) -> Parallel:
        """Join the process group torchrun describes (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``…), or stay single."""
        world = env_world_size()
        if world <= 1:
            return cls()
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") and torch.cuda.is_available() else "gloo"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
        me = cls(dist.get_rank(), dist.get_world_size(), local_rank, mode, backend)
        log.info("rank=%d/%d local_rank=%d backend=%s parallel=%s", me.rank, me.world, local_rank, backend, mode)
        return me

    def device(self, configured: str) -> str:
        """``cuda`` → ``cuda:LOCAL_RANK`` on a distributed run; anything else as configured."""
        if self.distributed and configured == "cuda":
            return f"cuda:{self.local_rank}"
        return configured

    # --- the model -------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The module to run forward on: the model itself, DDP around it, or the model sharded in place
        (``compute_dtype``: FSDP2 gathers the parameters in it and reduces gradients in fp32)."""
        if not self.distributed:
            return model
        if self.mode == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
                      if compute_dtype is not None else MixedPrecisionPolicy())
            inner = getattr(model, "model", None)
            for layer in getattr(inner, "layers", []):
                fully_shard(layer, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.local_rank] if self.backend == "nccl" else None
        return DistributedDataParallel(model, device_ids=ids)

    @contextmanager
    def no_sync(self, module: torch.nn.Module, skip: bool) -> Iterator[None]:
        """Accumulate without reducing gradients when ``skip`` (every micro-batch but the last)."""
        if not self.distributed or not skip:
            if self.sharded:
                module.set_requires_gradient_sync(True)  # type: ignore[operator]  # FSDP2/DDP method via Module.__getattr__
            yield
            return
        if self.mode == "fsdp":
            module.set_requires_gradient_sync(False)  # type: ignore[operator]  # FSDP2/DDP method via Module.__getattr__
            yield
            return
        with module.no_sync():  # type: ignore[operator]  # FSDP2/DDP method via Module.__getattr__
            yield

    def full_state(self, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(full weights or None = save the model as is, optimizer state) — a collective under FSDP."""
        if not self.sharded:
            return None, optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=opts)
        optim = get_optimizer_state_dict(model, optimizer, options=opts)
        return weights, optim

    def load_weights(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Full weights (every rank holds them) into the model, sharded or not."""
        if not self.sharded:
            model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                                 options=StateDictOptions(full_state_dict=True))

    # --- collectives ------------------------------------------------------------------------

    def all_reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        if not self.distributed:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return [float(v) for v in t.tolist()]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def command(self, kind: CommandKind, shards: list[list[Shard]] | None = None, **meta: Any) -> Command:
        """Rank 0: send ``kind`` (with rank i's shards) to every rank; returns rank 0's own command."""
        cmds = [Command(kind, shards[i] if shards else [], meta) for i in range(self.world)]
        return self._scatter(cmds)

    def receive(self) -> Command:
        """Ranks > 0: the next command from rank 0."""
        return self._scatter(None)

    def _scatter(self, cmds: list[Command] | None) -> Command:
        if not self.distributed:
            assert cmds is not None
            return cmds[0]
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(out, cmds, src=0)
        cmd: Command = out[0]
        return cmd

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
