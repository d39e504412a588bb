"""Faults a node can be told to simulate, for tests, drills and benchmarks: slower steps, emulated step times,
a crash at a given step, a hold at a given step until a file appears (a test's synchronisation with the node).

They are not settings (no flag, no settings-file field, nothing in ``join --help``): a node reads them from the
``NOLOCO_DRILL`` environment variable, a JSON object such as ``{"slow_factor": 5}``, checked like any setting (a
bad one stops the node with the field named). Each is a step hook of the inner loop (training/loop.py), composed in
only when asked for, so a production node runs none of this code.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from noloco_node.node.catch_up import NodeError
from noloco_node.training.loop import StepHook
from noloco_node.training.replica import Replica, StepLoss

DRILL_ENV = "NOLOCO_DRILL"
HOLD_LIMIT_SECONDS = 600.0  # a hold whose file never appears (its test died) ends on its own
HOLD_CHECK_SECONDS = 0.05

log = logging.getLogger(__name__)


class Drill(BaseModel):
    """The faults one node simulates."""

    model_config = ConfigDict(extra="forbid")

    slow_factor: float = Field(1.0, ge=1.0, description="Every inner step takes this many times longer.")
    step_time_seconds: float | None = Field(
        None,
        gt=0.0,
        description="Every inner step is stretched to this mean duration times a log-normal factor of spread "
        "step_time_sigma (mean 1), the straggler model of the paper's simulation (bench stragglers).",
    )
    step_time_sigma: float = Field(0.0, ge=0.0, le=3.0, description="Sigma of the log-normal step-time factor.")
    fail_at_inner_step: int | None = Field(None, ge=1, description="The trainer raises at this inner step.")
    hold_after_inner_step: int | None = Field(
        None,
        ge=1,
        description="After this inner step the trainer waits until release_file exists (HOLD_LIMIT_SECONDS at "
        "most), serving calls meanwhile: a test holds a node inside its run for as long as it needs it there.",
    )
    release_file: str | None = Field(None, description="The file whose appearance ends hold_after_inner_step.")

    @model_validator(mode="after")
    def _hold_needs_its_file(self) -> Drill:
        if (self.hold_after_inner_step is None) != (self.release_file is None):
            raise ValueError("hold_after_inner_step and release_file go together")
        return self

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Drill:
        """The drill ``NOLOCO_DRILL`` asks for (none when unset); NodeError naming the field when it is bad."""
        text = environ.get(DRILL_ENV, "").strip()
        if not text:
            return cls()
        try:
            return cls.model_validate_json(text)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the value'}: {e['msg']}" for e in error.errors())
            raise NodeError(f"${DRILL_ENV} {text!r}: {problems}") from None

    def environment(self) -> dict[str, str]:
        """The variable that gives a node process this drill."""
        return {DRILL_ENV: self.model_dump_json(exclude_defaults=True)}


def emulated_step_factor(rng: np.random.Generator, sigma: float) -> float:
    """A log-normal factor of mean 1 (mu = -sigma^2 / 2): how much longer or shorter this inner step takes (the
    straggler model of the NoLoCo paper's simulation, its Fig. 5B)."""
    return float(rng.lognormal(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0


def fault_hooks(drill: Drill, peer_id: str) -> list[StepHook]:
    """The step hooks this drill asks for (none by default)."""
    hooks: list[StepHook] = []
    if drill.slow_factor > 1.0:  # a straggler: a slower GPU, a busy machine
        factor = drill.slow_factor

        def slow(_replica: Replica, _loss: StepLoss, seconds: float) -> None:
            time.sleep((factor - 1.0) * seconds)

        hooks.append(slow)
    if drill.step_time_seconds is not None:  # bench stragglers: log-normal step times around a mean
        mean, sigma = drill.step_time_seconds, drill.step_time_sigma
        rng = np.random.default_rng(list(hashlib.sha256(peer_id.encode()).digest()[:8]))

        def paced(_replica: Replica, _loss: StepLoss, seconds: float) -> None:
            time.sleep(max(0.0, mean * emulated_step_factor(rng, sigma) - seconds))

        hooks.append(paced)
    if drill.fail_at_inner_step is not None:
        fail_at = drill.fail_at_inner_step

        def crash(replica: Replica, _loss: StepLoss, _seconds: float) -> None:
            if replica.inner_step >= fail_at:
                raise RuntimeError(f"injected fault at inner step {replica.inner_step} (fail_at_inner_step)")

        hooks.append(crash)
    if drill.hold_after_inner_step is not None and drill.release_file is not None:
        hold_at, release = drill.hold_after_inner_step, Path(drill.release_file)

        def hold(replica: Replica, _loss: StepLoss, _seconds: float) -> None:
            if replica.inner_step != hold_at:
                return
            waited, pause = 0.0, threading.Event()
            while not release.exists() and waited < HOLD_LIMIT_SECONDS:
                pause.wait(HOLD_CHECK_SECONDS)
                waited += HOLD_CHECK_SECONDS
            if not release.exists():
                log.warning("held after inner step %d for %.0fs: %s never appeared", hold_at, waited, release)

        hooks.append(hold)
    return hooks
