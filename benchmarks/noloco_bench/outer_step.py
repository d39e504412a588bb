"""`noloco-node bench outer-step`: what an outer step and its upkeep cost beside the inner phase they follow.

One replica of a named size on this device (synthetic tokens, the node's own step plan) trains a few inner steps
to time one; a phase is H of them. Then the pieces of an outer step with a partner, each timed as the node runs
them (node/outer_step.py), with a partner's fp32 payload on the host made from this replica's own weights:

- **movement**: ||theta - phi|| / ||phi||, which sets the norm bound a partner is checked against;
- **gather**: theta copied to the host, where the exchange sends it from;
- **blends**: the two candidates of the loss check (node/blend_check.py): the step alone and the blend with the
  partner (algorithm.noloco_pair_step), the partner's host tensors moved to where the outer state lives;
- **check**: the two candidates' validation losses, on batches of the node's own shape (``eval_batches`` x
  ``eval_batch_size`` sequences), after one evaluation untimed (the node's first compiles the blocks for it);
- **adopt**: ``apply_outer_step`` (theta = phi again);
- **snapshot**: the upkeep on the trainer thread: phi, delta and Adam's moments copied into the reused snapshot
  buffers (training/checkpoints.py) that GetState serves and the checkpoint is written from;
- **checkpoint**: written from that snapshot by the writer thread while training goes on; timed, but off the
  critical path.

On a GPU the pieces are timed twice in the same run: with the outer state where the plan put it (on the GPU when
it fits: training/step_plan.py) and with it in pinned host memory, the placement of a member whose GPU has no room
for it. The share of a phase is the sum of the pieces before the checkpoint over H x the step's time.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from noloco_bench.train import step_shape, synthetic_replica
from noloco_node import algorithm
from noloco_node.config.models import TrainConfig
from noloco_node.security.payload_guard import relative_distances
from noloco_node.training.checkpoints import CheckpointWriter, Snapshots, replica_state_of
from noloco_node.training.replica import Batch, Replica, resolve_device


@dataclass
class OuterStepParts:
    """One placement's timings of the outer step's pieces (seconds)."""

    placement: str  # where the outer state lived: "the GPU", "the host", "the CPU"
    movement: float
    gather: float
    blends: float
    check: float
    adopt: float
    snapshot: float

    @property
    def critical(self) -> float:
        return self.movement + self.gather + self.blends + self.check + self.adopt + self.snapshot


@dataclass
class OuterStepBenchResult:
    size: str
    device: str
    plan: str
    inner_steps: int
    step_seconds: float
    validation_tokens: int
    checkpoint_seconds: float
    placements: list[OuterStepParts] = field(default_factory=list)

    @property
    def phase_seconds(self) -> float:
        return self.inner_steps * self.step_seconds

    def share(self, parts: OuterStepParts) -> float:
        return parts.critical / self.phase_seconds

    def report(self) -> str:
        lines = [
            f"model {self.size} on {self.device}",
            f"  {self.plan}",
            f"  inner step {self.step_seconds:.3f} s: a phase of H = {self.inner_steps} is {self.phase_seconds:.1f} s",
            f"  the loss check evaluates {self.validation_tokens:,} validation tokens per candidate (two candidates)",
        ]
        for parts in self.placements:
            lines += [
                f"  outer state on {parts.placement}: movement {parts.movement:.3f} s, gather theta to the host "
                f"{parts.gather:.3f} s, blends {parts.blends:.3f} s, loss check {parts.check:.3f} s, adopt "
                f"{parts.adopt:.3f} s, snapshot (upkeep) {parts.snapshot:.3f} s",
                f"    outer step + upkeep = {parts.critical:.3f} s = {self.share(parts):.2%} of the phase",
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


def _validation(train_cfg: TrainConfig, vocab_size: int) -> list[Batch]:
    """Synthetic validation batches of the node's shape (node/trainer.py): the loss check's cost is their size."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(train_cfg.eval_batches):
        tokens = torch.randint(0, vocab_size, (train_cfg.eval_batch_size, train_cfg.seq_len + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _time_parts(replica: Replica, placement: str, validation: list[Batch]) -> OuterStepParts:
    """One outer step with a partner, piece by piece, as node/outer_step.py takes it."""
    device = replica.device
    replica.train_step()  # theta moves on: the gather is a real copy again
    partner = [t.clone().mul_(1.001) for t in replica.fast_weights()]  # as the wire decodes it: fp32 on the host
    replica.train_step()
    movement = _timed(device, lambda: relative_distances(replica.outer_theta(), replica.phi))
    gather = _timed(device, replica.fast_weights)

    def step(received: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] | None) -> tuple:
        return algorithm.noloco_pair_step(
            replica.outer_theta(), replica.phi, replica.delta, received, alpha=0.5, beta=0.7, gamma=0.7
        )

    candidates: list[tuple] = []
    blends = _timed(device, lambda: candidates.extend([step(None), step((partner, [], []))]))
    check = _timed(device, lambda: [replica.loss_of(phi, validation) for phi, _ in candidates])
    adopt = _timed(device, lambda: replica.apply_outer_step(*candidates[1]))
    snapshots = Snapshots(replica)
    snapshots.take(replica).release()  # the buffers are allocated once, at start, in a node
    snapshot = _timed(device, lambda: snapshots.take(replica).release())
    return OuterStepParts(placement, movement, gather, blends, check, adopt, snapshot)


def _outer_state_to_host(replica: Replica) -> None:
    """The placement of a member whose GPU has no room for the outer state: pinned host memory."""
    replica.phi = [t.to("cpu").pin_memory() for t in replica.phi]
    replica.delta = [t.to("cpu").pin_memory() for t in replica.delta]
    replica.outer_device = torch.device("cpu")
    torch.cuda.empty_cache()


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
    replica = synthetic_replica(size, train_cfg, vocab_size, torch_device, steps=timed_steps + 12)
    for _ in range(2):
        replica.train_step()
    _sync(torch_device)
    started = time.perf_counter()
    for _ in range(timed_steps):
        replica.train_step()
    _sync(torch_device)
    step_seconds = (time.perf_counter() - started) / timed_steps

    validation = _validation(train_cfg, vocab_size)
    replica.evaluate(validation)  # a node's first evaluation compiles the blocks for it, once
    placements = []
    if not on_gpu:
        placements.append(_time_parts(replica, "the CPU", validation))
    else:
        if replica.outer_device.type == "cuda":
            placements.append(_time_parts(replica, "the GPU", validation))
            _outer_state_to_host(replica)
        placements.append(_time_parts(replica, "the host", validation))

    snapshots = Snapshots(replica)
    copy = snapshots.take(replica)
    written = threading.Event()
    with tempfile.TemporaryDirectory() as folder:
        writer = CheckpointWriter(Path(folder) / "checkpoint.pt", on_written=written.set)
        writer.start()
        started = time.perf_counter()
        writer.submit(lambda: {"replica": replica_state_of(copy)}, copy.release)
        writer.flush()
        checkpoint = time.perf_counter() - started
        writer.close()
    return OuterStepBenchResult(
        size=size,
        device=str(torch_device) + (f" ({torch.cuda.get_device_name(torch_device)})" if on_gpu else ""),
        plan=replica.plan.summary(),
        inner_steps=inner_steps,
        step_seconds=step_seconds,
        validation_tokens=train_cfg.eval_batches * train_cfg.eval_batch_size * seq_len,
        checkpoint_seconds=checkpoint,
        placements=placements,
    )
