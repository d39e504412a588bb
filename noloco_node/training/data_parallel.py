"""One swarm member on several processes (several GPUs of one machine): its model sharded across them, one replica
outside.

Started under torchrun (``torchrun --nproc_per_node N -m noloco_node join ...``), every process trains the same
replica on its own slice of the member's data shard. The model and Adam are **sharded** across the ranks (FSDP2,
``fully_shard`` on each decoder block and on the whole): each rank holds 1/N of the weights, of the gradients and of
Adam's moments, gathers a block's weights for its forward and backward, and the gradients are reduce-scattered and
averaged at the last micro-batch of every inner step. A model too large for one GPU trains on several.

Only rank 0 is a swarm member: it runs the DHT, the gRPC service, the status endpoint and the pairing, holds the
member's outer state (phi, delta) whole on its host and takes the outer step (NoLoCo, eq. 3-5). Whatever it does
with the whole model between two phases (gather theta for the exchange, write the blended weights, evaluate a
candidate, take a snapshot, resume a checkpoint) the other ranks do with it: they wait in :meth:`Replica.follow`
for rank 0 to name the call (:meth:`DataParallel.announce`) and take their part in its collectives, until rank 0
lets them train again. The swarm sees one replica, exchanging one model-sized payload per outer step, whatever the
number of GPUs behind it.

Ranks agree on every inner step before taking it (a one-element all-reduce of a stop flag), so that a member that
stops (SIGTERM on rank 0, which torchrun forwards) stops all its ranks at the same step instead of leaving them
blocked in a collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from noloco_node.errors import NolocoError

log = logging.getLogger(__name__)


class DataParallel:
    """This process's place in a multi-process member, and the collectives the member needs."""

    def __init__(self, rank: int, world_size: int, local_rank: int, *, timeout_seconds: float = 1800.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.timeout = datetime.timedelta(seconds=timeout_seconds)
        self.started = False
        # Where the ranks train, as ``device`` resolved it: the collectives' backend follows it (NCCL moves only GPU
        # tensors, gloo only host ones), not whether this machine happens to have a GPU.
        self.on_gpu = False

    @classmethod
    def from_environment(cls, timeout_seconds: float = 1800.0) -> DataParallel | None:
        """The member's layout from torchrun's variables; None for a plain single-process node."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        return cls(
            int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")), timeout_seconds=timeout_seconds
        )

    @property
    def collective_device(self) -> torch.device:
        """Where small control tensors live for a collective: NCCL only moves GPU tensors."""
        return torch.device(f"cuda:{self.local_rank}") if self.on_gpu else torch.device("cpu")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def device(self, configured: str) -> str:
        """Each rank its own GPU (cuda:LOCAL_RANK) where the settings say auto or cuda; CPUs are shared. A member
        of more ranks than this machine has GPUs is refused: two ranks on one GPU would each hold the whole
        replica and gain nothing (and cuda:LOCAL_RANK would not exist)."""
        if configured in ("auto", "cuda") and torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            if self.local_rank >= gpus:
                raise DataParallelError(
                    f"rank {self.rank} is local rank {self.local_rank} of a member on a machine with {gpus} GPU(s): "
                    f"start torchrun with --nproc-per-node {gpus} at most (one rank per GPU), or --device cpu"
                )
            self.on_gpu = True
            return f"cuda:{self.local_rank}"
        self.on_gpu = configured.startswith("cuda")
        return configured

    def start(self) -> None:
        """Join the process group (rank 0 only after its DHT helper has forked: docs/architecture.md, start order)."""
        backend = "nccl" if self.on_gpu else "gloo"
        if self.on_gpu:
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=self.timeout)
        self.started = True
        log.info("rank %d of %d in a %s data-parallel member", self.rank, self.world_size, backend)

    def close(self) -> None:
        if self.started:
            dist.destroy_process_group()
            self.started = False

    def exit_process(self, code: int) -> NoReturn:
        """End this rank's process without Python's finalization, once its work is done and the group closed.

        Why: gloo's worker threads release a finished collective's tensors a moment after the caller's wait
        returns, and releasing a tensor that Python created takes the GIL. If the interpreter is finalizing by
        then, the thread cannot have it, and the process aborts ("terminate called without an active exception",
        SIGABRT; seen in 5 of 40 two-rank runs of a broadcast followed by exit, torch 2.13). destroy_process_group
        does not stop those threads. Everything a rank must leave behind (checkpoint, DHT record withdrawn, logs)
        is done before this is called; the logs are flushed here.
        """
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def share_shard_index(self, shard_index: int) -> int:
        """Rank 0's data shard (from its peer id, or configured) to every rank."""
        value = torch.tensor([shard_index], dtype=torch.int64, device=self.collective_device)
        dist.broadcast(value, src=0)
        return int(value.item())

    def shard(self, shard_index: int, num_shards: int) -> tuple[int, int]:
        """This rank's slice of the member's data shard, as (index, count) over num_shards x world_size slices."""
        return shard_index * self.world_size + self.rank, num_shards * self.world_size

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Shard ``model`` across the ranks in place (FSDP2): each decoder block its own unit, so that one block's
        weights are whole at a time, then the rest (embeddings, final norm, head) as the root. Its parameters become
        DTensors holding this rank's shard; take them from the model afterwards."""
        mesh = init_device_mesh(device.type, (self.world_size,))
        for block in getattr(model, "layers", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def announce(self, call: str, args: tuple[Any, ...] = ()) -> None:
        """Rank 0: name the whole-model call the other ranks take part in next (they wait in Replica.follow)."""
        dist.broadcast_object_list([call, args], src=0, device=self.collective_device)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """Another rank: the call rank 0 announced."""
        message: list[Any] = [None, None]
        dist.broadcast_object_list(message, src=0, device=self.collective_device)
        return message[0], message[1]

    def agree_to_continue(self, stop: bool, device: torch.device) -> bool:
        """Every rank calls this before each inner step; False (for all) as soon as any rank wants to stop."""
        flag = torch.tensor([1.0 if stop else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def agree_on_micro_batch(self, micro_batch: int, device: torch.device) -> int:
        """The smallest micro-batch any rank's probe chose (training/step_plan.py): the ranks accumulate as many
        micro-batches, and each rank's memory holds it."""
        value = torch.tensor([micro_batch], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())


class DataParallelError(NolocoError):
    """A multi-process member that cannot run as laid out (more ranks than GPUs)."""
