"""The loss check of a blend: a partner's weights are blended only if the result measures no worse, on this node's
validation batches, than the outer step this node would take alone (docs/threat-model.md).

The norm bound (security/payload_guard.py) admits any partner whose weights sit within a distance of this node's;
inside it, a member that earned standing honestly and then turned can send weights chosen to hurt. Minus its own
slow weights at 0.85 of the bound, sent whenever it was drawn, raised a victim's final validation loss by 18-48% in
`noloco-node bench outsider --mode stream` (int8, 14-17 blends of 60 outer steps), and no bound along the weights
separates that from an honest partner's progress (a joiner's fresh Adam moves honest weights the same way, and so
did the error feedback of an earlier sparse wire; docs/threat-model.md, section 4). What a blend does to the model
is measured instead: both candidates, this node's outer step with the partner and without it, are evaluated on the
same batches (what the batches happen to favour cancels out), and the partner is refused when the blend is worse
than the step alone by more than it may be:

    blended - alone > max(LOSS_TOLERANCE * alone, GAIN_FACTOR * (earlier - alone) / phases)

``earlier`` being the loss of the slow weights this node had ``phases`` outer steps ago (GAIN_PHASES at most):
twice what its loss fell per outer step lately. An honest blend costs something when replicas that trained apart
moved a long way: early in a run (measured on the tiny model, H = 20, int8 stream: up to 8.4% worse than alone at
the second outer step, 0.38 nats, when that phase alone gained 1.14), and in overlap mode, whose partner's offer is
a phase old (up to 9.4% worse at the third outer step); from the seventh outer step of a stream run on, an honest
int8 blend was never more than 0.5% worse, and mostly 0.5-3% better. The turncoat's blends measured 26-57% worse
than alone, late in the run, where the loss falls by a few hundredths of a nat per outer step. Early in a run
the allowance is wide, and so is what a hostile partner may take back then.

It costs one evaluation per blended outer step (the adopted candidate's loss is the step's validation loss) and, on
a GPU, one copy of the parameters while a candidate is measured (Replica.loss_of).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_TOLERANCE = 0.01  # of the loss: what any blend may cost (the evaluation's noise from one outer step to the next)
GAIN_PHASES = 8  # the outer steps over which the recent fall of the loss is measured
GAIN_FACTOR = 2.0  # a blend may cost this many outer steps' worth of that fall


@dataclass(frozen=True)
class BlendVerdict:
    """The losses, on this node's validation batches, of its slow weights ``phases`` outer steps ago and of its two
    candidate outer steps now: with the partner and alone."""

    earlier: float
    phases: int
    blended: float
    alone: float

    @property
    def allowance(self) -> float:
        """How much worse than alone the blend may measure."""
        recent_gain = (self.earlier - self.alone) / max(1, self.phases)
        return max(LOSS_TOLERANCE * abs(self.alone), GAIN_FACTOR * recent_gain)

    @property
    def harmful(self) -> bool:
        """Whether the blend is worse than the step alone beyond the allowance (or not finite)."""
        if not math.isfinite(self.blended):
            return True
        return self.blended - self.alone > self.allowance

    def describe(self) -> str:
        return (
            f"the blend measured {self.blended:.4f} on this node's validation batches against {self.alone:.4f} for its "
            f"outer step alone (+{self.blended - self.alone:.4f}; allowed {self.allowance:.4f}: its loss fell from "
            f"{self.earlier:.4f} over {self.phases} outer steps)"
        )
