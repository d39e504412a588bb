"""The loss check's rule (node/blend_check.py), on the losses measured in `bench outsider --mode stream`."""

from __future__ import annotations

import math

from noloco_node.node.blend_check import BlendVerdict


def test_an_early_blend_may_give_back_what_the_phase_gained_and_a_late_one_only_one_percent() -> None:
    # The second outer step of an honest int8 run: 8.4% worse than alone, from a phase that gained 1.14 nats.
    assert not BlendVerdict(start=5.69, blended=4.93, alone=4.55).harmful
    # Late in the run: an honest blend within 1% of the loss, the turncoat's 26% worse than alone.
    assert not BlendVerdict(start=1.905, blended=1.905, alone=1.89).harmful
    assert BlendVerdict(start=1.905, blended=2.38, alone=1.89).harmful
    # A phase that gained nothing (or lost) allows 1% of the loss, no less.
    assert BlendVerdict(start=1.85, blended=1.93, alone=1.89).harmful
    assert not BlendVerdict(start=1.85, blended=1.905, alone=1.89).harmful


def test_a_blend_that_measures_nothing_finite_is_harmful() -> None:
    assert BlendVerdict(start=1.9, blended=math.nan, alone=1.89).harmful
    assert BlendVerdict(start=1.9, blended=math.inf, alone=1.89).harmful
    assert "allowed 0.0189" in BlendVerdict(start=1.85, blended=1.93, alone=1.89).describe()
