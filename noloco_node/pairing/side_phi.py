"""A sparse stream run's slow weights on the wire: phi in the side-information code every phase, read against the
receiver's own phi, and each node's estimate of how far apart the swarm's replicas are.

The code (wire/side_info.py) sends each value modulo a grid whose step the sender chooses from its estimate of the
gap between replicas, per chunk of 4,096 values; the receiver measures the true gap of each chunk it reads from the
chunk's sketch. A node's estimate is made from the gaps it measured reading its partners' phi: the mean of the last
measurement and the estimate before it (the simulator's ``noloco-sparse-side``, docs/algorithm-study.md). The swarm's
replicas are about as far apart from one another as from any partner, so a partner's gap predicts the next one's.
Before a node has measured one, its step is 0: its partners keep their own phi for it (a blend with phi_i + D_j).

The seeds of signs and dither come from the run, the sender, the outer step and the tensor (side_info.seed_of):
both sides derive them, none crosses. Small and one-dimensional tensors travel in int8 (side_info.side_coded).

Trainer thread only: it encodes at the start of each phase and reads a partner's phi after the exchange, and the
estimates are its state (a checkpoint keeps them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from noloco_node.wire import side_info


class SidePhi:
    def __init__(self, shapes: Sequence[tuple[int, ...]], run_fingerprint: str) -> None:
        self.shapes = [tuple(shape) for shape in shapes]
        self.run_fingerprint = run_fingerprint
        # Per side-coded tensor (by its index): the estimated RMS gap of each chunk, (chunks,) fp32.
        self.estimates: dict[int, torch.Tensor] = {}

    def coded(self, index: int) -> bool:
        return side_info.side_coded(self.shapes[index])

    @torch.no_grad()
    def encode(self, phi: Sequence[torch.Tensor], sender: str, outer_step: int) -> list[torch.Tensor]:
        """What this node's phase payload carries of its ``phi``: each side-coded tensor's wire bytes (uint8), the
        others as they are (the publisher writes them in int8)."""
        return [
            side_info.pack(
                side_info.encode(
                    tensor.detach().to("cpu", torch.float32),
                    self.estimates.get(index),
                    side_info.seed_of(self.run_fingerprint, sender, outer_step, index),
                )
            )
            if self.coded(index)
            else tensor
            for index, tensor in enumerate(phi)
        ]

    @torch.no_grad()
    def read(
        self, sent: Sequence[torch.Tensor], own: Sequence[torch.Tensor], sender: str, outer_step: int
    ) -> list[torch.Tensor]:
        """A partner's phi as this node reads it (fp32, on the device of ``own``): each side-coded tensor (its
        checked wire bytes) decoded against this node's ``own`` phi, the others as they arrived; the gaps measured
        update this node's estimates."""
        seen = []
        for index, (tensor, mine) in enumerate(zip(sent, own, strict=True)):
            if not self.coded(index):
                seen.append(tensor.to(mine.device, torch.float32))
                continue
            numel = math.prod(self.shapes[index])
            values, gap = side_info.decode(
                side_info.unpack(tensor, numel),
                mine.detach().to("cpu", torch.float32),
                side_info.seed_of(self.run_fingerprint, sender, outer_step, index),
            )
            earlier = self.estimates.get(index)
            self.estimates[index] = gap if earlier is None else (gap + earlier) / 2
            seen.append(values.to(mine.device))
        return seen

    def state(self) -> dict[int, torch.Tensor]:
        return dict(self.estimates)

    def restore(self, estimates: dict[int, torch.Tensor]) -> None:
        """A checkpoint's estimates; ValueError, changing nothing, when they do not fit the model's shapes."""
        for index, estimate in estimates.items():
            if not (0 <= index < len(self.shapes) and self.coded(index)):
                raise ValueError(f"the checkpoint's gap estimate for tensor {index} fits no side-coded tensor")
            chunks = math.ceil(math.prod(self.shapes[index]) / side_info.CHUNK)
            if tuple(estimate.shape) != (chunks,):
                raise ValueError(f"the checkpoint's gap estimate for tensor {index} is not {chunks} chunks long")
        self.estimates = {index: estimate.to(torch.float32) for index, estimate in estimates.items()}
