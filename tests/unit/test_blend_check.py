"""The loss check's rule (node/blend_check.py), on losses measured in `bench outsider --mode stream`."""

from __future__ import annotations

import math

from noloco_node.node.blend_check import BlendVerdict


def test_a_blend_may_cost_twice_the_recent_fall_of_the_loss_per_outer_step_or_one_percent() -> None:
    # The second outer step of an honest int8 run: 0.38 nats worse than alone, the loss falling ~0.6 a step.
    assert not BlendVerdict(earlier=5.69, phases=2, blended=4.93, alone=4.55).harmful
    # Late in the run, the loss falling 0.01 a step: an honest blend within 1% of the loss is taken, the
    # turncoat's (26% worse than alone) is not.
    assert not BlendVerdict(earlier=1.97, phases=8, blended=1.905, alone=1.89).harmful
    assert BlendVerdict(earlier=1.97, phases=8, blended=2.38, alone=1.89).harmful
    # A loss that did not fall (or rose) allows 1% of the loss, no less.
    assert BlendVerdict(earlier=1.85, phases=8, blended=1.93, alone=1.89).harmful
    assert not BlendVerdict(earlier=1.85, phases=8, blended=1.905, alone=1.89).harmful


def test_a_blend_that_measures_nothing_finite_is_harmful() -> None:
    assert BlendVerdict(earlier=1.9, phases=1, blended=math.nan, alone=1.89).harmful
    assert BlendVerdict(earlier=1.9, phases=1, blended=math.inf, alone=1.89).harmful
    assert "allowed 0.0189" in BlendVerdict(earlier=1.85, phases=8, blended=1.93, alone=1.89).describe()
