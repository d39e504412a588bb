"""The one inner training loop: H inner steps of a replica, then the caller's outer sync, until the run ends.

NoLoCo (arXiv 2506.10911, section 3; docs/architecture.md, "The algorithm"): each inner phase runs H steps of
Adam from theta = phi; the outer step that follows is the caller's business. :meth:`InnerLoop.phases` yields one
:class:`InnerPhase` at every multiple of H (and at the run's last step); the caller blends between two ``next()``
calls, so every user of the loop shares the same phase boundaries:

- the node (node/outer_step.py): the outer step with a peer, chosen by the pairing strategy;
- ``noloco-node train`` (training/solo.py): a solo outer step;
- the multi-GPU follower (training/follower.py): adopt rank 0's blended weights;
- the simulator: N loops advanced in lockstep, the outer step across them.

A stop request ends the loop at the next step boundary; a phase cut short by it yields nothing (no outer step
on a partial phase). In a data-parallel member the ranks agree on every step (``Replica.train_step`` returns None
once any of them stops), so they all leave at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from noloco_node.training.replica import Replica, StepLoss

# Called after every inner step with (replica, loss, seconds the step took); runs on the training thread. The loss
# is read (``float(loss)``) only where a figure is needed: on a GPU that waits for the step to finish.
StepHook = Callable[[Replica, StepLoss, float], None]


@dataclass
class InnerPhase:
    """What one inner phase did: its losses and wall time, and where it ended."""

    losses: list[StepLoss] = field(default_factory=list)
    seconds: float = 0.0
    end_step: int = 0

    @property
    def mean_loss(self) -> float:
        return sum(float(loss) for loss in self.losses) / len(self.losses) if self.losses else float("nan")


class InnerLoop:
    """Inner phases of one replica up to ``total_steps``, each ending at a multiple of ``inner_steps``."""

    def __init__(
        self,
        replica: Replica,
        *,
        total_steps: int,
        inner_steps: int,
        stop_requested: Callable[[], bool] = lambda: False,
        after_step: Sequence[StepHook] = (),
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        self.replica = replica
        self.total_steps = total_steps
        self.inner_steps = inner_steps
        self.stop_requested = stop_requested
        self.after_step = list(after_step)
        self.stopped_by_ranks = False  # a data-parallel member whose ranks agreed to stop

    @property
    def _agreed_stop(self) -> bool:
        """A stop request ends the loop here, unless this is a data-parallel member: there it is agreed with the
        other ranks inside the next step, so that every rank leaves at the same step and none waits in a collective
        the others never join (a phase that completed is always followed by its outer step and broadcast)."""
        return self.replica.data_parallel is None and self.stop_requested()

    def phases(self) -> Iterator[InnerPhase]:
        replica = self.replica
        while replica.inner_step < self.total_steps and not self._agreed_stop and not self.stopped_by_ranks:
            phase = InnerPhase()
            started = time.monotonic()
            while True:
                if self._agreed_stop:
                    return  # mid-phase: no outer step on a partial phase
                step_started = time.monotonic()
                loss = replica.train_step(stop=self.stop_requested())
                if loss is None:  # the ranks of a data-parallel member agreed to stop
                    self.stopped_by_ranks = True
                    return
                seconds = time.monotonic() - step_started
                for hook in self.after_step:
                    hook(replica, loss, seconds)
                phase.losses.append(loss)
                if replica.inner_step % self.inner_steps == 0 or replica.inner_step >= self.total_steps:
                    break
            if self._agreed_stop:
                return  # asked to stop during the phase: leave without an outer step
            phase.seconds = time.monotonic() - started
            phase.end_step = replica.inner_step
            yield phase
