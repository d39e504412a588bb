"""The loss check of a blend: a partner's weights are blended only if the result measures no worse, on this node's
validation batches, than the outer step this node would take alone (docs/threat-model.md).

The norm bound (security/payload_guard.py) admits any partner whose weights sit within a distance of this node's;
inside it, a member that earned standing honestly and then turned can send weights chosen to hurt. Minus its own
slow weights at 0.85 of the bound, sent whenever it was drawn, raised a victim's final validation loss by 18-48% in
`noloco-node bench outsider --mode stream` (int8, 14-17 blends of 60 outer steps), and no bound along the weights
separates that from an honest partner's progress (a joiner's fresh Adam, or a sparse code's error feedback, moves
honest weights the same way; docs/threat-model.md, section 4). What a blend does to the model is measured instead:
both candidates, this node's outer step with the partner and without it, are evaluated on the same batches (what
the batches happen to favour cancels out), and the partner is refused when the blend is worse than the step alone
by more than it may be:

    blended - alone > max(LOSS_TOLERANCE * alone, start - alone)

``start`` being the loss of the slow weights this phase began from. An honest blend costs something only early in a
run, when replicas that trained apart for one phase each moved a long way (measured on the tiny model, H = 20, int8
stream, three runs: up to 8.4% worse than alone at the second outer step, 0.38 nats against a phase that gained
1.14; from the seventh on, never more than 0.5% worse, and mostly 0.5-3% better). So a blend may give back up to
what this node's own phase gained, and 1% of the loss besides. The turncoat's blends measured 26-57% worse than
alone, late in the run, where a phase gains a few hundredths of a nat.

It costs one evaluation per blended outer step (the adopted candidate's loss is the step's validation loss) and, on
a GPU, one copy of the parameters while a candidate is measured (Replica.loss_of).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_TOLERANCE = 0.01  # of the loss: what a blend may cost beyond the phase's own gain (evaluation noise)


@dataclass(frozen=True)
class BlendVerdict:
    """The losses, on this node's validation batches, of the slow weights its phase began from and of its two
    candidate outer steps: with the partner and alone."""

    start: float
    blended: float
    alone: float

    @property
    def allowance(self) -> float:
        """How much worse than alone the blend may measure: the phase's own gain, or LOSS_TOLERANCE of the loss."""
        return max(LOSS_TOLERANCE * abs(self.alone), self.start - self.alone)

    @property
    def harmful(self) -> bool:
        """Whether the blend is worse than the step alone beyond the allowance (or not finite)."""
        if not math.isfinite(self.blended):
            return True
        return self.blended - self.alone > self.allowance

    def describe(self) -> str:
        return (
            f"the blend measured {self.blended:.4f} on this node's validation batches against {self.alone:.4f} for its "
            f"outer step alone (+{self.blended - self.alone:.4f}; allowed {self.allowance:.4f}: its phase gained "
            f"{self.start - self.alone:.4f} from {self.start:.4f})"
        )
