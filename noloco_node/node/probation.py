"""A downloaded state's probation: its first phases decide whether it is kept (docs/threat-model.md).

A donor's state is adopted only after it measured no worse than this node's own on this node's batches
(node/catch_up.py); a state made to pass that check and fail in training shows in the first phase's validation
loss. And a state that measures well can still be no part of the swarm: a donor that every member refused (a member
that turned hostile, refused by the loss check, trains alone and drifts) hands on weights as far from every other
member's as its own, and a joiner that adopted them was refused under the norm bound, and refused them, at every
outer step (0 blends in 36). So a state stays on probation until it blends, for up to PROBATION_PHASES phases: one
that has blended with nobody by then while this node refused partners of two network groups as too far is not
the swarm's either (groups, not keys: one host's free keys sending far weights condemn no honest state).
Judged at each outer step (node/outer_step.py, trainer thread): a bad one is rolled back to this node's own
checkpoint, or to the run's seed for a joiner (which then downloads again, from another donor), and its donor is
never asked again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from noloco_node.model.checkpoint_file import load_checkpoint
from noloco_node.training.replica import Replica

log = logging.getLogger(__name__)


# A downloaded state is on probation for its first phase: if this node's validation loss after it is worse than the
# donor's weights measured before adoption by more than this share (or not finite), the node goes back to its own
# checkpoint (or the seed) and never asks that donor again. A fresh Adam on adopted weights bumps the loss a little
# on its first steps; a state that was made to pass the check and fail in training bumps it a lot.
PROBATION_MARGIN = 0.25


# How many phases a downloaded state may go without a blend before the partners it refused as too far condemn it.
# An honest joiner in the bench blends at 80-90% of its outer steps; a drifted one at none.
PROBATION_PHASES = 8
# Network groups refused under the norm bound while on probation, with no blend, that condemn a state: by group,
# since free keys cost nothing (a flood of far payloads from one host condemns no honest state).
FAR_GROUPS = 2


@dataclass
class Probation:
    """A downloaded state's first phases, judged at each outer step (node/outer_step.py, trainer thread)."""

    checkpoint: Path  # this node's own checkpoint, if it has one: where a bad state is rolled back to
    refused_donors: set[str]  # shared with CatchUp: a donor whose state went bad is never asked again
    donor: str | None = None  # the donor of the state on probation; None: no state on probation
    adopted_loss: float = math.nan
    phases: int = 0  # judged so far
    far_mark: int = 0  # the norm bound's refusals when the state was adopted (PayloadAdmission.far_refusals)

    def begin(self, donor: str, loss: float, far_mark: int) -> None:
        """A state from ``donor`` adopted, measured at ``loss``; ``far_mark``: the norm bound's refusals then."""
        self.donor, self.adopted_loss, self.phases, self.far_mark = donor, loss, 0, far_mark

    @property
    def pending(self) -> bool:
        return self.donor is not None

    def judge(self, replica: Replica, val_loss: float, blended: bool, far_groups_since: Callable[[int], int]) -> bool:
        """After a phase on a downloaded state: keep it, or roll it back (True). ``blended``: whether this outer
        step blended; ``far_groups_since``: how many network groups this node refused under the norm bound after a
        mark (PayloadAdmission.far_groups_since). Rolling back loads this node's own checkpoint (a
        member) or the seed (a joiner) and refuses the donor for good."""
        donor = self.donor
        if donor is None:
            return False
        self.phases += 1
        held_up = math.isfinite(val_loss) and val_loss <= self.adopted_loss * (1 + PROBATION_MARGIN)
        far = far_groups_since(self.far_mark)
        if self.phases == 1 and not held_up:
            why = f"went bad in its first phase (validation loss {val_loss:.4f}, against {self.adopted_loss:.4f})"
        elif blended or (self.phases >= PROBATION_PHASES and far < FAR_GROUPS):
            self.donor = None  # it blends with the swarm (or nobody found it far): kept
            return False
        elif self.phases >= PROBATION_PHASES:
            why = f"blended with nobody in {self.phases} phases, and this node refused {far} network groups as too far"
        else:
            return False
        self.donor = None
        # Unbounded, and never evicted: each entry cost its donor a whole state upload that passed the loss check,
        # from a peer this node believes (standing), so it cannot be flooded.
        self.refused_donors.add(donor)
        if self.checkpoint.exists():
            replica.load_state_dict(load_checkpoint(self.checkpoint)["replica"])
            back_to = f"its own checkpoint (outer step {replica.outer_step})"
        else:
            replica.reset_to_seed()
            back_to = "the run's seed"
        log.warning(
            "the state downloaded from %s %s: rolled back to %s; that donor is not asked again", donor, why, back_to
        )
        return True
