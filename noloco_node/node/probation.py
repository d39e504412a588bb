"""A downloaded state's probation: its first phase decides whether it is kept (docs/threat-model.md).

A donor's state is adopted only after it measured no worse than this node's own on this node's batches
(node/catch_up.py); a state made to pass that check and fail in training shows in the first phase's validation
loss. Judged at that outer step (node/outer_step.py, trainer thread): a bad one is rolled back to this node's own
checkpoint, or to the run's seed for a joiner, and its donor is never asked again.
"""

from __future__ import annotations

import logging
import math
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


@dataclass
class Probation:
    """A downloaded state's first phase, judged at its outer step (node/outer_step.py, trainer thread)."""

    checkpoint: Path  # this node's own checkpoint, if it has one: where a bad state is rolled back to
    refused_donors: set[str]  # shared with CatchUp: a donor whose state went bad is never asked again
    donor: str | None = None  # the donor of the state on probation; None: no state on probation
    adopted_loss: float = math.nan

    def begin(self, donor: str, loss: float) -> None:
        self.donor, self.adopted_loss = donor, loss

    @property
    def pending(self) -> bool:
        return self.donor is not None

    def judge(self, replica: Replica, val_loss: float) -> bool:
        """After the first phase on a downloaded state: keep it, or roll it back (True). Rolling back loads this
        node's own checkpoint (a member) or the seed (a joiner) and refuses the donor for good."""
        donor, self.donor = self.donor, None
        if donor is None or (math.isfinite(val_loss) and val_loss <= self.adopted_loss * (1 + PROBATION_MARGIN)):
            return False
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
            "the state downloaded from %s went bad in its first phase (validation loss %.4f, against %.4f when "
            "adopted): rolled back to %s; that donor is not asked again",
            donor,
            val_loss,
            self.adopted_loss,
            back_to,
        )
        return True
