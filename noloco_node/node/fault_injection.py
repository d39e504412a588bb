"""Faults a node can be told to simulate, for tests, drills and benchmarks: slower steps, emulated step times,
a crash at a given step. Each is a step hook of the inner loop (training/loop.py), composed in only when its
setting is given, so a production node runs none of this code.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from noloco_node.config.models import NodeConfig
from noloco_node.training.loop import StepHook
from noloco_node.training.replica import Replica


def emulated_step_factor(rng: np.random.Generator, sigma: float) -> float:
    """A log-normal factor of mean 1 (mu = -sigma^2 / 2): how much longer or shorter this inner step takes (the
    straggler model of the NoLoCo paper's simulation, its Fig. 5B)."""
    return float(rng.lognormal(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0


def fault_hooks(cfg: NodeConfig, peer_id: str) -> list[StepHook]:
    """The step hooks these settings ask for (none by default)."""
    hooks: list[StepHook] = []
    if cfg.slow_factor > 1.0:  # a straggler: a slower GPU, a busy machine
        factor = cfg.slow_factor

        def slow(_replica: Replica, _loss: float, seconds: float) -> None:
            time.sleep((factor - 1.0) * seconds)

        hooks.append(slow)
    if cfg.step_time_seconds is not None:  # bench stragglers: log-normal step times around a mean
        mean, sigma = cfg.step_time_seconds, cfg.step_time_sigma
        rng = np.random.default_rng(list(hashlib.sha256(peer_id.encode()).digest()[:8]))

        def paced(_replica: Replica, _loss: float, seconds: float) -> None:
            time.sleep(max(0.0, mean * emulated_step_factor(rng, sigma) - seconds))

        hooks.append(paced)
    if cfg.fail_at_inner_step is not None:
        fail_at = cfg.fail_at_inner_step

        def crash(replica: Replica, _loss: float, _seconds: float) -> None:
            if replica.inner_step >= fail_at:
                raise RuntimeError(f"injected fault at inner step {replica.inner_step} (fail_at_inner_step)")

        hooks.append(crash)
    return hooks
