"""`noloco-node bench outer-step`: what an outer step and its upkeep cost beside the inner phase they follow.

One replica of a named size on this device (synthetic tokens, the node's own step plan) trains a few inner steps
to time one; a phase is H of them. Then the pieces of an outer step, each timed as the node runs them
(node/outer_step.py), with a partner's fp32 payload made from this replica's own weights:

- **gather**: theta copied to the host (the norm bound and the offers read it there);
- **blend**: the NoLoCo pair step (algorithm.noloco_pair_step) on the host, where the outer state lives;
- **adopt**: ``apply_outer_step`` (theta = phi again);
- **snapshot**: the upkeep on the trainer thread: phi, delta and Adam's moments copied into the reused snapshot
  buffers (training/checkpoints.py) that GetState serves and the checkpoint is written from;
- **checkpoint**: written from that snapshot by the writer thread while training goes on; timed, but off the
  critical path.

The share of a phase is (gather + blend + adopt + snapshot) / (H x step time).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from noloco_bench.train import step_shape, synthetic_replica
from noloco_node import algorithm
from noloco_node.config.models import TrainConfig
from noloco_node.security.payload_guard import relative_distance
from noloco_node.training.checkpoints import CheckpointWriter, Snapshots, replica_state_of
from noloco_node.training.replica import resolve_device


@dataclass
class OuterStepBenchResult:
    size: str
    device: str
    plan: str
    inner_steps: int
    step_seconds: float
    gather_seconds: float
    adopt_seconds: float
    snapshot_seconds: float
    checkpoint_seconds: float
    blend_seconds: float

    @property
    def phase_seconds(self) -> float:
        return self.inner_steps * self.step_seconds

    @property
    def share(self) -> float:
        critical = self.gather_seconds + self.blend_seconds + self.adopt_seconds + self.snapshot_seconds
        return critical / self.phase_seconds

    def report(self) -> str:
        lines = [
            f"model {self.size} on {self.device}",
            f"  {self.plan}",
            f"  inner step {self.step_seconds:.3f} s: a phase of H = {self.inner_steps} is {self.phase_seconds:.1f} s",
            f"  gather theta to the host {self.gather_seconds:.3f} s, blend {self.blend_seconds:.3f} s, adopt "
            f"{self.adopt_seconds:.3f} s, snapshot (upkeep) {self.snapshot_seconds:.3f} s",
            f"  outer step + upkeep = {self.share:.2%} of the phase",
        ]
        lines.append(f"  checkpoint written off the critical path in {self.checkpoint_seconds:.1f} s (writer thread)")
        return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, work: Callable[[], object]) -> float:
    _sync(device)
    started = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - started


def run_outer_step_bench(
    size: str = "small",
    *,
    inner_steps: int = 50,
    timed_steps: int = 3,
    batch_size: int | None = None,
    seq_len: int | None = None,
    vocab_size: int = 256,
    device: str = "auto",
) -> OuterStepBenchResult:
    torch_device = resolve_device(device)
    on_gpu = torch_device.type == "cuda"
    batch_size, seq_len = step_shape(torch_device, batch_size, seq_len)
    train_cfg = TrainConfig(
        model_size=size,
        batch_size=batch_size,
        seq_len=seq_len,
        inner_steps=inner_steps,
        total_steps=10 * inner_steps,
        warmup_steps=0,
        device=device,
    )
    replica = synthetic_replica(size, train_cfg, vocab_size, torch_device, steps=timed_steps + 6)
    for _ in range(2):
        replica.train_step()
    _sync(torch_device)
    started = time.perf_counter()
    for _ in range(timed_steps):
        replica.train_step()
    _sync(torch_device)
    step_seconds = (time.perf_counter() - started) / timed_steps

    # A partner's payload as the wire decodes it: fp32 host tensors (here: this replica's theta, nudged).
    partner_theta = [t.clone().mul_(1.001) for t in replica.fast_weights()]
    replica.train_step()  # theta moves on: the gather is a real copy again
    gather = _timed(torch_device, lambda: relative_distance(replica.fast_weights(), replica.phi))
    outcome: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    blend = _timed(
        torch_device,
        lambda: outcome.append(
            algorithm.noloco_pair_step(
                replica.fast_weights(),
                replica.phi,
                replica.delta,
                (partner_theta, [], []),
                alpha=0.5,
                beta=0.7,
                gamma=0.7,
            )
        ),
    )
    adopt = _timed(torch_device, lambda: replica.apply_outer_step(*outcome[0]))
    snapshots = Snapshots(replica)
    snapshots.take(replica).release()  # the buffers are allocated once, at start, in a node
    copies = []
    snapshot = _timed(torch_device, lambda: copies.append(snapshots.take(replica)))
    written = threading.Event()
    with tempfile.TemporaryDirectory() as folder:
        writer = CheckpointWriter(Path(folder) / "checkpoint.pt", on_written=written.set)
        writer.start()
        started = time.perf_counter()
        writer.submit(lambda: {"replica": replica_state_of(copies[0])}, copies[0].release)
        writer.flush()
        checkpoint = time.perf_counter() - started
        writer.close()
    return OuterStepBenchResult(
        size=size,
        device=str(torch_device) + (f" ({torch.cuda.get_device_name(torch_device)})" if on_gpu else ""),
        plan=replica.plan.summary(),
        inner_steps=inner_steps,
        step_seconds=step_seconds,
        gather_seconds=gather,
        adopt_seconds=adopt,
        snapshot_seconds=snapshot,
        checkpoint_seconds=checkpoint,
        blend_seconds=blend,
    )
