"""Whole tensors from, and into, the sharded tensors of a member of several ranks (training/data_parallel.py).

A sharded member's weights and Adam moments are DTensors: each rank holds a slice along the first dimension. Rank 0
reads and writes them whole (the outer step, the exchange, checkpoints); every rank takes part in the collective,
one tensor at a time, so that no rank ever holds more than one whole tensor beyond its shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a view: writing it writes the tensor); a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def gather_whole(tensors: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None) -> None:
    """Every rank: all-gather each sharded tensor; rank 0 copies it whole into ``into`` (its host buffers, in the
    same order), the others pass None."""
    for index, tensor in enumerate(tensors):
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if into is not None:
            into[index].copy_(whole)
        del whole


@torch.no_grad()
def scatter_whole(tensors: Sequence[torch.Tensor], whole: Sequence[torch.Tensor] | None) -> None:
    """Every rank: write rank 0's whole tensors (``whole``, in the same order; None on the other ranks) into each
    rank's shards of ``tensors``."""
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor):
            if whole is not None:
                tensor.copy_(whole[index])
            continue
        local = tensor.to_local()
        source = (
            whole[index].to(device=local.device, dtype=local.dtype)
            if whole is not None
            else torch.empty(tensor.shape, dtype=local.dtype, device=local.device)
        )
        # src_data_rank=0: rank 0's tensor is scattered, the others' (allocated only to say the shape) are ignored.
        shard = distribute_tensor(source, tensor.device_mesh, tensor.placements, src_data_rank=0)
        local.copy_(shard.to_local())
        del source, shard
